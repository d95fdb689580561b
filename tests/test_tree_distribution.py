"""Token trees keep the target's law: exact enumeration on a tiny vocabulary, then chi-square tests.

The synthetic model of tests/test_distribution.py: bigram tables P[prev] (target p) and Q[prev] (draft
q), so the p row after a node is P[its token]. A round proposes a tree below the last token; the
emitted sequence is the accepted path's tokens, then the next token.

Exact tier (V = 4, depth 2, a few shapes): the law of the first two emitted tokens is computed from
the batched verifier itself and compared with the target's joint p(y0) p(y1 | y0) to float precision:
  * greedy: every token assignment of every shape, output equal to the target's greedy pair;
  * sampled trees (q): every possible draft tree (i.i.d. or without replacement, with its
    probability), and every accept / reject outcome of the uniforms, enumerated depth-first: the
    verifier reports the probability it accepted each tried node with, and the test forces each
    outcome with a uniform just inside that threshold (so the reported probability is the one the
    verifier uses), then weights the final draw by the distribution the verifier drew it from;
  * deterministic candidates: draw for draw, the output equals the target-alone sample with the
    same position-keyed draws (a coupling, so the laws are equal), over every outcome (y0, y1).
Negative controls: the same enumeration with a wrong scheme (without-replacement draws verified as
i.i.d., and the reverse) must differ from the target's law.

Statistical tier: chi-square and total variation against the exact joint of the first 3 tokens (the
harness of tests/test_distribution.py), with a wrong verifier as the negative control.
"""

from __future__ import annotations

import bisect
import itertools
import random

import numpy as np
import pytest
import torch

from specdec.math.params import SamplingParams
from specdec.math.draw import draw, inverse_cdf
from specdec.math.rejection import round_randomness
from specdec.math.sampling import make_generator, process_logits
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.math.tree import path_from_accepted, session_of_nodes, sibling_links, tree_depth
from specdec.math.tree_verify import (TreeVerdict, level_uniforms, num_levels, verify_tree_candidates_batched,
                                      verify_tree_greedy_batched, verify_tree_sampled_batched)
from tests.test_distribution import GOF_PVALUE_MIN, NEGATIVE_PVALUE_MAX, goodness_of_fit

pytestmark = pytest.mark.slow

# --- The synthetic model and tree shapes ---------------------------------------------------------

V_EXACT = 4
START = 0
# (children of the root, children of each root child): node order is breadth-first.
SHAPES = [(2, (2, 0)), (2, (1, 1)), (3, (1, 0, 0)), (1, (2,))]
ONE_MINUS = float(np.nextafter(np.float32(1), np.float32(0)))  # the largest float32 uniform below 1
MARGIN = 1e-5  # forced uniforms sit this far (relative) inside / outside a reported threshold


def make_tables(v: int, params: SamplingParams, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """P [v, v] target bigram, Q [v, v] a correlated but different draft bigram."""
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(v, v, generator=g)
    draft_logits = 0.5 * target_logits + 1.2 * torch.randn(v, v, generator=g)
    return process_logits(target_logits, params), process_logits(draft_logits, params)


def exact_joint(P: torch.Tensor, n_tokens: int) -> np.ndarray:
    p = P.double().numpy()
    p = p / p.sum(-1, keepdims=True)
    joint = p[START]
    for _ in range(n_tokens - 1):
        joint = joint[..., None] * p
    return joint


def shape_parents(shape) -> list[int]:
    root_kids, kids = shape
    return [-1] * root_kids + [j for j, m in enumerate(kids) for _ in range(m)]


def sibling_draws(q: list[float], m: int, without_replacement: bool):
    """Every ordered draw of m siblings from q with its probability."""
    if without_replacement:
        for seq in itertools.permutations(range(len(q)), m):
            w, left = 1.0, 1.0
            for x in seq:
                w, left = w * q[x] / left, left - q[x]
            if w > 0:
                yield list(seq), w
    else:
        for seq in itertools.product(range(len(q)), repeat=m):
            w = float(np.prod([q[x] for x in seq]))
            if w > 0:
                yield list(seq), w


def all_trees(ctx: int, shape, Q: list[list[float]], without_replacement: bool):
    """Every draft tree of this shape below ctx: (tokens, parents, context of each node's q row, weight)."""
    root_kids, kids = shape
    parents = shape_parents(shape)
    for first, w0 in sibling_draws(Q[ctx], root_kids, without_replacement):
        levels = [sibling_draws(Q[first[j]], m, without_replacement) for j, m in enumerate(kids)]
        for combo in itertools.product(*[list(level) for level in levels]):
            tokens = first + [t for seq, _ in combo for t in seq]
            q_ctx = [ctx] * root_kids + [first[j] for j, m in enumerate(kids) for _ in range(m)]
            yield tokens, parents, q_ctx, w0 * float(np.prod([w for _, w in combo]))


# --- Exact tier: the law of (y0, y1) out of the batched verifiers ------------------------------------


def sampled_first_two_law(P, Q, shape, drawn_without_replacement: bool, verified_without_replacement: bool) -> np.ndarray:
    """The exact law [V, V] of the first two tokens that verify_tree_sampled_batched emits."""
    v = P.shape[0]
    Qlist = Q.double().tolist()
    # An item: (ctx, tokens, parents, q_ctx, weight, forced {node: (uniform, accept?)}).
    items = [(ctx, t, par, qc, w, {}) for ctx in range(v) for t, par, qc, w in all_trees(ctx, shape, Qlist, drawn_without_replacement)]
    done = []  # (ctx, weight, accepted tokens, final distribution)
    while items:
        cu = torch.tensor([0] + [len(it[1]) for it in items]).cumsum(0)
        p = P[torch.tensor([c for it in items for c in [it[0]] + it[1]])]  # root row, then a row per node
        q = Q[torch.tensor([c for it in items for c in it[3]])]
        uniform = torch.tensor([it[5].get(i, (0.0,))[0] for it in items for i in range(len(it[1]))], dtype=torch.float32)
        verdict = verify_tree_sampled_batched(p, q, torch.tensor([t for it in items for t in it[1]]),
                                              torch.tensor([x for it in items for x in it[2]]), cu, uniform,
                                              torch.zeros(len(items), dtype=torch.float64),  # the draw: unused here
                                              torch.tensor([verified_without_replacement] * len(items)))
        prob = verdict.accept_prob.tolist()
        nxt = []
        for b, (ctx, tokens, parents, q_ctx, w, forced) in enumerate(items):
            start = int(cu[b])
            tried = [i for i in range(len(tokens)) if prob[start + i] == prob[start + i]]  # not NaN, walk order
            path = [i for i in verdict.path[b].tolist() if i >= 0]
            undecided = [i for i in tried if i not in forced]
            if not undecided:
                # every outcome was forced: the verifier did what its reported probabilities said
                assert path == [i for i in tried if forced[i][1]], (path, forced)
                done.append((ctx, w, [tokens[i] for i in path], verdict.dist[b].double()))
                continue
            i = undecided[0]
            t = prob[start + i]
            if t > 0:
                nxt.append((ctx, tokens, parents, q_ctx, w * t, {**forced, i: (t * (1 - MARGIN), True)}))
            if t < ONE_MINUS:
                nxt.append((ctx, tokens, parents, q_ctx, w * (1 - t), {**forced, i: (min(t * (1 + MARGIN), ONE_MINUS), False)}))
        items = nxt
    first = np.zeros((v, v))  # first[ctx] = law of the first token a round emits after ctx
    for ctx, w, accepted, dist in done:
        if accepted:
            first[ctx, accepted[0]] += w
        else:
            first[ctx] += w * (dist / dist.sum()).numpy()
    joint = np.zeros((v, v))
    for ctx, w, accepted, dist in done:
        if ctx != START:
            continue
        law = (dist / dist.sum()).numpy()
        if len(accepted) >= 2:
            joint[accepted[0], accepted[1]] += w
        elif len(accepted) == 1:
            joint[accepted[0]] += w * law
        else:  # stopped at the root: the second token is the next round's first, after y0
            joint += w * law[:, None] * first
    return joint


T1 = SamplingParams(temperature=1.0)
TOPK3 = SamplingParams(temperature=0.8, top_k=3)  # zeros in p and q; q's support (3) holds every sibling set
EXACT_CASES = [pytest.param(shape, wor, T1, id=f"{shape}-{'RRS' if wor else 'MSS'}-t1.0") for shape in SHAPES for wor in (False, True)]
EXACT_CASES += [pytest.param(shape, wor, TOPK3, id=f"{shape}-{'RRS' if wor else 'MSS'}-topk3")
                for shape in SHAPES[:2] for wor in (False, True)]


@pytest.mark.parametrize("shape, without_replacement, params", EXACT_CASES)
def test_sampled_tree_law_is_exactly_the_target(shape, without_replacement, params):
    P, Q = make_tables(V_EXACT, params)
    law = sampled_first_two_law(P, Q, shape, without_replacement, without_replacement)
    np.testing.assert_allclose(law, exact_joint(P, 2), atol=2e-6)


@pytest.mark.parametrize("drawn, verified", [(True, False), (False, True)], ids=["wor-verified-as-iid", "iid-verified-as-wor"])
def test_negative_control_wrong_sibling_scheme_changes_the_law(drawn, verified):
    """The enumeration has power: verifying siblings under the other sampling scheme is not lossless."""
    P, Q = make_tables(V_EXACT, SamplingParams(temperature=1.0))
    law = sampled_first_two_law(P, Q, (3, (1, 0, 0)), drawn, verified)
    assert np.abs(law - exact_joint(P, 2)).max() > 1e-3


def greedy_pair(P: torch.Tensor) -> tuple[int, int]:
    y0 = int(P[START].argmax())
    return y0, int(P[y0].argmax())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_tree_every_token_assignment_gives_the_target_pair(shape):
    """Every tree of this shape (all V^N token assignments, duplicates included) below every context:
    the first two tokens are the target's greedy pair, over one or two rounds."""
    P = process_logits(torch.randn(V_EXACT, V_EXACT, generator=torch.Generator().manual_seed(5)), SamplingParams())
    parents = shape_parents(shape)
    n = len(parents)
    assignments = list(itertools.product(range(V_EXACT), repeat=n))
    best = [int(P[c].argmax()) for c in range(V_EXACT)]
    expect = greedy_pair(P)
    for ctx in range(V_EXACT):
        cu = torch.arange(len(assignments) + 1) * n
        tokens = torch.tensor(assignments).reshape(-1)
        rows = torch.tensor([[ctx] + list(a) for a in assignments]).reshape(-1)
        verdict = verify_tree_greedy_batched(P[rows], tokens, torch.tensor(parents * len(assignments)), cu)
        for b, a in enumerate(assignments):
            emitted = [a[i] for i in verdict.path[b].tolist() if i >= 0] + [int(verdict.next_token[b])]
            assert emitted[0] == best[ctx]
            if ctx == START and len(emitted) >= 2:
                assert tuple(emitted[:2]) == expect
            if len(emitted) >= 2:
                assert emitted[1] == best[emitted[0]]


def test_candidates_equal_target_alone_sampling_draw_for_draw():
    """Deterministic candidates with position-keyed draws: the first two tokens equal those the target
    alone draws at the same points (specdec.math.draw), for every tree shape, for candidate trees
    built from the target's likely tokens and from unlikely ones, over draws that visit every
    outcome (y0, y1) of positive probability. Equal draw for draw means equal laws."""
    P, _ = make_tables(V_EXACT, SamplingParams(temperature=1.0))
    rng = random.Random(0)
    seen = set()
    for trial in range(1000):
        seed = 1000 + trial
        gens = lambda pos: make_generator(derive_seed(seed, pos, TARGET_STREAM))  # noqa: E731
        y0 = draw(P[START], gens(0))
        y1 = draw(P[y0], gens(1))
        seen.add((y0, y1))
        out, ctx = [], START
        while len(out) < 2:
            shape = SHAPES[trial % len(SHAPES)]
            parents = shape_parents(shape)
            tokens = [rng.randrange(V_EXACT) for _ in parents]
            cu = torch.tensor([0, len(parents)])
            par = torch.tensor(parents)
            levels = num_levels(par, cu)[0]
            at = level_uniforms([[gens(len(out) + d) for d in range(levels)]])
            rows = torch.tensor([ctx] + tokens)
            verdict = verify_tree_candidates_batched(P[rows], torch.tensor(tokens), par, cu, at)
            out += [tokens[i] for i in verdict.path[0].tolist() if i >= 0] + [int(verdict.next_token[0])]
            ctx = out[-1]
        assert tuple(out[:2]) == (y0, y1), trial
    joint = exact_joint(P, 2)
    assert all(joint[a, b] > 0 for a, b in seen)
    assert seen >= {(a, b) for a in range(V_EXACT) for b in range(V_EXACT) if joint[a, b] > 0.01}


# --- Statistical tier -------------------------------------------------------------------------------

V = 5
N_TOKENS = 3  # depth-2 trees: two accepted tokens and the bonus
N_TRIALS = 12_000
N_TRIALS_NEGATIVE = 4_000
CHI_SHAPE = (2, (2, 1))


def _cdfs(Q: torch.Tensor) -> list[list[float]]:
    return [(row / row.sum()).cumsum(0).tolist() for row in Q.double()]


def _draw_siblings(rng: random.Random, q_row: list[float], m: int, without_replacement: bool) -> list[int]:
    """m siblings from q: i.i.d., or without replacement (each draw from q with the earlier ones removed)."""
    out: list[int] = []
    for _ in range(m):
        weights = [0.0 if (without_replacement and x in out) else w for x, w in enumerate(q_row)]
        cum = list(itertools.accumulate(weights))
        last = max(x for x, w in enumerate(weights) if w > 0)
        out.append(min(bisect.bisect_right(cum, rng.random() * cum[-1]), last))
    return out


def draft_tree(rng: random.Random, ctx: int, Q: list[list[float]], without_replacement: bool):
    """A CHI_SHAPE tree drawn from the draft below ctx: (tokens, parents, q context per node)."""
    root_kids, kids = CHI_SHAPE
    first = _draw_siblings(rng, Q[ctx], root_kids, without_replacement)
    tokens, q_ctx = list(first), [ctx] * root_kids
    for j, m in enumerate(kids):
        tokens += _draw_siblings(rng, Q[first[j]], m, without_replacement)
        q_ctx += [first[j]] * m
    return tokens, shape_parents(CHI_SHAPE), q_ctx


def candidate_tree(ctx: int):
    """A fixed (deterministic) proposal tree below ctx, as a suffix tree or prompt lookup would offer."""
    root = [(ctx + 1) % V, (2 * ctx + 3) % V]
    return root + [(root[0] + 2) % V, (root[0] + 4) % V, ctx], shape_parents(CHI_SHAPE)


def run_trees(P, Q, schemes: list[str], *, seed: int, verify=verify_tree_sampled_batched) -> np.ndarray:
    """Counts [V] * N_TOKENS of the first tokens of len(schemes) generations, all verified round by round
    as one ragged batch: "iid" and "wor" sessions (draft trees) share one sampled verify call,
    "candidates" sessions (fixed trees, position-keyed draws) go through the candidates verifier."""
    rng = random.Random(seed)
    Qlist = Q.double().tolist()
    n = len(schemes)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + t) for t in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    active = list(range(n))
    while active:
        sampled = [t for t in active if schemes[t] != "candidates"]
        fixed = [t for t in active if schemes[t] == "candidates"]
        if sampled:
            trees = [draft_tree(rng, outs[t][-1] if outs[t] else START, Qlist, schemes[t] == "wor") for t in sampled]
            sizes = [len(tr[0]) for tr in trees]
            cu = torch.tensor([0] + sizes).cumsum(0)
            rows = torch.tensor([c for t, tr in zip(sampled, trees) for c in [outs[t][-1] if outs[t] else START] + tr[0]])
            uniform, at = round_randomness([gens[t] for t in sampled], sizes)
            verdict = verify(P[rows], Q[torch.tensor([c for tr in trees for c in tr[2]])],
                             torch.tensor([x for tr in trees for x in tr[0]]), torch.tensor([x for tr in trees for x in tr[1]]),
                             cu, uniform, at, torch.tensor([schemes[t] == "wor" for t in sampled]))
            for b, (t, tr) in enumerate(zip(sampled, trees)):
                outs[t] += [tr[0][i] for i in verdict.path[b].tolist() if i >= 0] + [int(verdict.next_token[b])]
        if fixed:
            trees = [candidate_tree(outs[t][-1] if outs[t] else START) for t in fixed]
            sizes = [len(tr[0]) for tr in trees]
            cu = torch.tensor([0] + sizes).cumsum(0)
            parents = torch.tensor([x for tr in trees for x in tr[1]])
            levels = num_levels(parents, cu)
            at = level_uniforms([[make_generator(derive_seed(seed * 7919 + t, len(outs[t]) + d, TARGET_STREAM))
                                  for d in range(lv)] for t, lv in zip(fixed, levels)])
            rows = torch.tensor([c for t, tr in zip(fixed, trees) for c in [outs[t][-1] if outs[t] else START] + tr[0]])
            verdict = verify_tree_candidates_batched(P[rows], torch.tensor([x for tr in trees for x in tr[0]]), parents, cu, at)
            for b, (t, tr) in enumerate(zip(fixed, trees)):
                outs[t] += [tr[0][i] for i in verdict.path[b].tolist() if i >= 0] + [int(verdict.next_token[b])]
        active = [t for t in active if len(outs[t]) < N_TOKENS]
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for out in outs:
        counts[tuple(out[:N_TOKENS])] += 1
    return counts


def assert_matches_target(counts: np.ndarray, joint: np.ndarray) -> None:
    assert counts[joint == 0].sum() == 0, "generated a sequence of target probability 0"
    pvalue, tv, noise_tv = goodness_of_fit(counts, joint)
    assert pvalue > GOF_PVALUE_MIN, f"chi-square p={pvalue:.3g}, TV={tv:.4f} (noise ~{noise_tv:.4f})"
    assert tv < 1.5 * noise_tv, f"TV={tv:.4f} vs noise ~{noise_tv:.4f}"


@pytest.mark.parametrize("schemes, params, n_trials", [
    pytest.param(["iid"], SamplingParams(temperature=1.0), N_TRIALS, id="draft-iid-MSS"),
    pytest.param(["wor"], SamplingParams(temperature=1.0), N_TRIALS, id="draft-without-replacement-RRS"),
    # position-keyed draws make a generator per position: fewer trials keep the test fast
    pytest.param(["candidates"], SamplingParams(temperature=0.8, top_k=3), N_TRIALS // 2, id="candidates-topk3"),
    pytest.param(["iid", "wor", "candidates"], SamplingParams(temperature=1.0, top_p=0.9), N_TRIALS, id="mixed-batch-topp0.9"),
])
def test_tree_sampling_matches_target(schemes, params, n_trials):
    P, Q = make_tables(V, params)
    counts = run_trees(P, Q, [schemes[t % len(schemes)] for t in range(n_trials)], seed=len(schemes) + 11)
    assert_matches_target(counts, exact_joint(P, N_TOKENS))


def _naive_batched(p, q, tokens, parents, cu, uniform, at, without_replacement=None):
    """WRONG on purpose: every sibling is tested against p at the node itself (no residual after a
    rejection), as a naive multi-candidate verifier would; the recovered token comes from
    max(0, p - q) of the last sibling tried."""
    n, batch = tokens.shape[0], cu.shape[0] - 1
    b = torch.arange(batch)
    session = session_of_nodes(cu)
    _, first_child, next_sibling = sibling_links(parents, cu)
    r = p[cu[:-1] + b].clone()
    child = first_child[n + b]
    accepted = torch.zeros(n, dtype=torch.bool)
    last_q = torch.zeros_like(r)
    while bool((child >= 0).any()):
        active = child >= 0
        c = child.clamp(min=0)
        tok = tokens[c]
        q_c = q[c, tok]
        acc = active & (q_c > 0) & (uniform[c] * q_c < r[b, tok])
        rej = active & ~acc
        accepted[c[acc]] = True
        last_q = torch.where(rej[:, None], q[c], last_q)
        r = torch.where(acc[:, None], p[c + session[c] + 1], r)
        last_q = torch.where(acc[:, None], 0.0, last_q)
        child = torch.where(acc, first_child[c], torch.where(rej, next_sibling[c], child))
    residual = (r - last_q).clamp_min(0)
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, r)
    path, num = path_from_accepted(accepted, tree_depth(parents, cu), cu)
    return TreeVerdict(path, num, inverse_cdf(dist, at))


def test_negative_control_wrong_tree_verifier_is_detected():
    """Same harness, same criterion: a verifier that skips the residual between siblings must fail."""
    P, Q = make_tables(V, SamplingParams(temperature=1.0))
    counts = run_trees(P, Q, ["iid"] * N_TRIALS_NEGATIVE, seed=3, verify=_naive_batched)
    pvalue, tv, noise_tv = goodness_of_fit(counts, exact_joint(P, N_TOKENS))
    assert pvalue < NEGATIVE_PVALUE_MAX, f"wrong tree verifier passed: p={pvalue:.3g}, TV={tv:.4f}"


def test_negative_control_correct_verifier_passes_on_same_budget():
    P, Q = make_tables(V, SamplingParams(temperature=1.0))
    counts = run_trees(P, Q, ["iid"] * N_TRIALS_NEGATIVE, seed=3)
    assert_matches_target(counts, exact_joint(P, N_TOKENS))
