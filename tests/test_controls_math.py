"""The sampling controls as pure math (specdec.math.penalties, specdec.math.sampling): logit_bias, the
presence / frequency / repetition penalties, min_p and the reported logprobs, each against a hand-computed
case; and the penalties inside a K-draft verify equal K+1 separate one-token computations."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts
from specdec.math.sampling import logprobs_rows, process_logits, process_logits_rows, top_logprobs

T1 = dict(temperature=1.0)


def counts_of(tokens, prompt_len, vocab, rows=1):
    """Counts for `rows` positions ending the sequence (the last rows - 1 tokens are 'drafts')."""
    return TokenCounts.at_positions(tokens, prompt_len, len(tokens) - rows + 1, rows, 0, vocab)


def test_logit_bias_is_added_to_the_raw_logits_and_moves_the_argmax():
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    params = SamplingParams(logit_bias=SamplingParams.bias_items({1: 2.0, 3: -100.0}))
    assert process_logits(logits, params).tolist() == [[0.0, 1.0, 0.0, 0.0]]  # greedy on [0, 2, 0, -99]
    sampled = process_logits(logits, SamplingParams(**T1, logit_bias=params.logit_bias))
    torch.testing.assert_close(sampled, torch.tensor([[0.0, 2.0, 0.0, -99.0]]).softmax(-1))
    assert logits.tolist() == [[0.0, 0.0, 0.0, 1.0]]  # the caller's logits are not modified


def test_presence_and_frequency_count_generated_tokens_only():
    # prompt [3, 3], generated [1, 2, 2]: presence hits 1 and 2 once; frequency 1 once and 2 twice; not 3.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = counts_of([3, 3, 1, 2, 2], 2, 4)
    assert counts.output.tolist() == [[0.0, 1.0, 2.0, 0.0]] and counts.seen.tolist() == [[False, True, True, True]]
    pres = SamplingParams(presence_penalty=0.5, **T1)
    torch.testing.assert_close(process_logits(logits, pres, counts), torch.tensor([[1.0, 0.5, 0.5, 1.0]]).softmax(-1))
    freq = SamplingParams(frequency_penalty=0.5, **T1)
    torch.testing.assert_close(process_logits(logits, freq, counts), torch.tensor([[1.0, 0.5, 0.0, 1.0]]).softmax(-1))
    # negative penalties encourage repeats
    both = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.25, **T1)
    torch.testing.assert_close(process_logits(logits, both, counts), torch.tensor([[1.0, 2.25, 2.5, 1.0]]).softmax(-1))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0, -2.0]])
    counts = counts_of([0, 2], 1, 5)  # prompt [0], generated [2]
    params = SamplingParams(repetition_penalty=2.0, **T1)
    torch.testing.assert_close(process_logits(logits, params, counts),
                               torch.tensor([[1.0, 1.0, -2.0, 3.0, -2.0]]).softmax(-1))
    # greedy: the penalty moves the argmax: token 0 (in the prompt) drops from 3 to 1.5, below token 1
    greedy = SamplingParams(repetition_penalty=2.0)
    g = process_logits(torch.tensor([[3.0, 2.0, 0.0]]), greedy, counts_of([0], 1, 3))
    assert g.tolist() == [[0.0, 1.0, 0.0]]  # 3 / 2 = 1.5 < 2


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = process_logits(probs.log(), SamplingParams(min_p=0.2, **T1))  # threshold 0.1
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    # after temperature (vLLM's order): at T=2 the probabilities flatten and 0.05 survives the same min_p
    out = process_logits(probs.log(), SamplingParams(temperature=2.0, min_p=0.2))
    assert bool((out > 0).all())
    # min_p does nothing to greedy
    assert process_logits(probs.log(), SamplingParams(min_p=0.9)).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_order_is_bias_then_penalties():
    # bias makes logit 1 positive (0.5 + 1.5 = 2): the repetition penalty then divides it (1.0), not multiplies
    logits = torch.tensor([[0.5, -0.5, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((1, 2.5),), **T1)
    torch.testing.assert_close(process_logits(logits, params, counts_of([1], 1, 3)),
                               torch.tensor([[0.5, 1.0, 0.0]]).softmax(-1))


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.3, **T1),
    SamplingParams(repetition_penalty=1.7, presence_penalty=-0.5),  # greedy
    SamplingParams(temperature=0.7, frequency_penalty=1.5, min_p=0.05, top_k=20, logit_bias=((3, 4.0), (7, -2.0))),
])
def test_penalties_inside_a_verify_equal_one_token_computations(params):
    """A verify of K drafts: row i counts the committed generated tokens plus d_1..d_i; process_logits_rows
    over all K+1 rows at once equals K+1 separate one-position computations."""
    g = torch.Generator().manual_seed(0)
    vocab, prompt_len, k = 16, 5, 4
    committed = torch.randint(0, vocab, (9,), generator=g).tolist()  # prompt 5 + 4 generated
    drafts = torch.randint(0, vocab, (k,), generator=g).tolist()
    logits = torch.randn(k + 1, vocab, generator=g) * 3
    seq = committed + drafts
    counts = TokenCounts.at_positions(seq, prompt_len, len(committed), k + 1, 0, vocab)
    together = process_logits_rows(logits, [params] * (k + 1), counts)
    lp_together = logprobs_rows(logits, [params] * (k + 1), counts)
    for i in range(k + 1):
        history = seq[: len(committed) + i]
        one = counts_of(history, prompt_len, vocab)
        # the counts by hand: generated tokens before position i
        expected = torch.bincount(torch.tensor(history[prompt_len:]), minlength=vocab).float()
        assert counts.output[i].tolist() == expected.tolist()
        assert counts.seen[i].tolist() == (torch.bincount(torch.tensor(history), minlength=vocab) > 0).tolist()
        assert torch.equal(together[i], process_logits(logits[i : i + 1], params, one)[0])
        assert torch.equal(lp_together[i], logprobs_rows(logits[i : i + 1], [params], one)[0])


def test_rows_of_a_batch_each_with_their_own_params_and_counts():
    g = torch.Generator().manual_seed(1)
    vocab = 12
    logits = torch.randn(5, vocab, generator=g)
    plain = SamplingParams(**T1)
    pen = SamplingParams(frequency_penalty=1.0, **T1)
    # rows 1..2 a penalised session's two positions; rows 0, 3, 4 unpenalised
    counts = TokenCounts.at_positions([1, 2, 3, 3], 1, 3, 2, 1, vocab)
    out = process_logits_rows(logits, [plain, pen, pen, plain, SamplingParams()], counts)
    assert torch.equal(out[0], process_logits(logits[:1], plain)[0])
    assert torch.equal(out[1], process_logits(logits[1:2], pen, counts_of([1, 2, 3], 1, vocab))[0])
    assert torch.equal(out[2], process_logits(logits[2:3], pen, counts_of([1, 2, 3, 3], 1, vocab))[0])
    assert torch.equal(out[4], process_logits(logits[4:], SamplingParams())[0])
    with pytest.raises(ValueError, match="token counts"):
        process_logits_rows(logits, [pen] * 5, counts)  # rows 0, 3, 4 are penalised with no counts


def test_logprobs_of_greedy_and_sampled_rows():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    greedy = SamplingParams(logit_bias=((3, 3.0),))
    lp = logprobs_rows(logits, [greedy])
    torch.testing.assert_close(lp, torch.tensor([[2.0, 1.0, 0.0, 2.0]]).log_softmax(-1))  # no temperature
    sampled = SamplingParams(temperature=0.5, top_k=2)
    lp = logprobs_rows(logits, [sampled])
    expected = torch.tensor([[4.0, 2.0]]).log_softmax(-1)[0]
    assert lp[0, 0] == pytest.approx(float(expected[0])) and lp[0, 1] == pytest.approx(float(expected[1]))
    assert lp[0, 2] == -math.inf and lp[0, 3] == -math.inf
    chosen, ids, vals = top_logprobs(lp, torch.tensor([1]), 3)
    assert chosen.tolist() == pytest.approx([float(expected[1])])
    assert ids[0, :2].tolist() == [0, 1] and vals[0, 2] == -math.inf


def test_validate_names_each_new_field():
    SamplingParams(presence_penalty=2, frequency_penalty=-2, repetition_penalty=2, min_p=1,
                   logit_bias=((0, 100.0), (5, -100.0))).validate(vocab_size=6)
    for params, field in [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(frequency_penalty=math.nan), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=2.5), "repetition_penalty"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(logit_bias=((6, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((2, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((2, 1.0), (2, 2.0))), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=field):
            params.validate(vocab_size=6)
