"""The draft chain (specdec.engine.draft_chain) and its keyed draws (specdec.math.keyed_draws).

Exact cases: the keyed noise is a pure function of (seed, position, token), whatever the batch or the
order of the candidates. Statistics: a keyed draw from a truncated q has q's law (chi-square). The chain
in every step mode ("static": the CUDA-graph chain run uncaptured) draws exactly what the step-by-step
path draws and leaves the KV cache as transformers' forward of the sequence would; an engine with the
chain on proposes exactly what it proposes with the chain off, batched, greedy and sampled, penalised
requests (which run step by step) among them. Under SPECDEC_TEST_DEVICE=cuda the cuda-graphs mode
captures the whole chain as one graph.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy.stats import chisquare

from specdec.core.prefix import PrefixHashes
from specdec.engine.config import BatchConfig, StepConfig, TierConfig
from specdec.engine.draft_chain import ChainFeed, run_chain
from specdec.engine.draft_sampler import DraftSampler
from specdec.engine.engine import Engine
from specdec.engine.propose import ProposeWork
from specdec.engine.runner import Feed
from specdec.math.keyed_draws import draw_top_n, keyed_exponential, split_seeds
from specdec.math.params import SamplingParams
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import TEST_DEVICE, device_model
from tests.step_modes import MODES, assert_close, make_runner
from tests.test_batching import prompt

GREEDY = SamplingParams()
WARM = SamplingParams(temperature=0.8, top_k=40)  # capturable: no top-p
NUCLEUS = SamplingParams(temperature=1.1, top_p=0.9)  # top-p: the chain runs uncaptured
PENALISED = SamplingParams(temperature=0.7, presence_penalty=0.5)


def test_keyed_noise_depends_on_seed_position_and_token_only():
    seeds = split_seeds([12345, 2**62 + 7], "cpu")
    positions = torch.tensor([10, 11])
    ids = torch.tensor([[5, 9, 100], [5, 9, 100]])
    e = keyed_exponential(seeds, positions, ids)
    assert torch.equal(e, keyed_exponential(seeds, positions, ids))  # deterministic
    assert torch.equal(e[:, [2, 0, 1]], keyed_exponential(seeds, positions, ids[:, [2, 0, 1]]))  # order-free
    assert torch.equal(e[1:], keyed_exponential(seeds[1:], positions[1:], ids[1:]))  # batch-free
    other = keyed_exponential(split_seeds([12345, 2**62 + 8], "cpu"), positions, ids)
    assert torch.equal(other[0], e[0]) and not torch.equal(other[1], e[1])  # the seed's low word matters
    later = keyed_exponential(seeds, positions + 1, ids)
    assert not torch.equal(later[0], e[0])
    assert bool((e > 0).all()) and torch.isfinite(e).all()


def test_keyed_draws_from_a_truncated_q_follow_q():
    """100k draws, each with its own (seed, position): the frequencies of a 6-token truncation of a
    distribution follow the renormalised truncation (chi-square), and tokens past it never appear."""
    probs = torch.tensor([0.3, 0.05, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05])
    n, top_n = 100_000, 6
    rows = probs[None].expand(n, -1)
    seeds = split_seeds([7 + 1_000_003 * i for i in range(n // 1000) for _ in range(1000)], "cpu")
    positions = torch.arange(n) % 1000
    token, ids, q = draw_top_n(rows, torch.full((n,), top_n), top_n, seeds, positions)
    kept = torch.topk(probs, top_n).indices
    want = probs[kept] / probs[kept].sum()
    assert torch.allclose(q[0], want) and torch.equal(ids[0], kept)
    counts = torch.bincount(token, minlength=8)
    assert int(counts[[i for i in range(8) if i not in kept.tolist()]].sum()) == 0
    expected = want.double().numpy() * n
    assert chisquare(counts[kept].double().numpy(), expected / expected.sum() * n).pvalue > 1e-3


@pytest.fixture(scope="module", params=MODES + (["cuda-graphs"] if TEST_DEVICE == "cuda" else []))
def two_runners(tiny_target, request):
    return make_runner(tiny_target, request.param), make_runner(tiny_target, request.param)


def _prefill(runner, slot: int, ids: list[int]) -> int:
    """Feed ids into slot; return the greedy next token."""
    (logits,) = runner.forward([Feed(slot, 0, ids, 1)])
    return int(logits[0].argmax())


@pytest.mark.parametrize("params", [[GREEDY, GREEDY, GREEDY], [WARM, GREEDY, WARM], [NUCLEUS, WARM, GREEDY]],
                         ids=["greedy", "mixed", "nucleus"])
def test_the_chain_draws_what_the_steps_draw_and_caches_the_sequence(two_runners, tiny_target, params):
    chained, stepped = two_runners
    prompts, firsts, tokens = chain_against_steps(chained, stepped, params)
    # The chain's cache holds prompt + first + the first steps - 1 draws: the next forward equals the
    # full forward of that sequence.
    reference = load_model(device_model(tiny_target))
    for s, p in enumerate(prompts):
        sequence = p + [firsts[s]] + tokens[s][:-1]
        (got,) = chained.forward([Feed(s, len(sequence), [tokens[s][-1]], 1)])
        with torch.inference_mode():
            want = reference(input_ids=torch.tensor([sequence + [tokens[s][-1]]], device=reference.device)).logits[0, -1:]
        assert_close(got, want, f"session {s}")


def chain_against_steps(chained, stepped, params):
    """Three sessions drafted 6 tokens by the chain on one runner and step by step on the other (fresh slots 0-2,
    the same sampler): the same tokens and q rows, asserted. Returns (prompts, first tokens, drawn tokens)."""
    prompts = [prompt(40 + i, 5 + 3 * i) for i in range(3)]
    steps, seeds, top_n = 6, [11, 22, 33], [8, 16, 4]
    firsts = [_prefill(r, s, p) for r in (chained, stepped) for s, p in enumerate(prompts)][:3]
    sampler = DraftSampler(params, top_n, seeds, chained.vocab_size, chained.device)
    out = run_chain(chained, [ChainFeed(s, len(p), f) for s, (p, f) in enumerate(zip(prompts, firsts))], steps, sampler)
    # The same steps one forward at a time, drawing with the same sampler
    tokens, cached = [list() for _ in prompts], [len(p) for p in prompts]
    current, q_ids, q_probs = list(firsts), [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        logits = torch.cat(stepped.forward([Feed(s, cached[s], [current[s]], 1) for s in range(3)]))
        drawn, ids, probs = sampler(logits, torch.tensor([c + 1 for c in cached], device=logits.device))
        for s in range(3):
            cached[s] += 1
        current = drawn.tolist()
        for s, d in enumerate(current):
            tokens[s].append(d)
        for j, i in enumerate(sampler.sampled):
            q_ids[i].append(ids[j].cpu())
            q_probs[i].append(probs[j].cpu())
    assert out.tokens == tokens
    for j, i in enumerate(sampler.sampled):
        assert all(torch.equal(a, b) for a, b in zip(out.q_ids[j], q_ids[i]))
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out.q_probs[j], q_probs[i]))
    return prompts, firsts, tokens


@pytest.fixture(scope="module")
def parts(tiny_target):
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)


def _engine(parts, chain: bool) -> Engine:
    model, tokenizer = parts
    engine = Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig(), step=StepConfig(draft_chain=chain)),
                    model, TokenizerSource.of(tokenizer))
    engine.start()
    return engine


async def _propose_all(engine: Engine, works: list[ProposeWork]):
    with engine.paused():  # all in one step
        tasks = [asyncio.ensure_future(engine.submit(w)) for w in works]
        await asyncio.sleep(0)
    return await asyncio.gather(*tasks)


def _works(round_: int, previous=None) -> list[ProposeWork]:
    """Eight sessions: K 1..8, greedy / sampled / penalised; round 1 continues from round 0's proposals."""
    mix = [GREEDY, WARM, NUCLEUS, PENALISED]
    works = []
    for i in range(8):
        ids = prompt(70 + i, 4 + 2 * i)
        new, prefix = ids, []
        if previous is not None:
            prefix = ids + previous[i].tokens[:-1]  # what the tier caches: all proposals but the last
            new = [previous[i].tokens[-1]]
        works.append(ProposeWork.create(f"s{i}", len(prefix), PrefixHashes(prefix).at(len(prefix)) if prefix else 0,
                                        new, 2 if mix[i % 4] is PENALISED else 1 + (i + round_) % 8, mix[i % 4],
                                        seed=1000 + i, top_n=16,
                                        prompt_len=len(ids)))
    return works


def test_an_engine_proposes_the_same_with_and_without_the_chain(parts):
    results, forwards = {}, {}
    for chain in (True, False):
        engine = _engine(parts, chain)
        counted = engine.runner.forward_checked
        forwards[chain] = 0

        def forward_checked(feeds, counted=counted, chain=chain):
            forwards[chain] += 1
            return counted(feeds)

        engine.runner.forward_checked = forward_checked
        try:
            first = asyncio.run(_propose_all(engine, _works(0)))
            second = asyncio.run(_propose_all(engine, _works(1, first)))
        finally:
            engine.close()
        results[chain] = (first, second)
    # per round: the step that drew d_1, and the penalised sessions' second step; the rest ran as chains
    assert (forwards[True], forwards[False]) == (4, 7 + 8)  # off: one step per token of the longest K
    for first, second in results.values():  # each proposal names its last step (the coordinator counts it once)
        assert all(r.step_id for r in first + second) and not {r.step_id for r in first} & {r.step_id for r in second}
    for on, off in zip(*(results[c][0] + results[c][1] for c in (True, False))):
        assert (on.tokens, on.cached_len) == (off.tokens, off.cached_len)
        assert (on.q is None) == (off.q is None)
        if on.q is not None:
            # The chain runs its sessions in other batches than the step-by-step path, and the matrix library
            # rounds a product of 2 rows and one of 7 differently (~1e-6 in q): same tokens, q within 1e-5.
            assert torch.equal(on.q.token_ids, off.q.token_ids)
            assert torch.allclose(on.q.probs, off.q.probs, rtol=0, atol=1e-5)
