"""Fuzzing the coordinator's Generate: generated requests (prompts as ids, text or chat, every option),
judged by the documented rules, the streamed results checked against the tiny target run locally (the
method: tests/fuzz_cases.py)."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specdec.proto import generate_pb2
from tests.fuzz_cases import (EOS, FUZZ_SETTINGS, GREEDY_T, INT32_MAX, INT32_MIN, MAX_CONTEXT, MAX_K, MAX_NEW_CAP,
                              MAX_PROMPT, MAX_STOP_LEN, MAX_STOP_STRINGS, OK, RPC_TIMEOUT, SCALE, VOCAB, Verdict,
                              assert_healthy_and_clean, check_ids, describe, greedy_chain)
from tests.fuzz_strategies import (bad_id, pick, seeds, temperatures, top_ks, top_ps, valid_id, valid_temperatures,
                                   valid_top_ks, valid_top_ps)
from tests.helpers import reference_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)

def draw_generate(data, tokenizer) -> tuple[generate_pb2.GenerateRequest, Verdict, list[int] | None]:
    """A request, what the rules say about it, and its prompt ids (None when there is none)."""
    clean = data.draw(st.booleans(), label="clean")
    req = generate_pb2.GenerateRequest()
    v = Verdict()
    prompt_ids: list[int] | None = None
    form = pick(data, clean, "prompt form", (("token_ids", 5), ("text", 3), ("chat", 2)), (("none", 1),))
    if form == "none":
        v.refuse.append("no prompt")
    elif form == "token_ids":
        kind = pick(data, clean, "ids kind", (("short", 8), ("near_context", 1)), (("empty", 1), ("bad", 2), ("huge", 1)))
        if kind == "short":
            ids = data.draw(st.lists(valid_id, min_size=1, max_size=12), label="prompt ids")
        elif kind == "empty":
            ids = []
        elif kind == "bad":
            ids = data.draw(st.lists(valid_id, min_size=0, max_size=6), label="prompt ids")
            ids.insert(data.draw(st.integers(0, 6), label="bad at"), data.draw(bad_id, label="bad id"))
        else:
            n = data.draw(st.integers(MAX_CONTEXT - 6, MAX_CONTEXT - 2 if clean else MAX_CONTEXT + 2) if kind == "near_context"
                          else st.sampled_from([MAX_CONTEXT, MAX_PROMPT, MAX_PROMPT + 1, 20000]), label="prompt length")
            start = data.draw(valid_id, label="start")
            ids = [(start + 104729 * i) % VOCAB for i in range(n)]
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(ids)
        if not ids:
            v.refuse.append("empty token_ids")
        check_ids(v, ids, "prompt token_ids")
        prompt_ids = ids
    elif form == "text":
        kind = pick(data, clean, "text kind", (("text", 8),), (("empty", 1), ("long", 1)))
        if kind == "text":
            text = data.draw(st.text(min_size=1, max_size=40), label="text")
        elif kind == "empty":
            text = ""
        else:
            text = "word " * data.draw(st.sampled_from([1030, 9000]), label="words")
        req.text = text
        if not text:
            v.refuse.append("empty text")
            prompt_ids = []
        else:
            prompt_ids = list(tokenizer(text)["input_ids"])
            if not prompt_ids:
                v.refuse.append("text tokenizes to nothing")
    else:
        n = data.draw(st.integers(1, 3) if clean else st.integers(0, 3), label="messages")
        req.chat.SetInParent()
        roles = []
        for _ in range(n):
            role = data.draw(st.sampled_from(["user", "user", "assistant", "system"] + ([] if clean else ["", "robot", "User"])),
                             label="role")
            req.chat.messages.add(role=role, content=data.draw(st.text(max_size=30), label="content"))
            roles.append(role)
        if not n:
            v.refuse.append("no chat messages")
        elif any(r not in ("system", "user", "assistant") for r in roles):
            v.refuse.append(f"chat roles {roles}")
        else:
            ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.chat.messages],
                                                add_generation_prompt=True, tokenize=True)
            prompt_ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    if prompt_ids and (len(prompt_ids) > MAX_PROMPT or len(prompt_ids) >= MAX_CONTEXT):
        v.refuse.append(f"prompt of {len(prompt_ids)} tokens")

    # Valid budgets stay small (<= 8) to keep the run fast; unset means the server default (128).
    max_new = pick(data, clean, "max_new kind", (("valid", 14), ("unset", 1)), (("invalid", 4),))
    if max_new == "valid":
        req.max_new_tokens = data.draw(st.integers(1, 8), label="max_new_tokens")
    elif max_new == "invalid":
        req.max_new_tokens = data.draw(st.sampled_from([0, -1, INT32_MIN, MAX_NEW_CAP + 1, INT32_MAX]), label="max_new_tokens")
        v.refuse.append(f"max_new_tokens {req.max_new_tokens}")
    if data.draw(st.booleans(), label="set temperature"):
        req.temperature = data.draw(valid_temperatures if clean else temperatures, label="temperature")
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            v.refuse.append(f"temperature {req.temperature}")
    if data.draw(st.booleans(), label="set top_k"):
        req.top_k = data.draw(valid_top_ks if clean else top_ks, label="top_k")
        if req.top_k < 0:
            v.refuse.append(f"top_k {req.top_k}")
    if data.draw(st.booleans(), label="set top_p"):  # (here 0 is a value, and out of (0, 1])
        req.top_p = data.draw(valid_top_ps.filter(lambda p: p > 0) if clean else top_ps, label="top_p")
        if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
            v.refuse.append(f"top_p {req.top_p}")
    if data.draw(st.booleans(), label="set seed"):
        req.seed = data.draw(seeds, label="seed")
    k = data.draw(st.one_of(st.none(), st.integers(0, MAX_K)) if clean else
                  st.one_of(st.none(), st.integers(0, MAX_K), st.sampled_from([-1, MAX_K + 1, INT32_MAX, INT32_MIN])), label="K")
    if k is not None:
        req.num_speculative_tokens = k
        if not 0 <= k <= MAX_K:
            v.refuse.append(f"num_speculative_tokens {k}")
    req.proposer = data.draw(st.sampled_from([0, 1, 2, 3] if clean else [0, 1, 2, 3, 4, 7, -1, INT32_MAX]), label="proposer")
    if req.proposer not in (0, 1, 2, 3):
        v.refuse.append(f"proposer {req.proposer}")
    some_stops = st.lists(st.one_of(st.text(min_size=1, max_size=4),
                                    st.sampled_from([" ", "\n", "e", ".", "\u00e9", "\U0001f600", "the", "x" * MAX_STOP_LEN])),
                          max_size=3)
    stops = data.draw(some_stops if clean else st.one_of(
        some_stops,
        st.lists(st.sampled_from(["", "y" * (MAX_STOP_LEN + 1), "ok"]), min_size=1, max_size=3),
        st.integers(MAX_STOP_STRINGS - 1, MAX_STOP_STRINGS + 2).map(lambda n: [f"zq{i}" for i in range(n)]),
    ), label="stop")
    req.stop.extend(stops)
    if len(stops) > MAX_STOP_STRINGS:
        v.refuse.append(f"{len(stops)} stop strings")
    if any(not s for s in stops):
        v.refuse.append("empty stop string")
    if any(len(s) > MAX_STOP_LEN for s in stops):
        v.refuse.append("stop string too long")
    req.ignore_eos = data.draw(st.booleans(), label="ignore_eos")
    return req, v, prompt_ids


def test_fuzz_generate(cluster, generation_stub, tokenizer, tiny_target_model):
    counts: dict[str, int] = {}

    @settings(max_examples=int(130 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        req, v, prompt_ids = draw_generate(data, tokenizer)
        events, code, details = [], OK, ""
        try:
            for event in generation_stub.Generate(req, timeout=RPC_TIMEOUT):
                events.append(event)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        counts[code.name] = counts.get(code.name, 0) + 1
        allowed = v.allowed()
        assert code in allowed, (f"Generate answered {code.name} ({details!r}) after {len(events)} event(s); allowed "
                                 f"{sorted(c.name for c in allowed)}; refuse={v.refuse} maybe={v.maybe}\nrequest: {describe(req)}")
        if code != OK:
            assert events == [], f"{len(events)} event(s) streamed before {code.name}"
            return
        results = [i for i, e in enumerate(events) if e.HasField("result")]
        assert results == [len(events) - 1], f"the stream must end with exactly one result, got results at {results}"
        chunks = [e.chunk for e in events[:-1]]
        assert all(e.HasField("chunk") for e in events[:-1])
        ids = [t for c in chunks for t in c.token_ids]
        text = "".join(c.text for c in chunks)
        result = events[-1].result
        max_new = req.max_new_tokens if req.HasField("max_new_tokens") else 128
        assert result.stats.generated_tokens == len(ids), f"generated_tokens {result.stats.generated_tokens} != {len(ids)} streamed"
        assert 1 <= len(ids) <= max_new, f"{len(ids)} tokens for max_new_tokens={max_new}"
        assert all(0 <= t < VOCAB for t in ids)
        assert result.stats.prompt_tokens == len(prompt_ids), f"prompt_tokens {result.stats.prompt_tokens} != {len(prompt_ids)}"
        reason = result.finish_reason
        fr = generate_pb2.FinishReason
        assert reason != fr.FINISH_REASON_UNSPECIFIED
        if reason == fr.FINISH_REASON_LENGTH:
            assert len(ids) == max_new
        elif reason == fr.FINISH_REASON_EOS:
            assert not req.ignore_eos and ids[-1] == EOS
        elif reason == fr.FINISH_REASON_STOP:
            assert req.stop
        elif reason == fr.FINISH_REASON_CONTEXT:
            assert len(prompt_ids) + len(ids) >= MAX_CONTEXT
        if not req.ignore_eos:
            assert EOS not in ids[:-1], "generation went on past EOS"
        for s in req.stop:
            assert s not in text, f"stop string {s!r} is in the returned text {text!r}"
        if reason != fr.FINISH_REASON_STOP:  # the text is the tokens' text (where decoding is unambiguous)
            before = tokenizer.decode(prompt_ids, skip_special_tokens=True)
            mine = tokenizer.decode(ids, skip_special_tokens=True)
            whole = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
            if "\ufffd" not in before + mine and whole == before + mine:
                assert text == mine, f"streamed text {text!r} != the generated tokens' text {mine!r}"
                counts["text checked"] = counts.get("text checked", 0) + 1
        # Deterministic outputs: greedy, or top_k = 1 (p is one-hot: lossless sampling must give greedy).
        t = req.temperature if req.HasField("temperature") else 0.0
        if t < GREEDY_T or (req.top_k == 1 and t <= 1e4):
            counts["tokens checked"] = counts.get("tokens checked", 0) + 1
            room = min(max_new, MAX_CONTEXT - len(prompt_ids))  # (a generation ends at the context limit)
            ref = (greedy_chain(tiny_target_model, prompt_ids, room) if req.ignore_eos
                   else reference_greedy(tiny_target_model, prompt_ids, room, [EOS]))
            if reason in (fr.FINISH_REASON_LENGTH, fr.FINISH_REASON_EOS):
                assert ids == ref, f"deterministic output {ids} != target's greedy {ref} (T={t}, top_k={req.top_k})"
            else:
                assert ids == ref[: len(ids)], f"deterministic output {ids} is not a prefix of target's greedy {ref}"

    try:
        run()
    finally:
        print(f"\nGenerate outcomes: {counts}")
    assert_healthy_and_clean(cluster, tiny_target_model, {})
