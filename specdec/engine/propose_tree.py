"""The draft's token trees: propose a tree level by level, keep the accepted path's KV entries, and
pre-draft the next round for the likely outcomes of this one (the speculation cache).

**Growing a tree** (TreeShape: at most N nodes, D levels, branching b). The first step feeds the
session's new committed tokens; its last row is the root's distribution. The root gets b children; each
later level expands the b most likely nodes of the level before (by the draft's own path probability,
known before their children are drawn) with b children each. One forward per level feeds all of a
level's expanded nodes of all sessions (the engine's tree attention: a node sees the committed prefix and
its ancestors; the tree grows over several feeds, specdec.engine.attention.tree_layout).

Where the children are deterministic (a greedy request, or the CANDIDATES scheme) the tree is **dynamic**
(EAGLE-2, Li et al. 2024): the levels grow past the node budget, up to b + b^2 (D - 1) candidates, and the
proposal keeps the N with the highest path probability. A child's path probability is never above its
parent's and a child comes after its parent, so the N best (ties to the earlier node) include every
ancestor of each; a node is expanded only while its path probability beats the N-th best so far (else no
descendant could be kept). The draft's confidence then decides the shape: deep where it is sure, wide
where it is not. Replayed on the default pair's greedy answers to held-out open prompts
(bench/tree_replay.py), 8 nodes from b = 4 over 4-6 levels commit 1.86-1.87 tokens a round, against 1.64
for the fixed top-2 shape of 6 nodes and 1.86 for the best any 8-node tree could do. Sampled trees (IID, WITHOUT_REPLACEMENT) keep every drawn node, within the budget: dropping a
node for the value it drew would change the law the verifier assumes.
Children of a node are, for a greedy request, its top-b tokens (deterministic candidates); for a sampled
one, by the scheme the target verifies with (specdec.engine.verify):
  * IID: b independent draws from the node's truncated q (SpecInfer's multi-step speculative sampling);
  * WITHOUT_REPLACEMENT: the first b of a Gumbel-top-k order of q (recursive rejection sampling);
  * CANDIDATES: q's top-b tokens, sent without q (proposal-invariant verification).
Every node carries the q row it was drawn from (its parent's). Which nodes get children depends only on
probabilities known before those children are drawn, and no drawn node is discarded, so the siblings keep
the law the verifier assumes. Draws are keyed by (seed, position, node, token): the exponential race of
specdec.math.keyed_draws (E a hash of (seed, position, token)) with the seed mixed with a node key; child j
of the node with key k has key k for j = 0, else a mix of (k, j); i.i.d. siblings each race with their own
key, siblings without replacement take the order of one race with the parent's key. Key 0 is the session's
own seed, so the first-child spine draws exactly as specdec.engine.propose's chain (a tree with b = 1 is
the chain). A proposal therefore depends on neither batching nor on whether it was drafted fresh or
pre-drafted.

**Compaction (the draft infers the verdict).** The fed nodes' KV entries stay in the slot past the
session's tokens (`Session.draft_tree`, a TreeRecord: valid until the slot is next written). The reply's
cached_len is the committed length, so the coordinator's next request sends prefix_len = that length and
new_tokens = the accepted path's tokens + the next token (+ anything committed since). The draft walks
those tokens down its stored tree; the matching nodes' entries move into place (SlotKVCache.move, no
forward) and only the rest is fed. No field says which path was accepted: the tokens do.

**The speculation cache** (ProposeRequest.speculate = M > 0). Once the proposal is answered, the work runs
on while the target verifies: it feeds the likeliest leaves, scores outcomes (stop at node n, the target
emits x not among n's children) by path probability x the draft's probability of x at n, and grows the
next round's proposal (the same shape, parameters and seed) below each of the M best outcome nodes, one
level of all of them per step. If the next request's tokens end exactly at such an outcome node and ask
for the same proposal, it is answered at once from the cache (SlotKVCache.move puts the path and the
prepared tree in place) with no forward; else the compaction above applies. A request for the session
arriving meanwhile stops the speculation after the current step (unfinished growths are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdec.engine.draft_probs import DraftProbs
from specdec.engine.propose import ProposeResult
from specdec.engine.pushed import pushed_proposals
from specdec.engine.tree_growth import GREEDY, Dist, Growth, TreeShape
from specdec.engine.verify import CANDIDATES
from specdec.engine.work import Work
from specdec.math.params import SamplingParams
from specdec.math.sampling import adjust_logits_rows, renormalise_top, shape_rows

OUTCOME_TOP = 8  # tokens per distribution kept for scoring the speculation cache's outcomes


@dataclass(frozen=True)
class TreeProposeResult(ProposeResult):
    parents: list[int] = field(default_factory=list)  # each node's parent (-1 = root); empty = a chain
    scheme: str = GREEDY  # how the nodes were drawn (the target's verifier)
    speculated: bool = False  # answered from the speculation cache, with no draft step
    salvaged: int = 0  # committed tokens whose KV entries were moved into place instead of fed


@dataclass
class TreeRecord:
    """What a session's slot holds past its tokens after a tree work (Session.draft_tree)."""

    base: int  # the session's length: slot node s sits at position base + s
    key: tuple  # (shape, params, seed, top_n) of the proposals prepared below
    tokens: list[int]  # slot nodes' tokens
    parents: list[int]  # slot nodes' parents (-1 = the last committed token)
    dists: dict[int, Dist]  # slot node -> its distribution (nodes fed with their logits kept)
    prepared: dict[int, Growth]  # outcome slot node -> the next round's proposal grown below it


@dataclass(eq=False)
class ProposeTreeWork(Work):
    shape: TreeShape = TreeShape(1, 1, 1, GREEDY)
    params: SamplingParams = SamplingParams()
    seed: int = 0  # the session's base draft seed
    top_n: int = 64  # q truncation
    speculate: int = 0  # outcomes to pre-draft the next round for, once answered (0 = none)
    push: bool = False  # send the pre-drafted rounds to the caller once done (specdec.engine.pushed)
    base: int = 0  # the committed length (set at start)
    main: Growth | None = None
    slot_tokens: list[int] = field(default_factory=list)  # the tree's fed nodes, in slot order
    slot_parents: list[int] = field(default_factory=list)
    slot_depth: list[int] = field(default_factory=list)
    dists: dict[int, Dist] = field(default_factory=dict)  # slot node -> its distribution
    root_dist: Dist | None = None
    feeding: list[tuple[Growth | None, int, int]] = field(default_factory=list)  # (growth, node, slot) per fed row
    tree_feed: bool = False  # the pending feed is slot nodes (else committed tokens)
    stage: str = "propose"  # propose | leaves | outcomes | grow
    spec: dict[int, Growth] = field(default_factory=dict)  # outcome slot node -> growth
    answer: TreeProposeResult | None = None
    hit: bool = False
    salvaged: int = 0
    features: torch.Tensor | None = None  # a feature draft's rows (as ProposeWork's; specdec.engine.head_engine)
    features_start: int = 0

    kind: ClassVar[str] = "propose_tree"

    @classmethod
    def create(cls, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], shape: TreeShape,
               params: SamplingParams, seed: int, top_n: int, speculate: int = 0, push: bool = False) -> "ProposeTreeWork":
        return cls(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash, pending=list(new_tokens),
                   num_logits=1, shape=shape, params=params, seed=seed, top_n=top_n, speculate=speculate, push=push)

    @property
    def dynamic(self) -> bool:
        """Whether this work's trees are dynamic (deterministic children: a greedy request or CANDIDATES)."""
        return self.params.greedy or self.shape.scheme in (GREEDY, CANDIDATES)

    @property
    def cache_key(self) -> tuple:
        return (self.shape, self.params, self.seed, self.top_n)

    def feed_tree(self) -> list[int] | None:
        return list(self.slot_parents) if self.tree_feed else None

    # --- start: compaction, or an answer from the speculation cache ----------------------------------------

    def on_start(self, engine) -> None:
        session = self.session
        record, session.draft_tree = session.draft_tree, None
        base = len(session)
        if isinstance(record, TreeRecord) and record.base == base == self.prefix_len:
            children: dict[tuple[int, int], int] = {}
            for s, (t, p) in enumerate(zip(record.tokens, record.parents)):
                children.setdefault((p, t), s)
            path, node = [], -1
            for t in self.pending:
                node = children.get((node, t), -1)
                if node < 0:
                    break
                path.append(node)
            prepared = record.prepared.get(path[-1]) if path and len(path) == len(self.pending) else None
            if prepared is not None and prepared.done and record.key == self.cache_key:
                self._take_prepared(engine, record, path, prepared)
                return
            keep = path[: len(self.pending) - 1]  # the last committed token is fed: its logits are the root's
            if keep:
                engine.cache.move(session.slot, [base + s for s in keep], list(range(base, base + len(keep))))
                engine.sessions.append(session, self.pending[: len(keep)])
                del self.pending[: len(keep)]
                self.salvaged = len(keep)
        self.base = len(session) + len(self.pending)
        self.main = Growth(self.shape, -1, self.base, self.dynamic)
        self.feeding = [(self.main, -1, -1)]

    def _take_prepared(self, engine, record: TreeRecord, path: list[int], g: Growth) -> None:
        """A cache hit: the path and the prepared proposal's fed nodes moved into place; answered now."""
        session, base = self.session, len(self.session)
        fed = sorted(s for s in g.slot if s >= 0)
        engine.cache.move(session.slot, [base + s for s in path + fed], list(range(base, base + len(path) + len(fed))))
        engine.sessions.append(session, list(self.pending))
        self.salvaged, self.hit = len(self.pending), True
        self.pending = []
        self.base = len(session)
        renumber = {old: new for new, old in enumerate(fed)}
        self.root_dist = record.dists.get(g.anchor)
        g.anchor, g.slot = -1, [renumber.get(s, -1) for s in g.slot]
        self.main = g
        for i in sorted(range(len(g.slot)), key=lambda i: g.slot[i]):
            if g.slot[i] >= 0:
                parent = g.parents[i]
                self._add_slot(g.tokens[i], g.slot[parent] if parent >= 0 else -1)
                self.dists[g.slot[i]] = record.dists[fed[g.slot[i]]]
        engine.sessions.append(session, list(self.slot_tokens))
        self._answer(engine)

    # --- steps ---------------------------------------------------------------------------------------------

    def _add_slot(self, token: int, parent: int) -> int:
        self.slot_tokens.append(token)
        self.slot_parents.append(parent)
        self.slot_depth.append(0 if parent < 0 else self.slot_depth[parent] + 1)
        return len(self.slot_tokens) - 1

    def _feed(self, engine, items: list[tuple[Growth | None, int, int, int]]) -> bool:
        """Feed slot nodes: items (growth, node, token, slot parent). False if the slot has no room."""
        if not items or self.base + len(self.slot_tokens) + len(items) > engine.max_context:
            return False
        self.feeding = []
        for g, node, token, parent in items:
            s = self._add_slot(token, parent)
            if g is not None and node >= 0:
                g.slot[node] = s
            self.feeding.append((g, node, s))
        self.pending = [t for _, _, t, _ in items]
        self.num_logits = len(items)
        self.tree_feed = True
        return True

    def _grow_items(self, g: Growth, nodes: list[int]) -> list[tuple[Growth, int, int, int]]:
        return [(g, n, g.tokens[n], g.slot[g.parents[n]] if g.parents[n] >= 0 else g.anchor) for n in nodes]

    def consume(self, dists: list[Dist], engine) -> None:
        """This step's rows, one distribution per fed row: grow the trees, then plan the next feed or finish."""
        greedy = self.params.greedy
        made: dict[int, tuple[Growth, list[int]]] = {}
        for (g, node, s), dist in zip(self.feeding, dists):
            if s >= 0:
                self.dists[s] = dist
            elif g is self.main and node < 0:
                self.root_dist = dist
            if g is None or (self.stage == "leaves"):
                continue
            children = g.expand(node, dist, self.seed, greedy)
            made.setdefault(id(g), (g, []))[1].extend(children)
        if self.stage == "propose":
            nodes = self.main.to_expand(made.get(id(self.main), (None, []))[1])
            if nodes and self._feed(engine, self._grow_items(self.main, nodes)):
                return
            self.main.done = True
            self._answer(engine)
            return
        if self.stage == "leaves":
            self._choose_outcomes(engine)
            return
        waiting = engine.queued(self.session_id)
        if waiting is not None and not self._will_hit(waiting):  # the next request is here and missed: stop
            self._finish(engine)
            return
        items = []
        for g, level in made.values():
            items.extend(self._grow_items(g, g.to_expand(level)))
        self.stage = "grow"
        if not self._feed(engine, items):
            self._finish(engine)

    def _will_hit(self, work: Work) -> bool:
        """Whether a waiting request will be answered from the outcomes being pre-drafted."""
        if not isinstance(work, ProposeTreeWork) or work.cache_key != self.cache_key or work.prefix_len != self.base:
            return False
        node = -1
        for t in work.pending:
            node = next((s for s, (tok, p) in enumerate(zip(self.slot_tokens, self.slot_parents))
                         if p == node and tok == t), -1)
            if node < 0:
                return False
        return node in self.spec

    def _result(self, g: Growth, base: int, speculated: bool, salvaged: int = 0) -> TreeProposeResult:
        """The answer holding proposal g (its N best nodes, for a dynamic tree) after `base` committed tokens."""
        g.keep_best()
        chain = g.shape.branching == 1
        q = DraftProbs.from_rows(g.rows) if g.shape.sends_q and not self.params.greedy else None
        sessions, _, seconds = self.last_step
        return TreeProposeResult(
            list(g.tokens), q, base, self.compute_s * 1e3, sessions, seconds * 1e3, self.queue_ms(), self.reused,
            self.step_id, parents=[] if chain else list(g.parents),
            scheme=GREEDY if self.params.greedy else g.shape.scheme, speculated=speculated, salvaged=salvaged)

    def _answer(self, engine) -> None:
        """The proposal is complete: answer it; then pre-draft the next round, or finish."""
        self.answer = self._result(self.main, self.base, self.hit, self.salvaged)
        if self.speculate <= 0:
            self._finish(engine)
            return
        engine.respond(self, self.answer)
        self._feed_leaves(engine)

    def _feed_leaves(self, engine) -> None:
        """The speculation's first step: the likeliest leaves, whose distributions the outcomes need (a
        dynamic tree's kept leaf may have been fed already, as a node whose children were not kept)."""
        g = self.main
        spine = self._spine_leaf()
        leaves = [spine] + sorted((i for i in g.leaves() if i != spine), key=lambda i: -g.prob[i])
        leaves = leaves[: self._outcomes(engine)]
        self.stage = "leaves"
        unfed = [i for i in leaves if i >= 0 and g.slot[i] < 0]
        if not unfed:
            self._choose_outcomes(engine)
        elif not self._feed(engine, self._grow_items(g, sorted(unfed))):
            self._finish(engine)

    def _outcomes(self, engine) -> int:
        """Outcomes pre-drafted at once: each level feeds up to b nodes per outcome, within a step's budget."""
        return max(1, min(self.speculate, engine.config.batch.max_batch_tokens // max(self.shape.branching, 1) - 1))

    def _choose_outcomes(self, engine) -> None:
        """Score (stop node n, next token x not among n's children) by P(path to n) * dist_n(x) and feed the
        best outcome nodes; their logits start the next round's trees."""
        g = self.main
        scored: list[tuple[float, int, int]] = []  # (score, slot parent, token)
        kids: dict[int, set[int]] = {}
        for t, p in zip(g.tokens, g.parents):
            kids.setdefault(p, set()).add(t)
        places = [(-1, 1.0, self.root_dist, -1)] + [
            (i, g.prob[i], self.dists.get(g.slot[i]), g.slot[i]) for i in range(len(g.tokens)) if g.slot[i] >= 0]
        for node, prob, dist, slot in places:
            if dist is None:
                continue
            ids, probs = dist
            for t, v in zip(ids[:OUTCOME_TOP].tolist(), probs[:OUTCOME_TOP].tolist()):
                if t not in kids.get(node, ()):
                    scored.append((prob * v, slot, t))
        scored.sort(key=lambda x: -x[0])
        spine = self._spine_outcome()  # every node accepted and the draft's guess of the bonus, first
        if spine is not None:
            scored = [spine] + [x for x in scored if x[1:] != spine[1:]]
        items = []
        for _, parent, token in scored[: self._outcomes(engine)]:
            depth = 0 if parent < 0 else self.slot_depth[parent] + 1
            grown = Growth(self.shape, -1, self.base + depth + 1, self.dynamic)
            items.append((grown, -1, token, parent))
        self.stage = "outcomes"
        if not self._feed(engine, items):
            self._finish(engine)
            return
        for grown, (_, _, s) in zip([it[0] for it in items], self.feeding):
            grown.anchor = s
            self.spec[s] = grown

    def _spine_leaf(self) -> int:
        """The end of the main tree's first-child path (the draft's own best guess)."""
        g, node = self.main, -1
        while True:
            child = next((i for i, p in enumerate(g.parents) if p == node), None)
            if child is None:
                return node
            node = child

    def _spine_outcome(self) -> tuple[float, int, int] | None:
        """(score, slot parent, token) of the outcome the draft itself predicts: its first-child path to a
        leaf accepted, then the leaf's most likely token (the old overlap's only guess)."""
        g, node = self.main, self._spine_leaf()
        dist = self.dists.get(g.slot[node]) if node >= 0 and g.slot[node] >= 0 else None
        if dist is None or not len(dist[0]):
            return None
        return (1.0, g.slot[node], int(dist[0][0]))

    def _finish(self, engine) -> None:
        """Done: the session back to its committed tokens, the slot's tree entries recorded past them."""
        session = self.session
        engine.sessions.crop(session, self.base)
        session.draft_tree = TreeRecord(self.base, self.cache_key, list(self.slot_tokens), list(self.slot_parents),
                                        dict(self.dists), {s: g for s, g in self.spec.items() if g.done})
        if self.push and self.spec:
            engine.push(self, pushed_proposals(self, lambda g, base: self._result(g, base, speculated=True)))
        self.tree_feed = False
        self.result = self.answer

    @classmethod
    def finish_step(cls, works: list["ProposeTreeWork"], logits: list[torch.Tensor], engine) -> None:
        rows = torch.cat(logits)  # [R, V]
        row_works = [w for w, lg in zip(works, logits) for _ in range(lg.shape[0])]
        dists = tree_dists(rows, row_works)
        start = 0
        for w, lg in zip(works, logits):
            w.consume(dists[start : start + lg.shape[0]], engine)
            start += lg.shape[0]


def tree_dists(rows: torch.Tensor, row_works: list[ProposeTreeWork]) -> list[Dist]:
    """The distribution each row's children are drawn from (rows [R, V], the logits of each row's node, and the work
    each belongs to): logit_bias applied (trees take no penalties); greedy rows keep the top tokens by the softmax
    (their order is the argmax's); sampled rows their q shaped by the work's parameters and truncated to its top_n,
    renormalised. Most likely first, on the host."""
    row_params = [w.params for w in row_works]
    rows = adjust_logits_rows(rows, row_params)
    dists: list[Dist | None] = [None] * rows.shape[0]
    greedy = [i for i, p in enumerate(row_params) if p.greedy]
    sampled = [i for i, p in enumerate(row_params) if not p.greedy]
    if greedy:
        top = max(OUTCOME_TOP, max(w.shape.branching for w in row_works))
        vals, ids = torch.topk(torch.softmax(rows[greedy], dim=-1), min(top, rows.shape[1]), dim=-1)
        vals, ids = vals.cpu(), ids.cpu()
        for j, i in enumerate(greedy):
            dists[i] = (ids[j], vals[j])
    if sampled:
        probs = shape_rows(rows[sampled], [row_params[i] for i in sampled])  # [S, V]
        top_n = min(max(row_works[i].top_n for i in sampled), probs.shape[-1])
        vals, ids = torch.topk(probs, top_n, dim=-1)
        vals, ids = vals.cpu(), ids.cpu()
        for j, i in enumerate(sampled):
            n = min(row_works[i].top_n, top_n)
            t, q = renormalise_top(vals[j, :n], ids[j, :n])  # the truncated q the children are drawn from
            dists[i] = (t, q)
    return dists
