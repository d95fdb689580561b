"""Token trees for a ragged batch: the representation, its validation and its attention layout.

A session's proposal is a tree of N candidate tokens hanging below the root, the last committed token.
Node i carries tokens[i] and parents[i], the index of its parent node, or -1 for a child of the root;
parents come before their children (parents[i] < i), so node order is a topological order and no
tree can contain a cycle. A chain d_1..d_K is parents = [-1, 0, 1, ..., K - 2].

A ragged batch flattens every session's nodes into one tensor with cumulative counts, as vLLM lays out
draft tokens (cu_num_draft_tokens): session b owns the flat nodes [cu_num_nodes[b], cu_num_nodes[b+1])
and parents stay LOCAL (indices within the session, -1 = root), which is what the wire carries.
The target rows follow rejection.py's layout: session b's N_b + 1 rows of p start at
cu_num_nodes[b] + b; its row 0 is the distribution of the first token after the committed prefix
(the root's), row 1 + i the distribution after node i.

Depth counts a node's ancestors among the nodes (0 for a child of the root), so node i of a session
whose committed prefix holds committed_len tokens sits at position committed_len + depth[i], and the
token emitted after stopping at node i is the one at position committed_len + depth[i] + 1 ("level"
depth[i] + 1; the root's children are level 0).

Everything here is vectorised over nodes: the only Python loops run over depth levels.
"""

from __future__ import annotations

import torch


def session_of_nodes(cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """[N] int64: the session of every flat node (cu_num_nodes [B + 1])."""
    counts = cu_num_nodes[1:] - cu_num_nodes[:-1]  # [B]
    n = int(cu_num_nodes[-1])
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=cu_num_nodes.device), counts, output_size=n)


def global_parents(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """[N] int64: each node's parent as a flat index, -1 for children of the root."""
    first = cu_num_nodes.index_select(0, session_of_nodes(cu_num_nodes))  # [N] the session's first flat node
    return torch.where(parents >= 0, parents + first, -1)


def tree_depth(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """[N] int64: ancestors of each node among the nodes (0 for children of the root). One pass per
    depth level; the input must be valid (validate_tree), or a cycle would never end."""
    gparent = global_parents(parents, cu_num_nodes)  # [N]
    depth = torch.zeros_like(gparent)
    ancestor = gparent
    for _ in range(gparent.shape[0]):  # at most N levels
        has = ancestor >= 0
        if not bool(has.any()):
            break
        depth += has.long()
        ancestor = torch.where(has, gparent.index_select(0, ancestor.clamp(min=0)), -1)
    return depth


def tree_positions(depth: torch.Tensor, cu_num_nodes: torch.Tensor, committed_len: torch.Tensor) -> torch.Tensor:
    """[N] int64: position of every node, committed_len[b] + depth (committed_len [B], the session's
    committed tokens including the root). A chain's positions are committed_len + 0..K-1, as today."""
    return committed_len.index_select(0, session_of_nodes(cu_num_nodes)) + depth


def ancestor_mask(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> torch.Tensor:
    """[N, N] bool, block-diagonal over sessions: mask[i, j] iff node j is node i or an ancestor of i,
    i.e. what node i attends to among the nodes (each node also sees its session's committed prefix,
    which the engine adds). A chain's block is lower-triangular. One scatter per depth level."""
    gparent = global_parents(parents, cu_num_nodes)  # [N]
    n = gparent.shape[0]
    row_start = torch.arange(n, device=gparent.device) * n  # [N] flat offset of each row
    flat = torch.eye(n, dtype=torch.bool, device=gparent.device).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(1)])  # a spare slot at n * n takes the writes of finished rows
    ancestor = gparent
    for _ in range(n):
        has = ancestor >= 0
        if not bool(has.any()):
            break
        flat.index_fill_(0, torch.where(has, row_start + ancestor, n * n), True)
        ancestor = torch.where(has, gparent.index_select(0, ancestor.clamp(min=0)), -1)
    return flat[: n * n].reshape(n, n)


def sibling_links(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Children in node order, as linked lists. Slots: node g is slot g, session b's root is slot N + b.

    Returns (slot_of_parent [N]: the slot of each node's parent, first_child [N + B]: each slot's first
    child (flat index) or -1, next_sibling [N]: the next child of the same parent or -1)."""
    n = parents.shape[0]
    batch = cu_num_nodes.shape[0] - 1
    device = parents.device
    session = session_of_nodes(cu_num_nodes)
    gparent = global_parents(parents, cu_num_nodes)
    slot = torch.where(gparent >= 0, gparent, n + session)  # [N]
    order = torch.sort(slot, stable=True).indices  # siblings together, in node order
    sorted_slot = slot[order]
    same_as_next = torch.zeros(n, dtype=torch.bool, device=device)
    same_as_next[:-1] = sorted_slot[1:] == sorted_slot[:-1]
    next_sibling = torch.full((n,), -1, dtype=torch.long, device=device)
    next_sibling[order[:-1]] = torch.where(same_as_next[:-1], order[1:], -1)
    is_first = torch.ones(n, dtype=torch.bool, device=device)
    is_first[1:] = sorted_slot[1:] != sorted_slot[:-1]
    first_child = torch.full((n + batch,), -1, dtype=torch.long, device=device)
    first_child[sorted_slot[is_first]] = order[is_first]
    return slot, first_child, next_sibling


def path_from_accepted(
    accepted: torch.Tensor,  # [N] bool
    depth: torch.Tensor,  # [N] int64
    cu_num_nodes: torch.Tensor,  # [B + 1] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the accepted nodes (a root-down chain per session; accepted [N] bool) to (path [B, L]: each
    session's accepted nodes as local indices by depth, -1 padded; num_accepted [B]); L = max depth + 1."""
    batch = cu_num_nodes.shape[0] - 1
    device = depth.device
    session = session_of_nodes(cu_num_nodes)
    width = int(depth.max()) + 1 if depth.numel() else 0
    local = torch.arange(depth.shape[0], device=device) - cu_num_nodes.index_select(0, session)
    flat = torch.full((batch * width + 1,), -1, dtype=torch.long, device=device)  # spare slot last
    flat.scatter_(0, torch.where(accepted, session * width + depth, batch * width), torch.where(accepted, local, -1))
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device).index_add_(0, session, accepted.long())
    return flat[: batch * width].reshape(batch, width), num_accepted


def chain_parents(k: int) -> torch.Tensor:
    """[K] int64: the parents of a chain d_1..d_K, [-1, 0, 1, ..., K - 2]."""
    return torch.arange(k, dtype=torch.long) - 1


# --- Validation ----------------------------------------------------------------------------------


def validate_tree(
    parents: torch.Tensor,  # [N] int64, local parent indices (-1 = root)
    tokens: torch.Tensor,  # [N] int64
    cu_num_nodes: torch.Tensor,  # [B + 1] int64
    *,
    vocab_size: int,
    max_nodes: int,
    distinct_siblings: bool = False,
    q: torch.Tensor | None = None,  # [N, V] draft rows, when the scheme uses them
    q_tolerance: float = 1e-3,
) -> None:
    """Raise ValueError naming the bad field (cu_num_nodes, tokens, parents or q) and the session and
    node, so the serving layer can answer INVALID_ARGUMENT. Checks: shapes; at most max_nodes nodes per
    session; tokens inside the vocabulary; -1 <= parents[i] < N_b; parents[i] < i (topological order,
    which rules out cycles: a cycle is reported as one); with distinct_siblings, no two children of
    one parent share a token (required for siblings drawn without replacement); q rows finite,
    non-negative and summing to 1 within q_tolerance."""
    if parents.dim() != 1 or tokens.shape != parents.shape:
        raise ValueError(f"parents and tokens must be 1-D of one length, got {tuple(parents.shape)} and {tuple(tokens.shape)}")
    if parents.dtype != torch.long or tokens.dtype != torch.long:
        raise ValueError(f"parents and tokens must be int64, got {parents.dtype} and {tokens.dtype}")
    if cu_num_nodes.dim() != 1 or cu_num_nodes.shape[0] < 1:
        raise ValueError("cu_num_nodes must be 1-D with B + 1 entries")
    cu = cu_num_nodes.tolist()
    if cu[0] != 0 or cu[-1] != parents.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_num_nodes must rise from 0 to {parents.shape[0]}, got {cu}")
    n = parents.shape[0]
    counts = [b - a for a, b in zip(cu, cu[1:])]
    for b, count in enumerate(counts):
        if count > max_nodes:
            raise ValueError(f"tokens: session {b} has {count} nodes, more than max_nodes = {max_nodes}")
    if n == 0:
        return
    session = session_of_nodes(cu_num_nodes)
    local = torch.arange(n, device=parents.device) - cu_num_nodes[session]

    def where(mask: torch.Tensor) -> tuple[int, int, int]:
        g = int(mask.nonzero()[0, 0])
        return int(session[g]), int(local[g]), g

    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        b, i, g = where(bad)
        raise ValueError(f"tokens: session {b} node {i} has token {int(tokens[g])}, outside the vocabulary [0, {vocab_size})")
    size = torch.tensor(counts, device=parents.device)[session]  # [N] N_b of each node's session
    bad = (parents < -1) | (parents >= size)
    if bad.any():
        b, i, g = where(bad)
        raise ValueError(f"parents: session {b} node {i} has parent {int(parents[g])}, out of range [-1, {counts[b]})")
    bad = parents >= local
    if bad.any():
        b, i, g = where(bad)
        chain = parents[cu[b] : cu[b + 1]].tolist()
        node, seen = i, set()
        while node >= 0 and node not in seen:
            seen.add(node)
            node = chain[node]
        if node >= 0:
            raise ValueError(f"parents: session {b} has a cycle through node {node}")
        raise ValueError(f"parents: session {b} node {i} has parent {int(parents[g])}; a parent must come before its "
                         "children (parents[i] < i)")
    if distinct_siblings:
        slot, _, _ = sibling_links(parents, cu_num_nodes)
        key = slot * vocab_size + tokens  # equal iff same parent and same token
        order = torch.sort(key, stable=True).indices
        dup = key[order][1:] == key[order][:-1]
        if dup.any():
            j = int(dup.nonzero()[0, 0])
            first, second = int(order[j]), int(order[j + 1])
            b = int(session[first])
            raise ValueError(f"tokens: session {b} nodes {int(local[first])} and {int(local[second])} are siblings with "
                             f"the same token {int(tokens[first])}; this scheme needs distinct siblings")
    if q is not None:
        if q.shape != (n, vocab_size):
            raise ValueError(f"q must be [{n}, {vocab_size}] (one row per node), got {tuple(q.shape)}")
        bad = ~torch.isfinite(q).all(dim=-1) | (q < 0).any(dim=-1)
        if bad.any():
            b, i, _ = where(bad)
            raise ValueError(f"q: session {b} node {i} has a negative or non-finite probability")
        total = q.double().sum(dim=-1)
        bad = (total - 1).abs() > q_tolerance
        if bad.any():
            b, i, g = where(bad)
            raise ValueError(f"q: session {b} node {i} sums to {float(total[g]):.6g}, not 1")
