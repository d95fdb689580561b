"""Property-based robustness tests: generated requests thrown at the real gRPC servers. This module
holds what the tests share: the limits, the documented rules a request is judged by (Verdict), the
local references and the final health check; tests/fuzz_strategies.py draws the requests, and
tests/test_fuzz_verify.py, test_fuzz_propose.py and test_fuzz_generate.py are the tests, one a service.

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
(tests/test_bad_input_extremes.py covers oversized messages). Hypothesis runs derandomized (the same examples
every run) and without an example database.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck
from hypothesis.configuration import set_hypothesis_home_dir

from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2_grpc
from tests.helpers import reference_greedy

VOCAB = 49152
MAX_CONTEXT = 1024
MAX_K = 16  # tiers' max_draft_tokens and the coordinator's largest K
MAX_NEW_CAP = 4096  # CoordinatorConfig.max_new_tokens_cap default
MAX_PROMPT = 8192  # CoordinatorConfig.max_prompt_tokens default
MAX_STOP_STRINGS = 16  # coordinator limits, as tests/test_bad_input_generate.py pins them
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

def q_row(row) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A DraftDistribution's ids and probs as the wire packs them: little-endian int32, float32 (common.proto)."""
    n = len(row.token_ids) // 4
    return struct.unpack(f"<{n}i", row.token_ids[: 4 * n]), struct.unpack(f"<{n}f", row.probs[: 4 * n])


def check_q_rows(v: Verdict, rows, k: int) -> None:
    if not rows:
        return
    if len(rows) != k:
        v.refuse.append(f"{len(rows)} q rows for {k} drafts")
    for i, row in enumerate(rows):
        if not row.token_ids or len(row.token_ids) != len(row.probs) or len(row.token_ids) % 4:
            v.refuse.append(f"q[{i}] empty, misaligned or torn")
            continue
        ids, probs = q_row(row)
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
