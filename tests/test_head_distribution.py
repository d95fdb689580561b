"""The sampled law with an EAGLE-3 head as the draft: the head engine's real proposals (q over a 64-token draft
vocabulary, 0 outside it, truncated and drawn as the draft model's) verified by the target engine's batched
rejection sampler against the tiny target's real logits give the first committed token exactly the target's law
(chi-square), tokens outside the draft vocabulary included; the same harness rejects a verifier told a wrong q."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.config import TierConfig
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.eagle3 import HeadCache, write_checkpoint
from specdec.engine.eagle3_features import target_features
from specdec.engine.head_engine import HeadEngine
from specdec.engine.propose import ProposeWork
from specdec.engine.verify import VerifyWork, _verify_sampled
from specdec.math.draft_vocab import d2t_from_target_ids, t2d_mask
from specdec.math.params import SamplingParams
from tests.helpers import device_model
from tests.test_eagle3_head import small_head

pytestmark = pytest.mark.slow

PROMPT = [1, 17, 256, 9, 4001, 33, 712, 88, 5, 61]
PARAMS = SamplingParams(temperature=1.0, top_k=3)
N_TRIALS = 3_000


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_target_model, tmp_path_factory):
    """A head whose q at the prompt's end puts its top 3 on two of the target's top 3 tokens and one other."""
    target = tiny_target_model
    with torch.inference_mode():
        rows, out = target_features(target, torch.tensor([PROMPT]), [0, 1, 1])
    p_logits = out.logits[0, -1].float()
    top = torch.topk(p_logits, 4).indices.tolist()
    a, b, c = top[0], top[1], top[3]  # c: outside the target's top 3, so p(c) = 0 under top_k = 3
    head = small_head(target, vocab=64, seed=2)
    others = [t for t in torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(5)).tolist()
              if t not in (a, b, c)][:61]
    head.d2t = d2t_from_target_ids(torch.tensor([a, b, c] + others))
    head.t2d = t2d_mask(head.d2t, head.vocab_size)
    draft_of = {t: i for i, t in enumerate(head.target_ids(torch.arange(64)).tolist())}
    with torch.no_grad():
        g = head.fuse(rows[0, : len(PROMPT) - 1])
        last = head.step(torch.tensor(PROMPT[1:]), g, torch.arange(len(PROMPT) - 1), HeadCache())[-1]
        normed = head.norm(last)
        head.lm_head.weight.zero_()
        for token, logit in ((a, 2.0), (b, 3.0), (c, 2.5)):  # q's top 3: b, c, a
            head.lm_head.weight[draft_of[token]] = logit * normed / normed.dot(normed)
    path = tmp_path_factory.mktemp("head-law") / "head"
    write_checkpoint(head, path)
    engine = HeadEngine.load(TierConfig(device_model(str(path)), cost_curve_s=0), tiny_target)
    bonus = {}
    with torch.inference_mode():
        for d in (a, b, c):
            bonus[d] = target(torch.tensor([PROMPT + [d]])).logits[0, -1].float()
    yield engine, rows[0, : len(PROMPT) - 1], p_logits, bonus, (a, b, c)
    engine.close()


@pytest.fixture(scope="module")
def results(setup) -> list:
    engine, rows = setup[0], setup[1]
    async def one(seed):
        w = ProposeWork.create(f"law{seed}", 0, 0, PROMPT, 1, PARAMS, seed, 64)
        w.features, w.features_start = rows, 0
        return await engine.submit(w)

    async def all_():  # in groups the engine's queue takes (--max-queue)
        out = []
        for start in range(0, N_TRIALS, 500):
            out += await asyncio.gather(*(one(s) for s in range(start, start + 500)))
        return out

    return asyncio.run(all_())


def chi_square(counts: torch.Tensor, want: torch.Tensor) -> float:
    expected = want.double() / want.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def first_tokens(results, p_logits, bonus, q_told=None) -> torch.Tensor:
    out = []
    for start in range(0, len(results), 500):  # batches of 500 sessions, as a target step verifies them
        part = results[start : start + 500]
        works = [VerifyWork.create(f"v{start + i}", 0, 0, PROMPT, r.tokens, q_told or r.q, PARAMS, seed=start + i)
                 for i, r in enumerate(part)]
        logits = [torch.stack([p_logits, bonus[r.tokens[0]]]) for r in part]
        n, nxt = _verify_sampled(works, logits, p_logits.shape[0])
        out += [r.tokens[0] if k else t for r, k, t in zip(part, n, nxt)]
    return torch.tensor(out)


def test_the_head_as_draft_keeps_the_target_law(setup, results):
    engine, rows, p_logits, bonus, (a, b, c) = setup
    drafted = torch.tensor([r.tokens[0] for r in results])
    assert set(drafted.tolist()) == {a, b, c}  # the head's q: its top 3, one of them outside p's support
    tokens = first_tokens(results, p_logits, bonus)
    p = torch.softmax(p_logits, -1)
    support = torch.topk(p_logits, 3).indices.tolist()
    want = p[support] / p[support].sum()
    counts = torch.tensor([(tokens == t).sum() for t in support], dtype=torch.float64)
    assert int(counts.sum()) == N_TRIALS  # nothing outside the target's top 3
    assert 0 < int((tokens == drafted).sum()) < N_TRIALS  # drafts accepted and rejected
    assert chi_square(counts, want) > 1e-3


def test_a_verifier_told_the_wrong_q_is_caught(setup, results):
    """Negative control: the same proposals verified as if q were uniform on the head's top 3 must fail the test."""
    engine, rows, p_logits, bonus, (a, b, c) = setup
    wrong = DraftProbs.from_rows([(torch.tensor([a, b, c]), torch.full((3,), 1 / 3))])
    tokens = first_tokens(results[:1000], p_logits, bonus, q_told=wrong)
    support = torch.topk(p_logits, 3).indices.tolist()
    p = torch.softmax(p_logits, -1)
    want = p[support] / p[support].sum()
    counts = torch.tensor([(tokens == t).sum() for t in support], dtype=torch.float64)
    assert chi_square(counts, want) < 1e-6
