"""Hypothesis strategies for the fuzz tests (tests/fuzz_cases.py): requests drawn valid or not, about
half of the examples clean (every part valid), the rest with broken parts mixed in."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from specdec.proto import common_pb2
from specdec.serving import draft_probs
from tests.fuzz_cases import INT32_MAX, INT32_MIN, MAX_CONTEXT, UINT64_MAX, VOCAB, prefix_hash



def weighted(*pairs):
    """sampled_from with integer weights: weighted(('a', 3), ('b', 1))."""
    return st.sampled_from([name for name, w in pairs for _ in range(w)])


def pick(data, clean: bool, label: str, valid: tuple, invalid: tuple = ()):
    """One of the weighted `valid` choices; in a dirty example (clean=False) the `invalid` ones too.
    About half the examples are clean, so valid requests (and their results) get as much fuzzing as
    broken ones."""
    return data.draw(weighted(*valid) if clean else weighted(*valid, *invalid), label=label)


valid_id = st.integers(0, VOCAB - 1)
bad_id = st.one_of(st.sampled_from([-1, VOCAB, VOCAB + 1, INT32_MIN, INT32_MAX]),
                   st.integers(INT32_MIN, -1), st.integers(VOCAB, INT32_MAX))
LEGAL_T = [0.0, -0.0, 1e-45, 1e-38, 1e-6, 9.9e-6, 1e-5, 1.1e-5, 1e-4, 0.3, 1.0, 2.0, 50.0, 1e4, 1e30, 3e38]
LEGAL_TOP_K = [0, 0, 1, 1, 2, 5, 40, 64, 100, VOCAB - 1, VOCAB, 10**6, INT32_MAX]
LEGAL_TOP_P = [0.0, -0.0, 1e-30, 0.05, 0.5, 0.9, 0.999, 1.0]  # (0 on the tiers' wire means unset)
valid_temperatures = st.one_of(st.sampled_from(LEGAL_T), st.floats(0.05, 3.0))
valid_top_ks = st.sampled_from(LEGAL_TOP_K)
valid_top_ps = st.one_of(st.sampled_from(LEGAL_TOP_P), st.floats(0.01, 1.0))
temperatures = st.one_of(valid_temperatures, st.sampled_from([-1e-6, -1.0, math.nan, math.inf, -math.inf]))
top_ks = st.one_of(valid_top_ks, st.sampled_from([-1, INT32_MIN]))
top_ps = st.one_of(valid_top_ps, st.sampled_from([1.0000001, 1.5, -0.5, math.nan, math.inf]))
seeds = st.one_of(st.sampled_from([0, 1, UINT64_MAX, 2**63, 2**63 - 1]), st.integers(0, UINT64_MAX))


def draw_session_id(data, pool: list[str], clean: bool) -> str:
    kind = pick(data, clean, "sid kind", (("pool", 8), ("unicode", 2)), (("empty", 1), ("long", 1)))
    if kind == "pool":
        return data.draw(st.sampled_from(pool), label="sid")
    if kind == "empty":
        return ""
    if kind == "unicode":
        return "fz-" + data.draw(st.text(min_size=0, max_size=30), label="sid")
    n = data.draw(st.integers(100, 300), label="long sid length")
    return "fz-" + data.draw(st.sampled_from(["x", "\u00e4", "\u6f22", "\U0001f600"]), label="sid char") * n


def draw_context(data, sid: str, held: list[int] | None, extra: int, clean: bool,
                 mismatch: bool = True) -> common_pb2.SessionContext:
    """A SessionContext for a session whose tier holds `held` (None: unknown); extra is what the rpc
    adds beyond new_tokens (drafts or proposals), used to aim long contexts at the limit. mismatch:
    a clean request may name a prefix the tier does not hold.

    What is drawn never depends on `held` (server state, outside hypothesis's view): every value is
    drawn unconditionally and only then combined with it, so replays stay consistent."""
    # A prefix the tier does not hold is a well-formed request too (FAILED_PRECONDITION): clean.
    mismatches = (("wrong_hash", 1), ("beyond", 1))
    mode = pick(data, clean, "prefix mode", (("zero", 4), ("held", 6)) + (mismatches if mismatch else ()),
                (() if mismatch else mismatches) + (("random", 2),))
    frac = data.draw(st.integers(0, 2**16), label="prefix position")
    flip = data.draw(st.integers(1, UINT64_MAX), label="hash flip")
    excess = data.draw(st.integers(1, 40), label="prefix excess")
    wild_len = data.draw(st.one_of(st.sampled_from([-1, INT32_MIN, INT32_MAX, 1, MAX_CONTEXT, MAX_CONTEXT + 1]),
                                   st.integers(INT32_MIN, INT32_MAX)), label="wild prefix_len")
    wild_hash = data.draw(st.one_of(st.just(0), seeds), label="wild hash")
    if mode in ("held", "wrong_hash") and not held:
        mode = "zero"
    if mode == "zero":
        prefix_len, h = 0, wild_hash  # the hash is ignored
    elif mode in ("held", "wrong_hash"):
        prefix_len = 1 + frac % len(held)
        h = prefix_hash(held[:prefix_len]) ^ (flip if mode == "wrong_hash" else 0)
    elif mode == "beyond":
        base = held or []
        prefix_len = len(base) + excess
        h = prefix_hash(base + [0] * excess)
    else:
        prefix_len, h = wild_len, wild_hash
    kind = pick(data, clean, "new_tokens kind", (("short", 10), ("long", 1)), (("empty", 1), ("bad", 1), ("long", 1)))
    if kind == "short":
        new = data.draw(st.lists(valid_id, min_size=1, max_size=8), label="new_tokens")
    elif kind == "empty":
        new = []
    elif kind == "bad":
        new = data.draw(st.lists(valid_id, min_size=0, max_size=6), label="new_tokens")
        new.insert(data.draw(st.integers(0, 6), label="bad at"), data.draw(bad_id, label="bad id"))
    else:  # aimed at the context limit: prefix + new + extra lands around max_context
        base = prefix_len if 0 <= prefix_len <= MAX_CONTEXT else 0
        target_total = data.draw(st.integers(MAX_CONTEXT - 4, MAX_CONTEXT + 4), label="total")
        start = data.draw(st.integers(0, VOCAB - 1), label="long start")
        n = max(1, target_total - base - extra)
        new = [(start + 7919 * i) % VOCAB for i in range(n)]
    return common_pb2.SessionContext(session_id=sid, prefix_len=prefix_len, prefix_hash=h, new_tokens=new)


def draw_sampling(data, clean: bool) -> common_pb2.SamplingParams:
    kind = data.draw(weighted(("greedy", 4), ("sampled", 3), ("wild", 2)), label="sampling kind")
    if kind == "greedy":
        return common_pb2.SamplingParams(temperature=0.0)
    if kind == "sampled":
        return common_pb2.SamplingParams(temperature=data.draw(st.floats(0.2, 2.0), label="T"),
                                         top_k=data.draw(st.sampled_from([0, 0, 1, 5, 50]), label="top_k"),
                                         top_p=data.draw(st.sampled_from([0.0, 1.0, 0.9, 0.5]), label="top_p"))
    if clean:  # extreme but legal
        return common_pb2.SamplingParams(temperature=data.draw(valid_temperatures, label="T"),
                                         top_k=data.draw(valid_top_ks, label="top_k"), top_p=data.draw(valid_top_ps, label="top_p"))
    return common_pb2.SamplingParams(temperature=data.draw(temperatures, label="T"), top_k=data.draw(top_ks, label="top_k"),
                                     top_p=data.draw(top_ps, label="top_p"))


def draw_q_row(data, draft: int, include: bool) -> tuple[list[int], list[float]]:
    """A valid q row for draft token `draft` (containing it if `include`). The draws' shapes never
    depend on `draft`, which may come from server state."""
    others = data.draw(st.lists(valid_id, min_size=1, max_size=6, unique=True), label="q ids")
    pos = data.draw(st.integers(0, 6), label="d pos")
    weights = data.draw(st.lists(st.integers(0, 100), min_size=7, max_size=7), label="q weights")
    ids = [t for t in others if t != draft] or [(draft + 1) % VOCAB]
    if include:
        ids.insert(min(pos, len(ids)), draft)
    weights = [w + (ids[j] == draft and include) for j, w in enumerate(weights[: len(ids)])]  # included: q(d) > 0
    if sum(weights) == 0:
        weights[0] = 1
    total = sum(weights)
    return ids, [w / total for w in weights]


def draw_q(data, drafts: list[int], clean: bool) -> list[common_pb2.DraftDistribution]:
    kind = pick(data, clean, "q kind", (("none", 4), ("match", 4)), (("defect", 4), ("count", 1)))
    if kind == "none" or not drafts and kind != "count":
        return []
    if kind == "count":
        n = data.draw(st.integers(1, 20).filter(lambda n: n != len(drafts)), label="q rows")
        rows = [draw_q_row(data, data.draw(valid_id), True) for _ in range(n)]
    else:
        rows = [draw_q_row(data, d, data.draw(weighted((True, 3), (False, 1)), label="include d")) for d in drafts]
    if kind == "defect":
        i = data.draw(st.integers(0, len(rows) - 1), label="defect row")
        ids, probs = rows[i]
        defect = data.draw(st.sampled_from(["dup", "neg", "nan", "inf", "-inf", "sum_low", "sum_high", "sum_edge_ok",
                                            "sum_edge_bad", "id_oob", "empty", "len_mismatch", "all_zero"]), label="defect")
        if defect == "dup":  # the sum stays 1: only the duplicate is wrong
            ids, probs = ids + [ids[0]], probs + [0.0]
        elif defect == "neg":  # the sum stays 1 where the row has room: only the sign is wrong
            probs = list(probs)
            if len(probs) > 1:
                probs[1] += probs[0] + 0.25
                probs[0] = -0.25
            else:
                probs[0] = -1.0
        elif defect in ("nan", "inf", "-inf"):
            probs = list(probs)
            probs[data.draw(st.integers(0, 6)) % len(probs)] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[defect]
        elif defect == "sum_low":
            probs = [p * 0.9 for p in probs]
        elif defect == "sum_high":
            probs = [p * 1.1 for p in probs]
        elif defect == "sum_edge_ok":
            factor = 1 + data.draw(st.sampled_from([-5e-4, 5e-4]), label="sum off by")  # inside the tolerance: valid
            probs = [p * factor for p in probs]
        elif defect == "sum_edge_bad":
            factor = 1 + data.draw(st.sampled_from([-2e-3, 2e-3]), label="sum off by")  # outside it
            probs = [p * factor for p in probs]
        elif defect == "id_oob":
            ids = list(ids)
            ids[data.draw(st.integers(0, 6)) % len(ids)] = data.draw(bad_id)
        elif defect == "empty":
            ids, probs = [], []
        elif defect == "len_mismatch":
            probs = probs + [0.0] if data.draw(st.booleans()) else probs[:-1]
        elif defect == "all_zero":
            probs = [0.0] * len(probs)
        rows[i] = (ids, probs)
    return [draft_probs.row(ids, probs) for ids, probs in rows]
