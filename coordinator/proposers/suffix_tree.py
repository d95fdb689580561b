"""Suffix decoding's data structure (SuffixDecoding, arXiv 2411.04975), used by coordinator/proposers/suffix.py.

A session's own tree (prompt + output) and the coordinator's shared one (recent finished outputs,
coordinator/proposers/suffix_cache.py) match
the sequence's last tokens; from each match length m the chain follows the most frequent continuation
while its estimated probability stays >= min_token_prob, for at most m * max_spec_factor +
max_spec_offset tokens; the chain with the largest score (its probabilities' sum) wins.

The tree is a depth-bounded, path-compressed suffix tree over several sequences: every suffix of
every sequence is indexed up to max_depth tokens. A node's `count` is the number of suffixes that
pass through its edge; its `total` is how many of those continue past the edge's end. Nodes sit only
where the tree branches or a suffix ends, so it holds O(tokens) nodes; edge labels are copied into
compact int arrays (at most max_depth tokens each). Costs, with D = max_depth: appending a token O(D)
(the sequence's last D suffixes move down one token; those that occur once, each alone at a leaf, only at
the end of the extend() call that appends them: on chat text most of them, 4.7 -> 2.0 us a prompt token);
removing a sequence of n tokens O(n D); speculating O(D) per match length from the session's own tree (its
suffixes' positions are kept), O(D^2) at worst from the shared tree (each match length is walked from the root).
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from dataclasses import dataclass, field

from coordinator.proposers.token_tree import TreeBuilder
from specdec.core.settings import setting


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding."""
    max_depth: int = 24  # longest indexed substring (match + proposal), vLLM's default
    # A match of m tokens proposes at most m * factor + offset tokens (ArcticInference's max_spec_factor /
    # max_spec_offset, whose defaults are 1 and 0). With a verify nearly flat in K a longer chain costs little:
    # on recorded greedy outputs of the default target, 2 and 2 give 8-13% more tokens per forward than 1 and 0
    # on the template and grounded workloads (docs/bench-logs/2026-11.md, "suffix decoding's chain limit").
    max_spec_factor: float = 2.0
    max_spec_offset: float = 2.0  # see --suffix-max-spec-factor
    min_token_prob: float = 0.1  # stop the chain when its estimated probability falls below this
    min_match: int = 1  # the shortest match (the context's last tokens found in a tree) that proposes
    cache_entries: int = 1024  # finished outputs kept in the tree shared by all sessions (0 = no shared tree)
    cache_bytes: int = setting(64 << 20, flag="suffix-cache-mb", parse=lambda mib: int(float(mib) * 2**20),
                               show=lambda b: f"{b / 2**20:g}")  # estimated memory bound of the shared tree, MiB
    cache_context: int = 4  # prompt tokens stored before each output, so output starts can be predicted
    prior_acceptance: float = 0.5  # the strategy's per-token acceptance before any round, where its chain has no probs
    decay: float = 0.9  # weight of the past per round in the strategy's estimates (~10-round memory)
    watch: int = 2  # sessions with no taught prior: drafts judged against the committed tokens before the first drafted

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise ValueError(f"suffix max_depth must be >= 2, got {self.max_depth}")
        if self.max_spec_factor < 0 or self.max_spec_offset < -self.max_depth:
            raise ValueError("suffix max_spec_factor must be >= 0 (and max_spec_offset > -max_depth)")
        if self.min_match < 1:
            raise ValueError(f"suffix min_match must be >= 1, got {self.min_match}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.cache_entries < 0 or self.cache_bytes < 0 or self.cache_context < 0:
            raise ValueError("suffix cache_entries, cache_bytes and cache_context must be >= 0")


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)  # the proposed chain
    probs: list[float] = field(default_factory=list)  # probs[i]: estimated P(tokens[0..i] all right), non-increasing
    match_len: int = 0  # tokens of the context matched
    spot: tuple | None = None  # (node, j): where the match ends in its tree, for SuffixTree.expand
    limit: int = 0  # the most tokens this match may propose

    @property
    def score(self) -> float:
        """Expected number of accepted tokens, by the tree's counts."""
        return sum(self.probs)


class _Node:
    __slots__ = ("label", "count", "total", "children", "parent")

    def __init__(self, label: array, count: int, total: int, children: dict | None, parent: _Node | None) -> None:
        self.label = label  # edge tokens from the parent (empty at the root)
        self.count = count  # suffixes passing through every position of the edge
        self.total = total  # of those, how many continue into a child (sum of children's counts)
        self.children = children  # first token -> child; None for a leaf
        self.parent = parent


def _label(tokens) -> array:
    return array("i", tokens)


class SuffixTree:
    """All suffixes (up to max_depth tokens) of a set of sequences, with occurrence counts."""

    # Estimated CPython bytes (64-bit, 3.11; measured with tracemalloc in tests/test_suffix.py).
    NODE_BYTES = 272  # a node, its label array header and its share of its parent's dict (measured 210-263)
    TOKEN_BYTES = 4  # one token in a label or a stored sequence

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(_label(()), 0, 0, None, None)
        self.seqs: dict[int, array] = {}  # sequence id -> its tokens
        self._active: dict[int, deque[_Node]] = {}  # id -> nodes where its last <= D suffixes end, longest first
        self.num_nodes = 1
        self.num_label_tokens = 0
        self.num_seq_tokens = 0
        self._seq: array | None = None  # while extend() runs: the sequence it extends, and its open leaves
        self._opened: dict[_Node, int] | None = None

    @property
    def estimated_bytes(self) -> int:
        return self.num_nodes * self.NODE_BYTES + (self.num_label_tokens + self.num_seq_tokens) * self.TOKEN_BYTES

    # --- insertion -----------------------------------------------------------------------------------

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to sequence seq_id (created if new). O(D) per token for the suffixes that occur more than
        once; the unique ones (each alone at a leaf, the longest suffixes) grow their leaves once per call."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = array("i")
            self._active[seq_id] = deque()
        active = self._active.get(seq_id)
        if active is None:
            raise ValueError(f"sequence {seq_id} is closed")
        root, depth, step = self.root, self.max_depth, self._step
        # Open leaves: a unique suffix's leaf, which every new token would lengthen by one, is left alone while the
        # tokens go in (its label synced from seq when _step meets it, when it stops growing, and at the end).
        # Unique suffixes are the longest ones (a suffix holding a unique one is unique): the first `n_open` of
        # `active`. leaf -> the end of seq its label holds.
        self._seq, self._opened = seq, {}
        n_open = self._open_from(0, active, len(seq))
        for t in tokens:
            seq.append(t)
            self.num_seq_tokens += 1
            root.count += 1
            active.append(root)  # the suffix that starts at the new token
            if len(active) > depth:
                oldest = active.popleft()  # the oldest suffix has max_depth tokens: it stops growing
                if n_open:
                    n_open -= 1
                    self._sync(oldest, len(seq) - 1, close=True)
            for i in range(n_open, len(active)):
                active[i] = step(active[i], t)
            if n_open < len(active) and active[n_open].count == 1:
                n_open = self._open_from(n_open, active, len(seq))
        end, tails = len(seq), {}  # the open leaves' labels, to the end (most opened at one length: one slice)
        for leaf, start in self._opened.items():
            if start < end:
                tail = tails.get(start)
                if tail is None:
                    tail = tails[start] = seq[start:end]
                leaf.label.extend(tail)
                self.num_label_tokens += end - start
        self._seq = self._opened = None

    def _open_from(self, n_open: int, active: deque, end: int) -> int:
        """Open the unique suffixes' leaves from active[n_open] on (their labels hold seq up to end); the new n_open."""
        while n_open < len(active):
            node = active[n_open]
            if node.count != 1 or node is self.root:
                break
            self._opened[node] = end
            n_open += 1
        return n_open

    def _sync(self, leaf: _Node, end: int, close: bool = False) -> None:
        """An open leaf's label brought up to seq[..end]; close: it is open no more."""
        start = self._opened.pop(leaf) if close else self._opened[leaf]
        if end > start:
            leaf.label.extend(self._seq[start:end])
            self.num_label_tokens += end - start
        if not close:
            self._opened[leaf] = end

    def close(self, seq_id: int) -> None:
        """No more tokens for seq_id: forget where its suffixes end (it stays in the tree)."""
        self._active.pop(seq_id, None)

    def _step(self, node: _Node, t: int) -> _Node:
        """A suffix ending at the end of node's edge grows by t; returns the node it now ends at. (A suffix alone at
        a leaf never comes here: extend() keeps its leaf open.)"""
        children = node.children
        child = children.get(t) if children is not None else None
        if child is not None and child.count == 1 and child in self._opened:  # another suffix's open leaf
            self._sync(child, len(self._seq))
        if child is None:
            leaf = _Node(_label((t,)), 1, 0, None, node)
            if children is None:
                node.children = {t: leaf}
            else:
                children[t] = leaf
            node.total += 1
            self.num_nodes += 1
            self.num_label_tokens += 1
            return leaf
        if (len(child.label) > 1 and node.total + 1 == node.count and len(children) == 1
                and node is not self.root):
            # Only this suffix ended at node and every other one goes on into child: slide node's
            # end one token down child's edge (what a split followed by a merge would do).
            node.label.append(t)
            del child.label[0]
            children.clear()
            children[child.label[0]] = child
            return node
        node.total += 1
        if len(child.label) == 1:
            child.count += 1
            reached = child
        else:  # split the edge after its first token, where one more suffix now ends
            rest = child.label[1:]
            reached = _Node(_label((t,)), child.count + 1, child.count, {rest[0]: child}, node)
            child.label = rest
            child.parent = reached
            children[t] = reached
            self.num_nodes += 1
        if node.total == node.count and len(children) == 1 and node is not self.root:
            self._merge_into_child(node)  # no suffix ends at node any more: its edge joins the child's
        return reached

    def _merge_into_child(self, node: _Node) -> None:
        """node has one child and every suffix through node continues into it: one edge is enough.
        The child object survives (suffixes may end at it); node disappears."""
        (child,) = node.children.values()
        child.label = node.label + child.label
        child.parent = node.parent
        node.parent.children[node.label[0]] = child
        self.num_nodes -= 1

    # --- removal -------------------------------------------------------------------------------------

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and every suffix of it. O(n D)."""
        seq = self.seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        n = len(seq)
        for start in range(n):
            self._remove_suffix(seq, start, min(n, start + self.max_depth))
        self.num_seq_tokens -= n

    def _remove_suffix(self, seq: array, i: int, end: int) -> None:
        node = self.root
        node.count -= 1
        while i < end:
            key = seq[i]
            child = node.children[key]
            node.total -= 1
            if child.count == 1:  # count-1 nodes are leaves: drop it
                del node.children[key]
                if not node.children:
                    node.children = None
                self.num_nodes -= 1
                self.num_label_tokens -= len(child.label)
                break
            child.count -= 1
            i += len(child.label)
            node = child
        if (node is not self.root and node.children is not None and len(node.children) == 1
                and node.total == node.count):
            self._merge_into_child(node)

    # --- lookup --------------------------------------------------------------------------------------

    def locate(self, pattern: array) -> tuple[_Node, int] | None:
        """Where pattern ends: (node, tokens of node's edge used), or None if it never occurs.
        O(len(pattern)), an edge at a time."""
        node, j = self.root, 0
        i, n = 0, len(pattern)
        while i < n:
            children = node.children
            node = children.get(pattern[i]) if children is not None else None
            if node is None:
                return None
            label = node.label
            j = min(len(label), n - i)
            if j > 1 and label[1:j] != pattern[i + 1 : i + j]:
                return None
            i += j
        return node, j

    def active_nodes(self, seq_id: int) -> deque[_Node]:
        """Nodes where the last suffixes of an open sequence end, longest first (the suffix of
        length m ends at the end of nodes[-m]'s edge)."""
        return self._active[seq_id]

    @staticmethod
    def follow(node: _Node, j: int, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The most frequent continuation from position j of node's edge: up to max_tokens tokens, each
        with the chain's estimated probability (product of count ratios), stopping below min_prob.
        O(max_tokens + children scanned)."""
        tokens: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(tokens) < max_tokens:
            label = node.label
            if j < len(label):  # inside an edge every suffix continues the same way
                take = label[j : j + max_tokens - len(tokens)]
                tokens.extend(take)
                probs.extend([p] * len(take))
                j += len(take)
                continue
            if not node.total:
                break
            best = max(node.children.values(), key=_count)  # ties: the earliest inserted
            p *= best.count / node.total
            if p < min_prob:
                break
            node, j = best, 0
        return tokens, probs

    @staticmethod
    def expand(node: _Node, j: int, max_nodes: int, max_depth: int, min_prob: float
               ) -> tuple[list[int], list[int], list[float]]:
        """The continuations from position j of node's edge as a token tree, best-first: (tokens,
        parents, probs), at most max_nodes nodes of depth < max_depth, each node's estimated probability
        (product of count ratios) >= min_prob. Probabilities come out non-increasing. O(nodes log nodes)."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int, _Node, int]] = []  # (-prob, tie, parent, depth, node, j after it)
        tie = 0

        def push(at: _Node, pos: int, p: float, parent: int, depth: int) -> None:
            nonlocal tie
            if depth >= max_depth:
                return
            if pos < len(at.label):  # inside an edge: one continuation
                heapq.heappush(heap, (-p, tie, parent, depth, at, pos))
                tie += 1
                return
            for child in (at.children or {}).values():
                q = p * child.count / at.total
                if q >= min_prob:
                    heapq.heappush(heap, (-q, tie, parent, depth, child, 0))
                    tie += 1

        push(node, j, 1.0, -1, 0)
        while heap and len(tokens) < max_nodes:
            neg, _, parent, depth, at, pos = heapq.heappop(heap)
            tokens.append(at.label[pos])
            parents.append(parent)
            probs.append(-neg)
            push(at, pos + 1, -neg, len(tokens) - 1, depth + 1)
        return tokens, parents, probs

    def check(self) -> None:
        """Verify every invariant against the stored sequences (for tests; O(size))."""
        expected: dict[tuple, int] = {}
        for seq in self.seqs.values():
            for s in range(len(seq)):
                for e in range(s + 1, min(len(seq), s + self.max_depth) + 1):
                    key = tuple(seq[s:e])
                    expected[key] = expected.get(key, 0) + 1
        seen = 0
        nodes = 0
        label_tokens = 0
        stack = [(self.root, ())]
        assert self.root.count == sum(len(s) for s in self.seqs.values()), "root count"
        while stack:
            node, path = stack.pop()
            nodes += 1
            label_tokens += len(node.label)
            children = node.children or {}
            assert node.total == sum(c.count for c in children.values()), f"total at {path}"
            assert node.children is None or node.children, "empty children dict"
            if node is not self.root:
                assert node.count > 0 and len(node.label) > 0
                for j in range(1, len(node.label) + 1):  # every position of the edge has the node's count
                    assert expected.get(path[: len(path) - len(node.label) + j]) == node.count, f"count at {path}"
                    seen += 1
                assert not (len(children) == 1 and node.total == node.count), f"unmerged node at {path}"
                assert node.count > 1 or not children, "count-1 node with children"
            for t, c in children.items():
                assert c.label[0] == t and c.parent is node, f"bad link under {path}"
                stack.append((c, path + tuple(c.label)))
        assert seen == len(expected), "tree holds substrings the sequences do not (or misses some)"
        assert nodes == self.num_nodes and label_tokens == self.num_label_tokens, "size counters"
        assert self.num_seq_tokens == sum(len(s) for s in self.seqs.values()), "sequence token counter"


def _count(node: _Node) -> int:
    return node.count


def speculate(tree: SuffixTree, context, max_tokens: int, config: SuffixConfig, seq_id: int | None = None,
              matches: list | None = None) -> SuffixDraft:
    """The best chain continuing context (an array('i') of token ids) in tree, over match lengths
    config.min_match..D-1.
    seq_id: context *is* that open sequence of the tree (its own suffixes are located for free);
    None: match context's suffixes by walking from the root. matches: if given, receives (spot, limit)
    of every match length, longest first (for a token tree's other branches)."""
    # Where each suffix of the context ends, shortest first, while it occurs and some occurrence
    # continues (if none of the m-token suffix's occurrences continue, none of a longer one's do).
    spots: list[tuple[_Node, int]] = []
    longest = tree.max_depth - 1
    if seq_id is not None:
        active = tree.active_nodes(seq_id)
        for m in range(1, min(len(active), longest) + 1):
            node = active[-m]
            if not node.total:
                break
            spots.append((node, len(node.label)))
    else:
        n = len(context)
        for m in range(1, min(n, longest) + 1):
            where = tree.locate(context[n - m :])
            if where is None or (where[1] == len(where[0].label) and not where[0].total):
                break
            spots.append(where)
    # Longest match first: a match of m tokens proposes at most limit(m) tokens and scores at most
    # that, so stop once it cannot beat the best score (ties, to rounding, go to the longer match).
    best, best_score = SuffixDraft(), 0.0
    if matches is not None:
        for m in range(len(spots), config.min_match - 1, -1):
            matches.append((spots[m - 1], min(max_tokens, int(m * config.max_spec_factor + config.max_spec_offset + 1e-6))))
    for m in range(len(spots), config.min_match - 1, -1):
        limit = min(max_tokens, int(m * config.max_spec_factor + config.max_spec_offset + 1e-6))
        if limit <= best_score + 1e-9:
            break
        node, j = spots[m - 1]
        tokens, probs = SuffixTree.follow(node, j, limit, config.min_token_prob)
        score = sum(probs)
        if score > best_score + 1e-9:
            best, best_score = SuffixDraft(tokens, probs, m, (node, j), limit), score
    return best


def token_tree(best: SuffixDraft, matches: list, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """(tokens, parents, probs): a speculate() result's match expanded best-first into a token tree, then (budget
    left) the other match lengths' expansions (its `matches`) merged in, longest first: a long match often has
    one continuation where a shorter one has several."""
    builder = TreeBuilder(max_nodes)
    probs: list[float] = []
    for spot, limit in [(best.spot, best.limit)] + [m for m in matches if m[0] is not best.spot]:
        tokens, parents, node_probs = SuffixTree.expand(*spot, max_nodes, limit, min_prob)
        paths: list[list[int]] = []
        for t, parent, prob in zip(tokens, parents, node_probs):
            paths.append((paths[parent] if parent >= 0 else []) + [t])
            before = len(builder.tokens)
            builder.add_branch(paths[-1])
            probs.extend([prob] * (len(builder.tokens) - before))
            if builder.full:
                return builder.tokens, builder.parents, probs
    return builder.tokens, builder.parents, probs
