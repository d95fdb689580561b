"""Property-based robustness tests: generated requests thrown at the real gRPC servers.

Every rpc is sent through a raw stub to the `random_draft_cluster` (vocab 49152, max context 1024,
max_draft_tokens 16). Whatever the request, a server must

  * never crash: no UNKNOWN, no INTERNAL, always an answer;
  * refuse what the protos call invalid (INVALID_ARGUMENT), and a prefix it does not hold
    (FAILED_PRECONDITION), never answering OK to either;
  * accept what the protos call valid, and then return a result that is valid too: counts, ranges,
    cache lengths, and the tokens themselves where they are determined (greedy, top_k = 1), which
    are checked against the same tiny models run locally.

Each tier test keeps a shadow of what the tier caches for a small pool of session ids, so prefix
reuse, rollback (crop) and fingerprint checks are fuzzed too, not only fresh sessions. After each
test the servers must answer the standard health check, still generate the exact greedy output, and
hold no session once the ones the test created are ended.

Requests stay far below the 8 MiB message limit, so RESOURCE_EXHAUSTED is never a right answer here
(tests/test_bad_input.py covers oversized messages). Hypothesis runs derandomized (the same examples
every run) and without an example database.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from transformers import AutoTokenizer

from specdec.models import load_model
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.serving import draft_probs
from tests.helpers import device_model, reference_greedy

pytestmark = pytest.mark.slow

VOCAB = 49152
MAX_CONTEXT = 1024
MAX_K = 16  # tiers' max_draft_tokens and the coordinator's largest K
MAX_NEW_CAP = 4096  # CoordinatorConfig.max_new_tokens_cap default
MAX_PROMPT = 8192  # CoordinatorConfig.max_prompt_tokens default
MAX_STOP_STRINGS = 16  # coordinator limits, as tests/test_bad_input.py pins them
MAX_STOP_LEN = 256
DRAFT_TOP_N = 64  # DraftConfig.draft_top_n default (the Cluster's)
EOS = 2
GREEDY_T = 1e-5  # temperatures below this are greedy (common.proto)
Q_TOL = 1e-3  # q rows sum to 1 within this (common.proto)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
RPC_TIMEOUT = 60
PROMPT = [1, 2000, 3000]

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

# Hypothesis's own caches go to a temporary directory, not into the working tree (.hypothesis/).
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "specdec-hypothesis"))

# CI runs a fixed set of examples. For a longer hunt: SPECDEC_FUZZ_SCALE=10 (ten times the examples)
# and SPECDEC_FUZZ_RANDOM=1 (fresh random examples each run instead of the fixed ones).
SCALE = float(os.environ.get("SPECDEC_FUZZ_SCALE", "1"))
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=os.environ.get("SPECDEC_FUZZ_RANDOM", "") in ("", "0"),
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)


# --- fixtures -------------------------------------------------------------------------------------






@pytest.fixture(scope="module")
def draft_model(tiny_random_draft):
    return load_model(device_model(tiny_random_draft))  # on the draft tier's device, as its reference


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


# --- helpers --------------------------------------------------------------------------------------


def prefix_hash(tokens) -> int:
    return PrefixHashes(tokens).at(len(tokens))


def call_unary(method, request):
    """(code, response or None, details)."""
    try:
        return OK, method(request, timeout=RPC_TIMEOUT), ""
    except grpc.RpcError as e:
        return e.code(), None, e.details() or ""


def end_session(stub, session_id: str) -> bool:
    return stub.EndSession(common_pb2.EndSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT).existed


@torch.inference_mode()
def model_logits(model, tokens: list[int], keep: int) -> torch.Tensor:
    """Logits [keep, V] (float32) at the last `keep` positions of one full forward over tokens."""
    out = model(input_ids=torch.tensor([tokens], device=model.device), use_cache=False, logits_to_keep=keep)
    return out.logits[0].float()


@torch.inference_mode()
def greedy_chain(model, tokens: list[int], n: int) -> list[int]:
    """n greedy tokens after `tokens`, never stopping at EOS (generate() would, from the model's
    generation config, even with eos_token_id=None)."""
    out = model(input_ids=torch.tensor([tokens], device=model.device), use_cache=True, logits_to_keep=1)
    chain = []
    for _ in range(n):
        chain.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([chain[-1:]], device=model.device), past_key_values=out.past_key_values,
                    use_cache=True)
    return chain


def near_max(row: torch.Tensor, tok: int, tol: float = 1e-3) -> bool:
    """tok is the argmax of row, up to float noise between a cached and an uncached forward."""
    return float(row[tok]) >= float(row.max()) - tol


def in_top_k(row: torch.Tensor, tok: int, k: int, tol: float = 1e-3) -> bool:
    """tok survives a top-k filter over row (raw logits: a positive temperature keeps their order)."""
    if not 0 < k < row.shape[-1]:
        return True
    kth = float(torch.topk(row, k).values[-1])
    return float(row[tok]) >= kth - tol


@dataclass
class Verdict:
    """What the documented rules say about a request."""

    refuse: list[str] = field(default_factory=list)  # definitely invalid: must not be OK
    maybe: list[str] = field(default_factory=list)  # undocumented limits: OK or INVALID_ARGUMENT
    precondition: str = ""  # well-formed but the tier does not hold the prefix

    def allowed(self) -> set[grpc.StatusCode]:
        if self.refuse:
            return {INVALID} | ({PRECONDITION} if self.precondition else set())
        if self.maybe:
            return {INVALID} | ({PRECONDITION} if self.precondition else {OK})
        return {PRECONDITION} if self.precondition else {OK}


def check_session_id(v: Verdict, sid: str) -> None:
    if not sid:
        v.refuse.append("empty session_id")
    elif len(sid.encode()) > 128:
        v.maybe.append(f"long session_id ({len(sid)} chars)")


def check_ids(v: Verdict, ids, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < VOCAB]
    if bad:
        v.refuse.append(f"{name} out of vocabulary: {bad[:3]}")


def check_sampling(v: Verdict, s: common_pb2.SamplingParams) -> None:
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        v.refuse.append(f"temperature {s.temperature}")
    if s.top_k < 0:
        v.refuse.append(f"top_k {s.top_k}")
    if not (s.top_p == 0 or (math.isfinite(s.top_p) and 0 < s.top_p <= 1)):
        v.refuse.append(f"top_p {s.top_p}")


def check_prefix(v: Verdict, ctx: common_pb2.SessionContext, held: list[int] | None) -> None:
    """held: the tokens the tier caches for the session (None: no such session)."""
    if ctx.prefix_len < 0:
        v.refuse.append(f"prefix_len {ctx.prefix_len}")
    elif ctx.prefix_len > 0:
        if held is None:
            v.precondition = "session not cached"
        elif len(held) < ctx.prefix_len:
            v.precondition = f"session holds {len(held)} < prefix_len {ctx.prefix_len}"
        elif prefix_hash(held[: ctx.prefix_len]) != ctx.prefix_hash:
            v.precondition = "prefix fingerprint differs"


def describe(request) -> str:
    text = str(request)
    return text if len(text) < 3000 else text[:3000] + f"... ({len(text)} chars)"


# --- strategies -----------------------------------------------------------------------------------


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


def check_q_rows(v: Verdict, rows, k: int) -> None:
    if not rows:
        return
    if len(rows) != k:
        v.refuse.append(f"{len(rows)} q rows for {k} drafts")
    for i, row in enumerate(rows):
        if not row.token_ids or len(row.token_ids) != len(row.probs) or len(row.token_ids) % 4:
            v.refuse.append(f"q[{i}] empty, misaligned or torn")
            continue
        n = len(row.token_ids) // 4  # the wire: little-endian int32 ids, float32 probs (common.proto)
        ids, probs = struct.unpack(f"<{n}i", row.token_ids), struct.unpack(f"<{n}f", row.probs)
        check_ids(v, ids, f"q[{i}].token_ids")
        if len(set(ids)) != len(ids):
            v.refuse.append(f"q[{i}] duplicate ids")
        if not all(math.isfinite(p) and p >= 0 for p in probs):
            v.refuse.append(f"q[{i}] probs not finite / negative")
            continue
        err = abs(sum(probs) - 1.0)
        if err > Q_TOL * 1.1:
            v.refuse.append(f"q[{i}] sums to {sum(probs)}")
        elif err > Q_TOL * 0.9:
            v.maybe.append(f"q[{i}] sums to {sum(probs)} (at the tolerance)")


def check_context_len(v: Verdict, ctx: common_pb2.SessionContext, extra: int) -> None:
    """A session may not grow past max_context (common.proto ModelInfo.max_context); extra is what
    the rpc feeds beyond new_tokens (Verify: the K drafts; Propose: its K - 1 proposals but the last).
    One token either side of the limit is left to the server."""
    if ctx.prefix_len < 0:
        return
    total = ctx.prefix_len + len(ctx.new_tokens) + extra
    if total > MAX_CONTEXT + 1:
        v.refuse.append(f"context {total} > {MAX_CONTEXT}")
    elif total >= MAX_CONTEXT:
        v.maybe.append(f"context {total} at the limit")


# --- the cluster is healthy and clean after a fuzz run --------------------------------------------


def assert_healthy_and_clean(cluster, tiny_target_model, tracked: dict[str, set[str]]) -> None:
    for port in (cluster.port, cluster.target_port, cluster.draft_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, f"port {port}: {resp.status}"
    with grpc.insecure_channel(cluster.address) as ch:
        req = generate_pb2.GenerateRequest(max_new_tokens=8, num_speculative_tokens=3, proposer=generate_pb2.PROPOSER_DRAFT_MODEL)
        req.token_ids.ids.extend(PROMPT)
        events = list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=RPC_TIMEOUT))
    ids = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    assert events[-1].HasField("result")
    assert ids == reference_greedy(tiny_target_model, PROMPT, 8, [EOS]), "greedy output changed after fuzzing"
    for tier, port, stub_cls in (("target", cluster.target_port, target_pb2_grpc.TargetServiceStub),
                                 ("draft", cluster.draft_port, draft_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = stub_cls(ch)
            for sid in tracked.get(tier, ()):
                end_session(stub, sid)
    cluster.wait_no_sessions(5.0)


def forget(shadow: dict, stub, sid: str) -> None:
    """The tier's state for sid is unknown (it failed): drop it on both sides."""
    shadow.pop(sid, None)
    if sid:
        try:
            end_session(stub, sid)
        except grpc.RpcError:
            pass


# --- 1. target Verify -----------------------------------------------------------------------------



def expect_propose(sid, ctx, k, request, held):
    """What the documented rules say a Propose must answer, and the committed sequence it implies."""
    v = Verdict()
    check_session_id(v, sid)
    check_prefix(v, ctx, held)
    if not ctx.new_tokens:
        v.refuse.append("empty new_tokens")
    check_ids(v, ctx.new_tokens, "new_tokens")
    if not 1 <= k <= MAX_K:
        v.refuse.append(f"num_tokens {k}")
    check_sampling(v, request.sampling)
    if 1 <= k <= MAX_K:
        check_context_len(v, ctx, k - 1)
    return v, (held or [])[: max(ctx.prefix_len, 0)] + list(ctx.new_tokens)

def test_fuzz_verify(cluster, target_stub, tiny_target_model):
    pool = [f"fuzz-verify-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    shadow: dict[str, list[int]] = {}  # session id -> tokens the target caches
    tracked: set[str] = set()
    counts: dict[str, int] = {}

    @settings(max_examples=int(160 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        clean = data.draw(st.booleans(), label="clean")
        sid = draw_session_id(data, pool, clean)
        held = shadow.get(sid)
        n_drafts = pick(data, clean, "drafts kind", (("none", 2), ("some", 6)), (("many", 1),))
        k = {"none": 0, "some": data.draw(st.integers(1, MAX_K)), "many": data.draw(st.integers(MAX_K + 1, 20))}[n_drafts]
        ctx = draw_context(data, sid, held, extra=k, clean=clean)
        drafts_kind = pick(data, clean, "drafts", (("random", 2), ("oracle", 4)), (("bad", 1),))
        drafts = data.draw(st.lists(valid_id, min_size=k, max_size=k), label="drafts")
        corrupt = data.draw(st.booleans(), label="corrupt oracle")
        corrupt_at = data.draw(st.integers(0, MAX_K), label="corrupt at")
        bump = data.draw(st.integers(1, 100), label="corrupt by")
        bad_at, bad = data.draw(st.integers(0, 20), label="bad draft at"), data.draw(bad_id, label="bad draft")
        committed = (held or [])[: max(ctx.prefix_len, 0)] + list(ctx.new_tokens)
        if drafts_kind == "oracle" and k and 0 < len(committed) < MAX_CONTEXT - k and all(0 <= t < VOCAB for t in committed) \
                and (ctx.prefix_len == 0 or (held is not None and ctx.prefix_len <= len(held))):
            drafts = greedy_chain(tiny_target_model, committed, k)  # the target's own choices: accepted
            if corrupt:
                j = corrupt_at % k
                drafts[j] = (drafts[j] + bump) % VOCAB
        if drafts_kind == "bad" and drafts:
            drafts[bad_at % len(drafts)] = bad
        q = draw_q(data, drafts, clean)
        request = target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, q=q, sampling=draw_sampling(data, clean),
                                           seed=data.draw(seeds, label="seed"))
        s = request.sampling

        v = Verdict()
        check_session_id(v, sid)
        check_prefix(v, ctx, held)
        if not ctx.new_tokens:
            v.refuse.append("empty new_tokens")
        check_ids(v, ctx.new_tokens, "new_tokens")
        if k > MAX_K:
            v.refuse.append(f"{k} drafts > {MAX_K}")
        check_ids(v, drafts, "draft_tokens")
        check_q_rows(v, q, k)
        check_sampling(v, s)
        check_context_len(v, ctx, k)

        if sid:
            tracked.add(sid)
        code, resp, details = call_unary(target_stub.Verify, request)
        counts[code.name] = counts.get(code.name, 0) + 1
        # Record what the target now caches before judging, so that the shadow stays exact.
        if code == OK and 0 <= resp.num_accepted <= k:
            shadow[sid] = committed + drafts[: resp.num_accepted]
        elif code == OK:
            forget(shadow, target_stub, sid)
        elif code not in (INVALID, PRECONDITION):
            forget(shadow, target_stub, sid)
        assert code in v.allowed(), (
            f"Verify answered {code.name} ({details!r}); allowed {sorted(c.name for c in v.allowed())}; "
            f"refuse={v.refuse} maybe={v.maybe} precondition={v.precondition!r}\nrequest: {describe(request)}")
        if code != OK:
            return
        n = resp.num_accepted
        counts["reused prefix"] = counts.get("reused prefix", 0) + (ctx.prefix_len > 0)
        counts["accepted > 0"] = counts.get("accepted > 0", 0) + (n > 0)
        assert 0 <= n <= k, f"num_accepted {n} outside [0, {k}]"
        assert 0 <= resp.next_token < VOCAB, f"next_token {resp.next_token}"
        assert resp.cached_len == ctx.prefix_len + len(ctx.new_tokens) + n, (
            f"cached_len {resp.cached_len} != {ctx.prefix_len} + {len(ctx.new_tokens)} + {n}")

        # The tokens themselves, against the target run locally over the same sequence.
        logits = model_logits(tiny_target_model, committed + drafts, k + 1)  # positions of d_1..d_K and the bonus
        greedy = s.temperature < GREEDY_T
        one_hot_p = greedy or (s.top_k == 1 and s.temperature <= 1e4)  # (a huge T can tie the scaled logits)
        q_d = [dict(zip(r.token_ids, r.probs)).get(d, 0.0) for r, d in zip(q, drafts)] if q else [1.0] * k
        for i in range(n):
            assert q_d[i] > 0, f"draft {i} accepted although q_{i}(d_{i}) = 0"
            if one_hot_p:
                assert near_max(logits[i], drafts[i]), f"draft {i} ({drafts[i]}) accepted but is not the target's argmax"
            elif s.temperature <= 1e4:
                assert in_top_k(logits[i], drafts[i], s.top_k), f"draft {i} accepted outside top_k"
        if one_hot_p:
            assert near_max(logits[n], resp.next_token), (
                f"next_token {resp.next_token} is not the target's argmax {int(logits[n].argmax())} at position {n}")
            if greedy and not q and n < k:
                top = torch.topk(logits[n], 2)
                assert drafts[n] != int(top.indices[0]) or float(top.values[0] - top.values[1]) < 1e-3, (
                    f"greedy draft {n} ({drafts[n]}) is the target's argmax but was rejected")
        elif s.temperature <= 1e4:
            assert in_top_k(logits[n], resp.next_token, s.top_k), "next_token outside top_k"

        # Draws depend on the seed and the sequence, not on the tier's state: the same round on a fresh
        # session (the whole sequence resent, as after an eviction) has the same outcome.
        if ctx.prefix_len > 0:
            fresh = f"fuzz-replay-{uuid.uuid4().hex[:8]}"
            tracked.add(fresh)
            again = target_stub.Verify(target_pb2.VerifyRequest(
                context=common_pb2.SessionContext(session_id=fresh, new_tokens=committed), draft_tokens=drafts, q=q,
                sampling=s, seed=request.seed), timeout=RPC_TIMEOUT)
            end_session(target_stub, fresh)
            assert (again.num_accepted, again.next_token) == (n, resp.next_token), (
                f"resent from scratch, the round gives {(again.num_accepted, again.next_token)}, "
                f"not {(n, resp.next_token)} as on the cached prefix")
        if sid not in pool:  # keep the store small: only the pool's sessions persist across examples
            assert end_session(target_stub, sid) is True, "EndSession after an OK Verify must find the session"
            shadow.pop(sid, None)

    try:
        run()
    finally:
        print(f"\nVerify outcomes: {counts}")
    assert_healthy_and_clean(cluster, tiny_target_model, {"target": tracked | set(pool)})


# --- 2. draft Propose -----------------------------------------------------------------------------


def check_proposal(resp: draft_pb2.ProposeResponse, request: draft_pb2.ProposeRequest, committed: list[int], draft_model) -> None:
    k, s, ctx = request.num_tokens, request.sampling, request.context
    assert len(resp.tokens) == k, f"{len(resp.tokens)} tokens for num_tokens={k}"
    assert all(0 <= t < VOCAB for t in resp.tokens), f"token out of range: {list(resp.tokens)}"
    greedy = s.temperature < GREEDY_T
    if greedy:
        assert len(resp.q) == 0, f"greedy proposal carries {len(resp.q)} q rows"
    else:
        assert len(resp.q) == k, f"sampled proposal carries {len(resp.q)} q rows for {k} tokens"
    for i, row in enumerate(resp.q):
        assert row.token_ids and len(row.token_ids) == len(row.probs) and not len(row.probs) % 4, f"q[{i}] empty, misaligned or torn"
        n = len(row.token_ids) // 4  # the wire: little-endian int32 ids, float32 probs (common.proto)
        ids, probs = struct.unpack(f"<{n}i", row.token_ids), struct.unpack(f"<{n}f", row.probs)
        assert len(set(ids)) == len(ids), f"q[{i}] has duplicate ids"
        assert all(0 <= t < VOCAB for t in ids), f"q[{i}] id out of range"
        assert all(math.isfinite(p) and p >= 0 for p in probs), f"q[{i}] has bad probs"
        assert abs(sum(probs) - 1.0) <= Q_TOL, f"q[{i}] sums to {sum(probs)}"
        assert len(ids) <= DRAFT_TOP_N, f"q[{i}] has {len(ids)} > draft_top_n entries"
        if 0 < s.top_k and len(ids) > s.top_k:  # only logits tied at the k-th keep more (transformers' top-k does too)
            assert sorted(probs, reverse=True)[s.top_k - 1] == min(probs), f"q[{i}] has {len(ids)} entries with top_k={s.top_k}"
        assert dict(zip(ids, probs)).get(resp.tokens[i], 0.0) > 0, f"token {i} was drawn outside its own q row"
    assert resp.cached_len == ctx.prefix_len + len(ctx.new_tokens) + k - 1, (
        f"cached_len {resp.cached_len} != {ctx.prefix_len} + {len(ctx.new_tokens)} + {k} - 1")
    if greedy or (s.top_k == 1 and s.temperature <= 1e4):
        tokens = list(resp.tokens)
        logits = model_logits(draft_model, committed + tokens[:-1], k)
        for i in range(k):
            assert near_max(logits[i], tokens[i]), (
                f"greedy proposal {i} is {tokens[i]}, the draft's argmax is {int(logits[i].argmax())}")


def test_fuzz_propose(cluster, draft_stub, draft_model, tiny_target_model):
    pool = [f"fuzz-propose-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    shadow: dict[str, list[int]] = {}
    tracked: set[str] = set()
    counts: dict[str, int] = {}

    @settings(max_examples=int(160 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        clean = data.draw(st.booleans(), label="clean")
        sid = draw_session_id(data, pool, clean)
        held = shadow.get(sid)
        k = data.draw(st.one_of(st.integers(1, MAX_K), st.integers(1, 4)) if clean else
                      st.one_of(st.integers(1, MAX_K), st.sampled_from([0, -1, MAX_K + 1, INT32_MAX, INT32_MIN])), label="num_tokens")
        ctx = draw_context(data, sid, held, extra=max(0, min(k, MAX_K) - 1), clean=clean)
        request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=draw_sampling(data, clean),
                                           seed=data.draw(seeds, label="seed"))
        v, committed = expect_propose(sid, ctx, k, request, held)

        if sid:
            tracked.add(sid)
        code, resp, details = call_unary(draft_stub.Propose, request)
        counts[code.name] = counts.get(code.name, 0) + 1
        if code == OK:
            if len(resp.tokens) == k:
                shadow[sid] = committed + list(resp.tokens[:-1])
            else:
                forget(shadow, draft_stub, sid)
        elif code not in (INVALID, PRECONDITION):
            forget(shadow, draft_stub, sid)
        assert code in v.allowed(), (
            f"Propose answered {code.name} ({details!r}); allowed {sorted(c.name for c in v.allowed())}; "
            f"refuse={v.refuse} maybe={v.maybe} precondition={v.precondition!r}\nrequest: {describe(request)}")
        if code != OK:
            return
        counts["reused prefix"] = counts.get("reused prefix", 0) + (ctx.prefix_len > 0)
        check_proposal(resp, request, committed, draft_model)
        if ctx.prefix_len > 0:  # the same proposal from scratch: draws are keyed by position, not state
            fresh = f"fuzz-replay-{uuid.uuid4().hex[:8]}"
            tracked.add(fresh)
            again = draft_stub.Propose(draft_pb2.ProposeRequest(
                context=common_pb2.SessionContext(session_id=fresh, new_tokens=committed), num_tokens=k,
                sampling=request.sampling, seed=request.seed), timeout=RPC_TIMEOUT)
            end_session(draft_stub, fresh)
            assert list(again.tokens) == list(resp.tokens), (
                f"resent from scratch, the proposal is {list(again.tokens)}, not {list(resp.tokens)} as on the cached prefix")
        if sid not in pool:
            assert end_session(draft_stub, sid) is True, "EndSession after an OK Propose must find the session"
            shadow.pop(sid, None)

    try:
        run()
    finally:
        print(f"\nPropose outcomes: {counts}")
    assert_healthy_and_clean(cluster, tiny_target_model, {"draft": tracked | set(pool)})


def test_fuzz_propose_stream(cluster, draft_stub, draft_model, tiny_target_model):
    """A stream of generated requests: one response per request, in order, until the first refused
    one, whose status ends the stream; sessions the stream touched are dropped when it ends."""
    counts: dict[str, int] = {}

    @settings(max_examples=int(50 * SCALE), **FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        pool = [f"fuzz-stream-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
        shadow: dict[str, list[int]] = {}
        plans = []  # (request, verdict, committed)
        n = data.draw(st.integers(1, 5), label="stream length")
        dirty_at = data.draw(st.integers(0, 6), label="dirty request")  # >= n: every request is clean
        # Requests are decided up front, assuming each earlier one succeeds as the shadow predicts.
        for i in range(n):
            clean = i != dirty_at
            sid = data.draw(st.sampled_from(pool), label="sid") if clean or data.draw(st.integers(0, 3)) else ""
            held = shadow.get(sid)
            k = data.draw(st.integers(1, 6) if clean else st.one_of(st.integers(1, 6), st.sampled_from([0, MAX_K + 1])),
                          label="num_tokens")
            ctx = draw_context(data, sid, held, extra=max(0, min(k, MAX_K) - 1), clean=clean, mismatch=False)
            request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=draw_sampling(data, clean), seed=data.draw(seeds))
            v, committed = expect_propose(sid, ctx, k, request, held)
            plans.append((request, v, committed))
            if v.allowed() != {OK}:
                break  # the stream ends at the first request that may fail
            # The tier will also cache this request's proposals but one; later requests are only
            # aimed at the committed part, which it certainly holds.
            shadow[sid] = committed
        responses = []
        code, details = OK, ""
        try:
            for r in draft_stub.ProposeStream(iter([p[0] for p in plans]), timeout=RPC_TIMEOUT):
                responses.append(r)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        counts[code.name] = counts.get(code.name, 0) + 1
        last_request, last_verdict, _ = plans[-1]
        n_ok = len(plans) if code == OK else len(plans) - 1
        assert len(responses) == n_ok, f"{len(responses)} responses for {len(plans)} requests ending {code.name} ({details!r})"
        allowed = last_verdict.allowed()
        assert code in allowed, (f"stream ended {code.name} ({details!r}) on its last request; allowed "
                                 f"{sorted(c.name for c in allowed)}; refuse={last_verdict.refuse} maybe={last_verdict.maybe} "
                                 f"precondition={last_verdict.precondition!r}\nrequest: {describe(last_request)}")
        for (request, _, committed), resp in zip(plans, responses):
            check_proposal(resp, request, committed, draft_model)

    try:
        run()
    finally:
        print(f"\nProposeStream outcomes: {counts}")
    # No EndSession here: the streams' ends must have dropped every session they touched.
    assert_healthy_and_clean(cluster, tiny_target_model, {})


# --- 3. coordinator Generate ----------------------------------------------------------------------


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
