"""The keyed race (specdec.math.race): a sampled token as a function of (seed, position, p), and verification by it.

Exact cases: the draw is a pure function of its keys and p, equals the race of every token's own key where every
token races, never draws a token of zero mass; a round verified by it emits the target-alone output of the same
seed whatever was proposed (chains of any K, adversarial drafts, token trees of any shape). Statistical: the
draw's law is p (its lazily raced rest included), and the speculative loop's output is the target's joint law.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.math.keyed_draws import keyed_exponential, split_seeds
from specdec.math.params import SamplingParams
from specdec.math.race import race_draw
from specdec.math.rejection import walk_chains
from specdec.math.tree import tree_depth
from specdec.math.tree_verify import walk_matching
from tests.test_distribution import START, V, assert_matches_target, exact_joint, make_tables
from tests.test_tree_engine import path_to

N_TOKENS = 3  # the joint of the first three tokens (test_distribution's harness)


def draw(p: torch.Tensor, seed: int, positions, top: int = 64) -> list[int]:
    """race_draw of rows p at `positions`, every row keyed by `seed`."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    return race_draw(p, split_seeds([seed] * len(positions), "cpu"), positions, top=top).tolist()


def test_the_draw_is_a_function_of_seed_position_and_p_only():
    torch.manual_seed(0)
    p = torch.softmax(3 * torch.randn(6, 300), dim=-1)
    seeds = split_seeds([11, 11, 11, 12, 12, 12], "cpu")
    positions = torch.tensor([5, 6, 7, 5, 6, 7])
    x = race_draw(p, seeds, positions, top=16)
    assert torch.equal(x, race_draw(p, seeds, positions, top=16))  # deterministic
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    assert torch.equal(x[order], race_draw(p[order], seeds[order], positions[order], top=16))  # batch- and order-free
    assert torch.equal(x[2:3], race_draw(p[2:3], seeds[2:3], positions[2:3], top=16))  # alone
    many = torch.softmax(3 * torch.randn(1, 300), dim=-1).expand(200, 300)
    assert len(set(draw(many, 3, range(200), top=16))) > 20  # positions draw differently
    assert draw(many, 3, range(200), top=16) != draw(many, 4, range(200), top=16)  # so do seeds


def test_where_every_token_races_it_is_the_race_of_every_tokens_own_key():
    torch.manual_seed(1)
    p = torch.softmax(2 * torch.randn(400, 40), dim=-1)
    seeds, positions = split_seeds(list(range(400)), "cpu"), torch.arange(400) * 7
    every = torch.arange(40).expand(400, 40)
    expected = (keyed_exponential(seeds, positions, every).double() / p.double()).argmin(dim=-1)
    assert torch.equal(race_draw(p, seeds, positions, top=40), expected)


def test_one_hot_rows_and_tokens_of_zero_mass():
    p = torch.zeros(3, 10)
    p[0, 7] = 1.0  # one-hot
    p[1, [2, 5]] = torch.tensor([0.25, 0.75])  # zero mass in the raced top and in the rest (top = 1)
    p[2, [0, 9]] = torch.tensor([1e-30, 1.0])  # a rest of almost no mass
    n = 4000
    for top in (1, 2, 64):
        x = np.array(draw(p.repeat_interleave(n, 0), 5, np.tile(np.arange(n), 3), top=top)).reshape(3, n)
        assert (x[0] == 7).all()
        assert set(x[1]) == {2, 5}
        assert set(x[2]) <= {0, 9} and (x[2] == 9).mean() > 0.999


@pytest.mark.parametrize("top", [1, 3, 64], ids=["top1", "top3", "top64"])
def test_the_draw_follows_p(top: int):
    """Its law is p: the top tokens racing their own keys and the rest raced as one (top < 8) alike."""
    p = torch.tensor([[0.31, 0.22, 0.17, 0.12, 0.09, 0.05, 0.04, 0.0]])
    n = 60_000
    x = draw(p.expand(n, 8), 2024, range(n), top=top)
    counts = np.bincount(x, minlength=8)
    assert counts[7] == 0
    assert chisquare(counts[:7], p[0, :7].double().numpy() * n).pvalue > 1e-3


def race_round(P: torch.Tensor, context: list[int], drafts: list[int], seed: int, top: int) -> list[int]:
    """One round verified by the race: the target's rows after the context and each draft, each drawing the
    token at its position; returns the tokens it commits (the accepted drafts and the next token)."""
    rows = [context[-1]] + drafts
    n, nxt = walk_chains(draw(P[rows], seed, range(len(context), len(context) + len(rows)), top=top), [drafts])
    return drafts[: n[0]] + [nxt[0]]


def generate(P: torch.Tensor, Q: torch.Tensor | None, seed: int, k: int, *, top: int = 2, length: int = N_TOKENS,
             adversary: np.random.Generator | None = None) -> list[int]:
    """`length` tokens after START in rounds of k drafts: drawn from Q racing the target's keys (the draft tier's
    draws with a shared key), or chosen by `adversary` at random; K = 0 with k = 0."""
    out = [START]
    while len(out) <= length:
        drafts = []
        for i in range(k):
            prev = drafts[-1] if drafts else out[-1]
            if adversary is not None:
                drafts.append(int(adversary.integers(V)))
            else:
                drafts.append(draw(Q[[prev]], seed, [len(out) + i], top=V)[0])
        out += race_round(P, out, drafts, seed, top)
    return out[1 : length + 1]


def test_the_output_is_the_targets_alone_whatever_was_proposed():
    """Chains of any K, drafts from a draft model racing the same keys or chosen at random: every seed's output is
    token for token what the target alone (K = 0) draws with that seed."""
    P, Q = make_tables(SamplingParams(temperature=1.0))
    adversary = np.random.default_rng(0)
    for seed in range(150):
        alone = generate(P, Q, seed, 0, length=8)
        for k in (1, 2, 4):
            assert generate(P, Q, seed, k, length=8) == alone
        assert generate(P, None, seed, 3, length=8, adversary=adversary) == alone


def test_a_token_tree_emits_the_targets_alone_output():
    """A tree's rows draw at their node's depth (the root's at the committed length): walking the children that
    hold the race's token gives the same tokens as the chain and the target alone, whatever the tree's shape."""
    P, _ = make_tables(SamplingParams(temperature=0.8))
    rng = np.random.default_rng(1)
    for seed in range(100):
        alone = generate(P, None, seed, 0, length=12)
        out = [START]
        while len(out) <= 12:
            n = int(rng.integers(1, 8))
            parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
            tokens = [int(rng.integers(V)) for _ in range(n)]
            for i in range(n):  # a branch that follows the target often, so that walks go deep
                if rng.random() < 0.5:
                    prefix = out[1:] + [tokens[j] for j in path_to(parents, parents[i])]
                    tokens[i] = alone[len(prefix)] if len(prefix) < len(alone) else tokens[i]
            depth = tree_depth(torch.tensor(parents), torch.tensor([0, n])).tolist()
            rows = [out[-1]] + tokens
            x = torch.tensor(draw(P[rows], seed, [len(out) + d for d in [0] + [d + 1 for d in depth]], top=2))
            verdict = walk_matching(x, torch.tensor(tokens), torch.tensor(parents), torch.tensor([0, n]))
            path = verdict.path[0, : int(verdict.num_accepted[0])].tolist()
            out += [tokens[j] for j in path] + [int(verdict.next_token[0])]
        assert out[1:13] == alone



@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t1.0", "t0.7-topk3"])
def test_speculative_rounds_by_the_race_match_the_target(params: SamplingParams):
    """The joint of the first three tokens over 8,000 seeds, in rounds of two drafts racing the target's keys,
    the target racing its top 2 tokens and the rest as one: the target's own law (test_distribution's criterion)."""
    P, Q = make_tables(params)
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for seed in range(8_000):
        counts[tuple(generate(P, Q, 10_000_019 * seed + 3, 2))] += 1
    assert_matches_target(counts, exact_joint(P))
