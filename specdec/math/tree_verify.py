"""Lossless verification of token trees (tree.py's layout): greedy, deterministic candidates, sampled.

Notation as in rejection.py (p = target, q = draft; vLLM's words): a round walks down the tree from the
root, *accepting* a child at each step, and emits one more token where it stops: the *bonus* drawn from
p at a leaf, or the *recovered* token when no child of the stop node was accepted. Per session the
target gives p [N + 1, V]: row 0 after the root, row 1 + i after node i. A round returns the accepted
path (node indices, root-down), its length, and the next token.

Three schemes, each a per-session reference written as a plain loop (the specification) and a batched
function over a ragged batch (tree.py's flat layout; vectorised over sessions), pinned to each other
by tests/test_tree_verify.py:

* greedy (temperature 0): follow the child whose token is argmax p; stop where none is.
* deterministic candidates (suffix / prompt-lookup matches, a draft's top-b branching when its q is
  not used): draw x ~ p at the current node at a position-keyed uniform; move to the child whose token
  is x, else emit x. Law: see tree_candidates_sample. Output does not depend on the proposal at all
  ("proposal-invariant verification"): with draws keyed by (seed, position) it is token for token the
  target's own sampled output with those draws.
* sampled draft trees with q: multi-step speculative sampling over siblings (SpecInfer) for siblings
  drawn independently, recursive rejection sampling (RSD) for siblings drawn without replacement.
  See tree_rejection_sample for the scheme, the citations and the proof.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.math.argmax import argmax
from specdec.math.draw import draw, inverse_cdf, uniform_at
from specdec.math.tree import path_from_accepted, session_of_nodes, sibling_links, tree_depth


class TreeVerdict(NamedTuple):
    path: torch.Tensor  # [B, L] int64: each session's accepted nodes, root-down, as local indices; -1 after the last
    num_accepted: torch.Tensor  # [B] int64: accepted nodes (the path's length)
    next_token: torch.Tensor  # [B] int64: the bonus (stopped at a leaf) or the recovered token
    # [N] float32, sampled trees: the probability each tried node was accepted with; NaN where not tried
    accept_prob: torch.Tensor | None = None
    dist: torch.Tensor | None = None  # [B, V] float32, sampled trees: next_token's distribution (unnormalised)


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children in node order; -1 is the root."""
    children: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        children.setdefault(i, [])
        children[parent].append(i)
    return children


# --- Greedy ----------------------------------------------------------------------------------------


def tree_greedy(
    target_logits: torch.Tensor,  # [N + 1, V] target logits after the root and after every node
    tokens: torch.Tensor,  # [N] int64
    parents: torch.Tensor,  # [N] int64, -1 = root
) -> tuple[list[int], int]:
    """Walk from the root along the target's argmax: at each node, move to the first child whose token
    is argmax p there; stop where none is. Returns (accepted path, next token = argmax p at the stop
    node: the bonus at a leaf, else the correction). Equal to the target's own greedy continuation."""
    best = argmax(target_logits).tolist()  # [N + 1]
    toks = tokens.tolist()
    children = _children(parents.tolist())
    node, path = -1, []
    while True:
        x = best[node + 1]
        node = next((c for c in children[node] if toks[c] == x), None)
        if node is None:
            return path, x
        path.append(node)


def walk_matching(
    x_rows: torch.Tensor,  # [N + B] int64: the token each row's stop would emit (p's row layout)
    tokens: torch.Tensor,  # [N]
    parents: torch.Tensor,  # [N] local
    cu_num_nodes: torch.Tensor,  # [B + 1]
) -> TreeVerdict:
    """The walk of greedy, candidates and the keyed race (specdec.math.race): a node is on the path iff it is the
    first child of its parent whose token equals x at the parent, and its parent is on the path (or is the root)."""
    n = tokens.shape[0]
    batch = cu_num_nodes.shape[0] - 1
    device = tokens.device
    flat = torch.arange(n, device=device)
    session = session_of_nodes(cu_num_nodes)
    slot, _, _ = sibling_links(parents, cu_num_nodes)  # [N] slot of each node's parent (N + b = root)
    is_root = slot >= n
    root_row = cu_num_nodes.index_select(0, session) + session  # [N] p row of each node's root
    parent_row = torch.where(is_root, root_row, slot + session + 1)  # [N] p row at the parent
    match = tokens == x_rows.index_select(0, parent_row)  # [N]
    first = torch.full((n + batch,), n, dtype=torch.long, device=device)
    first.scatter_reduce_(0, slot, torch.where(match, flat, n), reduce="amin")  # first matching child per slot
    good = match & (first.index_select(0, slot) == flat)
    depth = tree_depth(parents, cu_num_nodes)
    on_path = good
    parent_node = slot.clamp(max=max(n - 1, 0))
    for _ in range(int(depth.max()) if n else 0):  # one pass per depth level
        on_path = good & (is_root | on_path.index_select(0, parent_node))
    stop = torch.full((batch,), -1, dtype=torch.long, device=device)
    stop.scatter_reduce_(0, session, torch.where(on_path, flat, -1), reduce="amax")  # deepest accepted node
    b = torch.arange(batch, device=device)
    stop_row = torch.where(stop >= 0, stop + b + 1, cu_num_nodes[:-1] + b)
    path, num_accepted = path_from_accepted(on_path, depth, cu_num_nodes)
    return TreeVerdict(path, num_accepted, x_rows.index_select(0, stop_row))


def verify_tree_greedy_batched(
    target_logits: torch.Tensor,  # [N + B, V] each session's N_b + 1 rows (root first)
    tokens: torch.Tensor,  # [N] int64, every session's nodes flattened
    parents: torch.Tensor,  # [N] int64, local parent indices (-1 = root)
    cu_num_nodes: torch.Tensor,  # [B + 1] int64
) -> TreeVerdict:
    """tree_greedy for B sessions at once; a chain gives verify_greedy_batched's result."""
    return walk_matching(argmax(target_logits), tokens, parents, cu_num_nodes)


# --- Deterministic candidates --------------------------------------------------------------------


def tree_candidates_sample(
    p: torch.Tensor,  # [N + 1, V] target probabilities after the root and after every node
    tokens: torch.Tensor,  # [N] int64: candidates that were NOT drawn from a q the verifier is told
    parents: torch.Tensor,  # [N] int64, -1 = root
    generators: list[torch.Generator],  # [levels] one per position: committed_len + 0, + 1, ...
) -> tuple[list[int], int]:
    """Verify deterministic candidates: at level d (starting at the root, d = 0) draw x ~ p at the
    current node with generators[d]; if a child has token x, accept it (the first such child) and go
    on at level d + 1; else emit x and stop. Returns (accepted path, next token).

    Why this is exactly the target's law: the emitted sequence is y_0 = x_0, y_1 = x_1, ... where x_d is
    drawn from p(. | committed prefix, y_0..y_{d-1}), because the node we stand on at level d is the
    node whose path spells y_0..y_{d-1} and its p row is that conditional. Each x_d uses a fresh uniform
    (its own generator), independent of everything before it, so by the chain rule the round emits
    y_0..y_n with probability prod_d p(y_d | prefix, y_<d): the target's own ancestral sampling. The
    candidates only decide how many of those draws one forward can make (where the walk stops), never
    which token is drawn. With generators keyed by (seed, position) the draw at a position is the
    same whatever was proposed, so the output equals the target-alone output with those draws.
    Needs: one generator per level reached, len(generators) >= depth of the tree + 2."""
    toks = tokens.tolist()
    children = _children(parents.tolist())
    node, path, level = -1, [], 0
    while True:
        x = draw(p[node + 1], generators[level])
        node = next((c for c in children[node] if toks[c] == x), None)
        if node is None:
            return path, x
        path.append(node)
        level += 1


def num_levels(parents: torch.Tensor, cu_num_nodes: torch.Tensor) -> list[int]:
    """Levels (positions) each session's candidates walk can draw at: max depth + 2 (1 with no nodes).
    The caller makes one generator per level, for positions committed_len + 0 .. levels - 1."""
    depth = tree_depth(parents, cu_num_nodes)
    batch = cu_num_nodes.shape[0] - 1
    deepest = torch.full((batch,), -1, dtype=torch.long, device=depth.device)
    deepest.scatter_reduce_(0, session_of_nodes(cu_num_nodes), depth, reduce="amax")
    return (deepest + 2).tolist()


def level_uniforms(
    generators: list[list[torch.Generator]],  # [B][levels_b] one per session and position
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[B, L] float64: [b, d] is the point of the draw at level d (generators[b][d]'s first uniform, as
    specdec.math.draw takes it); missing levels are 0."""
    width = max((len(g) for g in generators), default=0)
    at = torch.zeros(len(generators), width, dtype=torch.float64, device=device)
    for b, gens in enumerate(generators):
        for d, gen in enumerate(gens):
            at[b, d] = uniform_at(gen, device)[0]
    return at


def verify_tree_candidates_batched(
    p: torch.Tensor,  # [N + B, V] each session's N_b + 1 rows of target probabilities
    tokens: torch.Tensor,  # [N] int64
    parents: torch.Tensor,  # [N] int64, local
    cu_num_nodes: torch.Tensor,  # [B + 1] int64
    at: torch.Tensor,  # [B, L] float64: each session's draw points per level (level_uniforms), L >= num_levels
) -> TreeVerdict:
    """tree_candidates_sample for B sessions at once: x at every row is p's draw at the row's level's point
    (root: level 0, node i: depth + 1); then the walk follows the children whose token is x."""
    n = tokens.shape[0]
    batch = cu_num_nodes.shape[0] - 1
    device = p.device
    session = session_of_nodes(cu_num_nodes)
    b = torch.arange(batch, device=device)
    row_session = torch.empty(n + batch, dtype=torch.long, device=device)
    row_level = torch.empty(n + batch, dtype=torch.long, device=device)
    root_row = cu_num_nodes[:-1] + b
    node_row = torch.arange(n, device=device) + session + 1
    row_session[root_row], row_level[root_row] = b, 0
    row_session[node_row], row_level[node_row] = session, tree_depth(parents, cu_num_nodes) + 1
    row_at = at.reshape(-1).index_select(0, row_session * at.shape[1] + row_level)  # [N + B] each row's level's point
    x_rows = inverse_cdf(p, row_at)  # one draw per row
    return walk_matching(x_rows, tokens, parents, cu_num_nodes)


# --- Sampled draft trees with q -------------------------------------------------------------------


def tree_rejection_sample(
    p: torch.Tensor,  # [N + 1, V] target probabilities after the root and after every node
    q: torch.Tensor,  # [N, V] q[i] = the draft distribution node i's token was drawn from
    tokens: torch.Tensor,  # [N] int64
    parents: torch.Tensor,  # [N] int64, -1 = root
    generator: torch.Generator | None = None,
    *,
    without_replacement: bool = False,
) -> tuple[list[int], int]:
    """Lossless verification of a sampled draft tree. Returns (accepted path, next token).

    At the current node (the root first), with r = p there, try its children c_1..c_m in node order:
    accept c_k with probability min(1, r(c_k) / q_k(c_k)); on acceptance move to c_k (r = p at c_k)
    and repeat; on rejection r <- norm(max(0, r - q_k)) and try c_{k+1}. When every child is rejected
    draw the recovered token from r; at a leaf draw the bonus from p there. A chain is exactly
    rejection_sample, draw for draw (N uniforms, then one draw: specdec.math.draw).

    q_k is the law child k was drawn from given its earlier siblings:
      * without_replacement=False: q_k = q[c_k]. SpecInfer's multi-step speculative sampling (Miao et
        al. 2024, "SpecInfer", ASPLOS '24, arXiv:2305.09781, Algorithm 2 (MSS) and its theorem that MSS
        samples from the LLM's distribution). Lossless when each sibling is drawn from its own row
        independently of its earlier siblings given the parent: i.i.d. from one q, or one draft model
        per sibling. Keep duplicate siblings: rejecting a duplicate still changes r, so merging
        i.i.d. duplicates changes the law.
      * without_replacement=True: q_k = q[c_k] with c_1..c_{k-1} removed, renormalised. Recursive
        rejection sampling (Jeon et al. 2024, "Recursive Speculative Decoding: Accelerating LLM
        Inference via Sampling Without Replacement", arXiv:2402.14160, Section 3, its theorem that
        recursive rejection sampling recovers the target distribution). Lossless when siblings are
        drawn without replacement from the parent's q (Gumbel-top-k, stochastic beam search) and each
        sibling carries that same row; siblings must be distinct (validate_tree).

    Proof (both cases). One step is Leviathan et al.'s speculative sampling: if c ~ q_k and r is the
    current target, then P(accept c = x) = q_k(x) min(1, r(x)/q_k(x)) = min(r(x), q_k(x)) and
    P(reject) = sum_x max(0, r(x) - q_k(x)) = Z, so the token finally emitted at this node is
    min(r, q_k) + Z * (law of what follows a rejection). By induction on the children left, what
    follows a rejection is r' = norm(max(0, r - q_k)) exactly, because the next child's conditional law
    given the history (earlier siblings and their rejections) is q_{k+1}: the uniforms are independent
    of the draws. The last step, with no child left, draws from r' itself. Hence the token emitted at
    this node has law min(r, q_k) + max(0, r - q_k) = r, and at the root r = p. Given that the walk
    moved to child x, the subtree below x was drawn from q(. | prefix, x) independently of the
    siblings' randomness, so the same argument applies one level down with p(. | prefix, x): the round
    emits y_0 y_1 ... with probability prod_d p(y_d | prefix, y_<d).

    Edge cases, on purpose (as rejection_sample): q_k(c) = 0 rejects (c could not have been drawn;
    a duplicate sibling without replacement is one); a residual summing to 0 (r == q_k up to rounding)
    leaves r as it was; no siblings left in q's support without replacement: q_k = 0, reject.
    """
    n = tokens.shape[0]
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)  # [N] one per node, in node order
    toks = tokens.tolist()
    children = _children(parents.tolist())
    path: list[int] = []
    r, mass = p[0], torch.ones((), dtype=p.dtype, device=p.device)  # current target, unnormalised, and its mass
    kids, taken = children[-1], []
    k = 0
    while k < len(kids):
        c, tok = kids[k], toks[kids[k]]
        q_k = q[c]
        if without_replacement and taken:
            q_k = q_k.clone()
            q_k[taken] = 0
            left = q_k.sum()
            q_k = q_k / left if left > 0 else torch.zeros_like(q_k)
        q_c = q_k[tok]
        if q_c > 0 and u[c] * q_c * mass < r[tok]:  # u < (r / mass)(c) / q_k(c) without dividing
            path.append(c)
            r, mass, kids, taken, k = p[c + 1], torch.ones_like(mass), children[c], [], 0
            continue
        residual = (r - mass * q_k).clamp_min(0)  # mass * max(0, r / mass - q_k)
        left = residual.sum()
        if left > 0:
            r, mass = residual, left
        taken.append(tok)
        k += 1
    return path, draw(r, generator)


def verify_tree_sampled_batched(
    p: torch.Tensor,  # [N + B, V] each session's N_b + 1 rows of target probabilities
    q: torch.Tensor,  # [N, V] the draft row each node's token was drawn from
    tokens: torch.Tensor,  # [N] int64
    parents: torch.Tensor,  # [N] int64, local
    cu_num_nodes: torch.Tensor,  # [B + 1] int64
    uniform: torch.Tensor,  # [N] U[0, 1) draws, one per node (round_randomness with N_b per session)
    at: torch.Tensor,  # [B] U[0, 1) float64: each session's point for the recovered / bonus draw
    without_replacement: torch.Tensor | bool = False,  # [B] bool or one for all: siblings drawn without replacement
) -> TreeVerdict:
    """tree_rejection_sample for B sessions at once, equal to it per session when the draws come from
    rejection.round_randomness(generators, N_b) (N uniforms, then the final draw's point). One
    step per child tried (at most max N_b steps), vectorised over sessions. A batch of chains gives
    rejection_sample_batched's result. Also returns each tried node's acceptance probability and the
    final distribution (for statistics and the exactness tests)."""
    n = tokens.shape[0]
    batch = cu_num_nodes.shape[0] - 1
    device = p.device
    b = torch.arange(batch, device=device)
    session = session_of_nodes(cu_num_nodes)
    _, first_child, next_sibling = sibling_links(parents, cu_num_nodes)
    node_row = torch.arange(n, device=device) + session + 1  # [N] row of p after each node
    wor = torch.as_tensor(without_replacement, device=device).expand(batch)  # [B]
    r = p.index_select(0, cu_num_nodes[:-1] + b)  # [B, V] current target at each session's node (unnormalised)
    mass = torch.ones(batch, dtype=p.dtype, device=device)  # [B] r's mass
    taken = torch.zeros(batch, p.shape[1], dtype=torch.bool, device=device)  # [B, V] rejected siblings' tokens
    child = first_child[n:]  # [B] the child tried next, -1 = stop
    accepted = torch.zeros(n + 1, dtype=torch.bool, device=device)  # per node; the spare slot n takes idle sessions' writes
    accept_prob = torch.full((n + 1,), float("nan"), dtype=p.dtype, device=device)
    while True:
        active = child >= 0
        if not bool(active.any()):
            break
        c = child.clamp(min=0)
        tok = tokens.index_select(0, c)  # [B]
        q_k = q.index_select(0, c)  # [B, V]
        if bool(wor.any()):
            masked = q_k.masked_fill(taken, 0)
            left = masked.sum(dim=-1, keepdim=True)
            renormalised = torch.where(left > 0, masked / left, torch.zeros_like(masked))
            q_k = torch.where((wor & taken.any(dim=-1))[:, None], renormalised, q_k)
        r_c, q_c = r.gather(1, tok[:, None])[:, 0], q_k.gather(1, tok[:, None])[:, 0]  # [B]
        acc = active & (q_c > 0) & (uniform.index_select(0, c) * q_c * mass < r_c)
        rej = active & ~acc
        prob = torch.where(q_c > 0, (r_c / (q_c * mass)).clamp(max=1), torch.zeros_like(r_c))
        accept_prob.scatter_(0, torch.where(active, c, n), prob)
        accepted.index_fill_(0, torch.where(acc, c, n), True)
        residual = (r - mass[:, None] * q_k).clamp_min(0)  # [B, V]
        left = residual.sum(dim=-1)
        update = rej & (left > 0)
        r = torch.where(update[:, None], residual, r)
        mass = torch.where(update, left, mass)
        taken.scatter_(1, tok[:, None], rej[:, None] | taken.gather(1, tok[:, None]))
        r = torch.where(acc[:, None], p.index_select(0, node_row.index_select(0, c)), r)
        mass = torch.where(acc, torch.ones_like(mass), mass)
        taken &= ~acc[:, None]
        child = torch.where(acc, first_child.index_select(0, c), torch.where(rej, next_sibling.index_select(0, c), child))
    next_token = inverse_cdf(r, at)  # one draw per session
    path, num_accepted = path_from_accepted(accepted[:n], tree_depth(parents, cu_num_nodes), cu_num_nodes)
    return TreeVerdict(path, num_accepted, next_token, accept_prob[:n], r)
