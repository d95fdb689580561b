"""The output as the client sees it (coordinator.output), case by case with the tiny model's tokenizer: a text that
ends on an incomplete character is not lost (it is the tokenizer's decode of the tokens, U+FFFD at the end), a stop
token ends the output with finish reason stop, a stop string's cut is not undone by that last flush."""

from __future__ import annotations

import pytest

from coordinator.output import FinishReason, Output
from specdec.models import load_tokenizer

PROMPT = [1, 504, 3937, 282, 4193, 314, 30]
TOKENS = [36239, 44593, 6105, 24488, 5787, 23536, 11623]  # the tiny target's greedy answer; 24488 ends mid-character


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return load_tokenizer(tiny_target)


def streamed(tokenizer, rounds, max_new=64, eos=(), stop=(), stop_ids=()) -> tuple[Output, list[int], str]:
    """The rounds' tokens through an Output as the round loop feeds it: (the output, its tokens, its streamed text)."""
    out = Output(tokenizer, PROMPT, max_new, set(eos), stop, frozenset(stop_ids))
    tokens, text = [], []
    for r in rounds:
        chunk = out.take(r)
        tokens += chunk
        text.append(out.event(chunk).chunk.text)
        if out.finished:
            break
    tail = out.tail()
    return out, tokens, "".join(text) + (tail.chunk.text if tail is not None else "")


def test_the_tokens_decode_as_the_test_needs(tokenizer):
    assert tokenizer.decode(TOKENS[:4]).endswith("\ufffd") and not tokenizer.decode(TOKENS[:3]).endswith("\ufffd")


@pytest.mark.parametrize("rounds", [[TOKENS], [TOKENS[:2], TOKENS[2:]], [[t] for t in TOKENS]], ids=["one", "two", "each"])
def test_an_end_on_an_incomplete_character_keeps_the_text(tokenizer, rounds):
    for kw, reason in ((dict(max_new=4), FinishReason.FINISH_REASON_LENGTH),
                       (dict(stop_ids={TOKENS[3]}), FinishReason.FINISH_REASON_STOP),
                       (dict(eos={TOKENS[3]}), FinishReason.FINISH_REASON_EOS)):
        out, tokens, text = streamed(tokenizer, rounds, **kw)
        assert out.finish == reason and tokens == TOKENS[:4]
        assert text == out.text == tokenizer.decode(TOKENS[:4], skip_special_tokens=True), kw


def test_a_stop_token_that_is_also_eos_is_a_stop(tokenizer):
    out, tokens, _ = streamed(tokenizer, [TOKENS], eos={TOKENS[2]}, stop_ids={TOKENS[2]})
    assert out.finish == FinishReason.FINISH_REASON_STOP and tokens == TOKENS[:3]


def test_a_stop_strings_cut_stays_cut(tokenizer):
    whole = tokenizer.decode(TOKENS[:4], skip_special_tokens=True)
    stop = whole[len(tokenizer.decode(TOKENS[:1])) + 1 : len(tokenizer.decode(TOKENS[:1])) + 3]
    out, tokens, text = streamed(tokenizer, [TOKENS], max_new=4, stop=[stop])
    assert out.finish == FinishReason.FINISH_REASON_STOP and text == out.text == whole[: whole.index(stop)]


def test_a_stop_string_kept_with_include(tokenizer):
    """include_stop_str_in_output: the text ends after the stop string, at the same token."""
    whole = tokenizer.decode(TOKENS[:3], skip_special_tokens=True)
    stop = whole[3:6]
    cut, tokens_cut, text_cut = streamed(tokenizer, [TOKENS], stop=[stop])
    kept = Output(tokenizer, PROMPT, 64, set(), [stop], include_stop=True)
    chunk = kept.take(TOKENS)
    assert chunk == tokens_cut and kept.finish == cut.finish == FinishReason.FINISH_REASON_STOP
    assert text_cut == whole[:3] and kept.text == whole[:6]


def test_no_stop_string_before_min_tokens(tokenizer):
    """vLLM's min_tokens: a stop string the first tokens complete is not looked for; one after them is."""
    whole = tokenizer.decode(TOKENS, skip_special_tokens=True)
    early = whole[3:6]  # inside the first tokens' text
    out = Output(tokenizer, PROMPT, 64, set(), [early], min_tokens=len(TOKENS))
    assert out.take(TOKENS) == TOKENS and not out.finished and out.text == whole
    cut = Output(tokenizer, PROMPT, 64, set(), [early], min_tokens=1)
    assert cut.take(TOKENS) != TOKENS and cut.finish == FinishReason.FINISH_REASON_STOP
