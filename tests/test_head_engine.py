"""The draft tier serving an EAGLE-3 head (specdec.engine.head_engine) through a real gRPC server: its greedy chain is
the head's own (specdec.engine.eagle3.greedy_chain over the target's features), round after round with the rows
sent incrementally and after a full resend; q is exactly 0 outside a reduced draft vocabulary; bad requests get a
precise status and the replica stays healthy. The sampled law with the head as the draft: test_head_distribution."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

from draft_service.service import DraftConfig, build
from specdec.core.prefix import PrefixHashes
from specdec.engine.config import TierConfig
from specdec.engine.eagle3 import greedy_chain, load_head
from specdec.engine.eagle3_features import target_features, to_bytes
from specdec.engine.head_engine import HeadEngine
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from tests.helpers import TEST_DEVICE, child_env, device_model

pytestmark = pytest.mark.servers  # a draft service in this process on a real port (make test-fast leaves it out)

PROMPT = [1, 17, 256, 9, 4001, 33, 712, 88, 5, 61]
CALL_TIMEOUT_S = 60  # an engine that never answers fails the test instead of hanging it


@pytest.fixture(scope="module")
def head_server(tiny_head, tiny_target):
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = HeadEngine.load(TierConfig(device_model(tiny_head), cost_curve_s=0.5), tiny_target)
    async def start():
        tier = build(DraftConfig(engine.config), engine)
        await tier.server.start()
        return tier

    tier = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    with grpc.insecure_channel(f"127.0.0.1:{tier.port}") as channel:
        yield engine, draft_pb2_grpc.DraftServiceStub(channel)
    asyncio.run_coroutine_threadsafe(tier.server.stop(0), loop).result(30)
    engine.close()
    loop.call_soon_threadsafe(loop.stop)


def features_of(model, layers, tokens) -> torch.Tensor:
    """The target's rows for every position of `tokens` (one plain forward on its device), bfloat16 [T, 3 H] on the CPU,
    where the tests' reference heads compute (the served head, on the test device, gets them as bytes)."""
    with torch.inference_mode():
        rows, _ = target_features(model, torch.tensor([tokens], device=model.device), layers)
    return rows[0].cpu()


def propose(stub, sid, committed, prefix_len, k, rows_start, rows, **kw):
    hashes = PrefixHashes(committed)
    ctx = common_pb2.SessionContext(session_id=sid, prefix_len=prefix_len, prefix_hash=hashes.at(prefix_len),
                                    new_tokens=committed[prefix_len:])
    return stub.Propose(draft_pb2.ProposeRequest(context=ctx, num_tokens=k, features_start=rows_start,
                                                 features=to_bytes(rows) if rows is not None else b"", **kw),
                        timeout=CALL_TIMEOUT_S)


def test_model_info_names_the_layers(head_server, tiny_target_model):
    engine, stub = head_server
    info = stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    layers = tiny_target_model.config.num_hidden_layers
    assert list(info.feature_layers) == [0, layers - 1, layers - 1]
    assert info.feature_width == 3 * tiny_target_model.config.hidden_size
    assert info.vocab_size == tiny_target_model.config.vocab_size
    assert stub.GetStatus(common_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S).cost_curve  # measured at start


def test_the_head_runs_on_the_device_its_config_names(head_server):
    """Every weight, buffer and the target's shared embedding where the tier's config puts them: a checkpoint's tensors
    are read onto the CPU, and a head loaded for a GPU once kept them there (SPECDEC_TEST_DEVICE=cuda checks it)."""
    engine, _ = head_server
    head = engine.head
    want = torch.device(TEST_DEVICE).type
    assert engine.device.type == want
    tensors = [*head.parameters(), *head.buffers(), *head._shared[0].parameters()]
    assert {t.device.type for t in tensors} == {want}


def test_greedy_chains_are_the_heads_own_round_after_round(head_server, tiny_head, tiny_target_model):
    """Three rounds of one session (the rows sent as a coordinator sends them: those the replica lacks), then a full
    resend; each proposal equals greedy_chain over the whole prefix computed afresh."""
    engine, stub = head_server
    target = tiny_target_model
    head = load_head(tiny_head, target.config, target.get_input_embeddings())
    layers = engine.feature_layers
    committed, sent, prefix = list(PROMPT), 0, 0
    accepted = [2, 0, 3]
    for round_, n in enumerate(accepted):
        rows = features_of(target, layers, committed)[: len(committed) - 1]
        r = propose(stub, "g", committed, prefix, 3, sent, rows[sent:])
        want = greedy_chain(head, torch.tensor(committed), rows.float(), 3)
        assert list(r.tokens) == want, f"round {round_}"
        assert r.cached_len == len(committed) + 2 and not r.q
        prefix, sent = len(committed) + min(n, 2), len(committed) - 1
        committed = committed + list(r.tokens[:n]) + [(7 * round_ + 11) % 1000]  # n accepted, then a correction
    rows = features_of(target, layers, committed)[: len(committed) - 1]
    again = propose(stub, "g", committed, 0, 2, 0, rows)  # a full resend: every row again
    assert list(again.tokens) == greedy_chain(head, torch.tensor(committed), rows.float(), 2)


def test_a_reduced_vocabulary_has_q_zero_outside_it(tiny_target, tiny_target_model, tmp_path):
    """A head of 64 draft tokens: every sampled draft is one of them and every q row's mass is on them (summing to 1)."""
    import asyncio

    from specdec.engine.propose import ProposeWork
    from specdec.math.params import SamplingParams
    from tests.test_eagle3_head import small_head
    from specdec.engine.eagle3 import write_checkpoint

    head = small_head(tiny_target_model, vocab=64)
    write_checkpoint(head, tmp_path / "head")
    engine = HeadEngine.load(TierConfig(device_model(str(tmp_path / "head")), cost_curve_s=0), tiny_target)
    vocab = set(head.target_ids(torch.arange(64)).tolist())
    rows = features_of(tiny_target_model, engine.feature_layers, PROMPT)[:-1]

    async def one(seed):
        w = ProposeWork.create(f"s{seed}", 0, 0, PROMPT, 3, SamplingParams(temperature=1.0), seed, 64)
        w.features, w.features_start = rows, 0
        return await engine.submit(w)

    async def all_():
        return await asyncio.gather(*(one(s) for s in range(20)))

    try:
        results = asyncio.run(asyncio.wait_for(all_(), CALL_TIMEOUT_S))
    finally:
        engine.close()
    for r in results:
        assert set(r.tokens) <= vocab
        dense = r.q.dense(tiny_target_model.config.vocab_size, "cpu")
        torch.testing.assert_close(dense.sum(-1), torch.ones(3))
        outside = torch.ones(dense.shape[1], dtype=torch.bool)
        outside[list(vocab)] = False
        assert float(dense[:, outside].abs().sum()) == 0.0
    assert len({tuple(r.tokens) for r in results}) > 1  # sampled, keyed by seed


@pytest.mark.parametrize("fields, code, message", [
    (dict(tree_nodes=3, speculate=2), grpc.StatusCode.INVALID_ARGUMENT, "speculate: this replica serves an EAGLE-3 head"),
    (dict(grammar="start: \"a\""), grpc.StatusCode.INVALID_ARGUMENT, "grammar: this replica serves an EAGLE-3 head"),
    (dict(rows=slice(0, 3), cut=1), grpc.StatusCode.INVALID_ARGUMENT, "features: "),
    (dict(rows=slice(0, 4)), grpc.StatusCode.FAILED_PRECONDITION, "features: drafting after 10 tokens needs"),
    (dict(rows=slice(0, 9), start=-1), grpc.StatusCode.INVALID_ARGUMENT, "features_start: -1 is negative"),
    (dict(rows=slice(0, 9), start=2), grpc.StatusCode.INVALID_ARGUMENT, "features_start: a full send"),
])
def test_bad_requests_are_refused_and_the_replica_stays_healthy(head_server, tiny_target_model, fields, code, message):
    engine, stub = head_server
    rows = features_of(tiny_target_model, engine.feature_layers, PROMPT)
    fields = dict(fields)
    part, cut, start = fields.pop("rows", slice(0, 9)), fields.pop("cut", 0), fields.pop("start", 0)
    data = to_bytes(rows[part])
    request = draft_pb2.ProposeRequest(context=common_pb2.SessionContext(session_id="bad", new_tokens=PROMPT),
                                       num_tokens=2, features=data[: len(data) - cut], features_start=start, **fields)
    with pytest.raises(grpc.RpcError) as e:
        stub.Propose(request, timeout=CALL_TIMEOUT_S)
    assert e.value.code() == code and e.value.details().startswith(message), e.value.details()
    good = propose(stub, "after-bad", PROMPT, 0, 2, 0, rows[:9])  # the replica still serves
    assert len(good.tokens) == 2


def test_a_gap_in_the_rows_is_a_failed_precondition(head_server, tiny_target_model):
    """Rows that start past those the replica holds cannot be used: the caller is told to resend the session whole."""
    engine, stub = head_server
    committed = PROMPT + [5, 6, 7]
    rows = features_of(tiny_target_model, engine.feature_layers, committed)
    propose(stub, "gap", PROMPT, 0, 2, 0, rows[:9])
    with pytest.raises(grpc.RpcError) as e:
        propose(stub, "gap", committed, len(PROMPT), 2, 10, rows[10:12])  # row 9 never sent
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "features: rows start at position 10" in e.value.details()


@pytest.mark.processes
@pytest.mark.parametrize("edit, names", [
    (lambda c, s: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 7]),
     "eagle_aux_hidden_state_layer_ids [0, 1, 7]: layer 7 is past the target's depth"),
    (lambda c, s: c.update(hidden_size=96), "hidden_size 96 does not match the target's hidden_size 64"),
    (lambda c, s: (c.update(draft_vocab_size=64), s.update({"lm_head.weight": s["lm_head.weight"][:64]}),
                   s.pop("d2t", None)), "d2t"),
])
def test_a_bad_head_is_refused_at_start_naming_the_field(tiny_target, tiny_target_model, tmp_path, edit, names):
    """The draft service started as a user starts it, on a head that does not fit its target: exit 2, one line naming
    the field."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from specdec.engine.eagle3 import echo_head, write_checkpoint

    path = tmp_path / "head"
    write_checkpoint(echo_head(tiny_target_model), path)
    config, state = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    edit(config, state)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    run = subprocess.run([sys.executable, "-m", "draft_service", "--model", str(path), "--head-target", tiny_target,
                          "--address", "127.0.0.1:0"], capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: EAGLE-3 head checkpoint refused: ") and names in last, last


def head_logits(head, committed: list[int], rows: torch.Tensor, path: list[int]) -> torch.Tensor:
    """The head's logits (full vocabulary) after the committed tokens and then `path` drafted: catch-up over the rows,
    then each path token fed with the head's own output before it, as a chain drafts."""
    from specdec.engine.eagle3 import HeadCache

    cache = HeadCache()
    t = len(committed)
    out = head.step(torch.tensor(committed[1:]), head.fuse(rows.float()), torch.arange(t - 1), cache)[-1:]
    for j, token in enumerate(path):
        out = head.step(torch.tensor([token]), out, torch.tensor([t - 1 + j]), cache)
    full = torch.full((head.vocab_size,), float("-inf"))
    full[head.target_ids(torch.arange(head.draft_vocab_size))] = head.logits(out)[0].float()
    return full


@pytest.mark.parametrize("nodes, branching", [(6, 2), (8, 3)])
def test_greedy_trees_hold_the_heads_top_tokens_below_each_node(head_server, tiny_head, tiny_target_model, nodes, branching):
    """A dynamic greedy tree: every node's children are the head's top tokens after the node's path (a prefix of its
    top-b, the likeliest kept), the first child at each level is the greedy chain, and the tree has its node budget."""
    engine, stub = head_server
    target = tiny_target_model
    head = load_head(tiny_head, target.config, target.get_input_embeddings())
    rows = features_of(target, engine.feature_layers, PROMPT)[:-1]
    r = propose(stub, f"tree{nodes}", PROMPT, 0, 1, 0, rows, tree_nodes=nodes, tree_depth=4, tree_branching=branching)
    tokens, parents = list(r.tokens), list(r.parents)
    assert len(tokens) == nodes and len(parents) == nodes and r.cached_len == len(PROMPT)
    paths = {-1: []}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        paths[i] = paths[parent] + [token]
    for node, path in paths.items():
        children = [tokens[i] for i, p in enumerate(parents) if p == node]
        if children:
            top = torch.topk(head_logits(head, PROMPT, rows, path), branching).indices.tolist()
            assert children == top[: len(children)], f"below node {node}"
    spine, node = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        spine.append(tokens[child])
        node = child
    assert spine == greedy_chain(head, torch.tensor(PROMPT), rows.float(), len(spine))


@pytest.mark.parametrize("step", [{}, {"skinny_gemm": False, "head_rows": 4}, {"skinny_gemm": False, "head_rows": 0}],
                         ids=["default", "blocks-of-4-rows", "one-session-each"])
def test_a_sessions_proposal_does_not_depend_on_its_batch(tiny_target, tiny_target_model, tmp_path, step):
    """Seeded sampled proposals, alone and among seven other sessions in the same steps: bitwise the same tokens and q
    (the head's products run on the batch-invariant skinny GEMM where the CPU has it, on blocks of 64 rows on CUDA;
    here also on blocks of 4 rows off the skinny GEMM, so eight sessions take two blocks, one session one padded,
    and one session at a time)."""
    import asyncio

    from specdec.engine.config import StepConfig

    engine, one = small_head_engine(tiny_target, tiny_target_model, tmp_path, StepConfig(**step))
    assert engine.block_rows == step.get("head_rows", 64 if engine.device.type == "cuda" and not engine.skinny else 0)

    async def run():
        alone = await one("alone", PROMPT, 7)
        crowd = await asyncio.gather(*(one(f"c{i}", PROMPT[: 4 + i], i) for i in range(4)),
                                     one("crowded", PROMPT, 7), *(one(f"d{i}", PROMPT[: 5 + i], 10 + i) for i in range(3)))
        return alone, crowd[4]

    try:
        alone, crowded = asyncio.run(asyncio.wait_for(run(), CALL_TIMEOUT_S))
    finally:
        engine.close()
    assert crowded.batch_sessions > 1  # it did share its steps
    assert alone.tokens == crowded.tokens
    vocab = tiny_target_model.config.vocab_size
    assert torch.equal(alone.q.dense(vocab, "cpu"), crowded.q.dense(vocab, "cpu"))


def test_a_pass_wakes_the_event_loop_once(tiny_target, tiny_target_model, tmp_path):
    """Six sessions queued while the engine is paused share one pass, and their six answers are handed back together:
    one wake-up of the event loop, not one per session (as the model engine's step: test_round_trace)."""
    from specdec.engine.config import StepConfig
    from tests.test_round_trace import paused_batch

    engine, one = small_head_engine(tiny_target, tiny_target_model, tmp_path, StepConfig())
    results, wakeups = paused_batch(engine, [one(f"s{i}", PROMPT[: 4 + i], i) for i in range(6)])  # one pass
    assert [r.batch_sessions for r in results] == [6] * 6, "the six sessions shared their steps"
    assert all(len(r.tokens) == 4 for r in results)
    assert wakeups == 1, "the pass's six answers were handed back together"


def small_head_engine(tiny_target, tiny_target_model, tmp_path, step) -> tuple[HeadEngine, Callable]:
    """A small head (64-token draft vocabulary) for the tiny target, its engine started with `step`, and
    one(sid, prompt, seed): a sampled proposal of 4 drafts after `prompt`, fed the target's rows for it."""
    from specdec.engine.eagle3 import write_checkpoint
    from specdec.engine.propose import ProposeWork
    from specdec.math.params import SamplingParams
    from tests.test_eagle3_head import small_head

    write_checkpoint(small_head(tiny_target_model, vocab=64), tmp_path / "head")
    engine = HeadEngine.load(TierConfig(device_model(str(tmp_path / "head")), cost_curve_s=0, step=step), tiny_target)
    rows = features_of(tiny_target_model, engine.feature_layers, PROMPT)[:-1]

    async def one(sid, prompt, seed):
        w = ProposeWork.create(sid, 0, 0, prompt, 4, SamplingParams(temperature=0.8), seed, 64)
        w.features, w.features_start = rows[: len(prompt) - 1], 0
        return await engine.submit(w)

    return engine, one
