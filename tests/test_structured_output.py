"""Structured output (coordinator.constraint, VerifyRequest.token_masks), through real servers.

Greedy: constrained speculative output equals the target's own constrained greedy output (transformers'
generate with a logits processor driven by the same grammar engine, llguidance), for every proposer and
K, batched with unconstrained sessions, and it parses. Sampling: the engine's verification with masks
keeps the constrained target's law (chi-square against the exact law). Bad input: a schema or grammar
that cannot compile, a grammar that allows no token, bad masks on the target's wire: INVALID_ARGUMENT /
400 naming the field, before any token, and the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import llguidance
import llguidance.hf
import openai
import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessor, LogitsProcessorList

from coordinator.constraint import grammar_text
from specdec.client import Client
from specdec.engine.verify import CANDIDATES, VerifyWork, _verify_sampled, _verify_trees
from specdec.math.params import SamplingParams
from specdec.models import TokenizerSource, load_tokenizer
from specdec.proto import common_pb2, generate_pb2, target_pb2, target_pb2_grpc
from specdec.serving import token_masks
from tests.test_batching import prompt

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc", "d"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"(yes|no|maybe), [a-z]{2,6}[.!]"
N = 40


class GrammarLogits(LogitsProcessor):
    """The reference: transformers' generate with the grammar's mask on the logits at every position."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, eos: int, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos),
                                            grammar, log_level=0)
        self.vocab_size, self.seen = vocab_size, prompt_len

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.seen:].tolist()
        self.seen += len(new)
        assert not new or self.matcher.consume_tokens(new)
        allowed = token_masks.decode([self.matcher.compute_bitmask()], 1, self.vocab_size)[0].to(scores.device)
        return scores.masked_fill(~allowed, float("-inf"))


def constrained_reference(model, tokenizer, grammar: str, ids: list[int], eos: list[int]) -> list[int]:
    processor = GrammarLogits(grammar, tokenizer, model.config.vocab_size, eos[0], len(ids))
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=2,
                             logits_processor=LogitsProcessorList([processor]))
    new = out[0, len(ids):].tolist()
    return new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]


@pytest.fixture(scope="module")
def cluster(random_draft_cluster):
    return random_draft_cluster


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return load_tokenizer(tiny_target)


def formats():
    """(kind, text, the grammar the reference follows: the coordinator's, from the same function)."""
    return [(kind, text, grammar_text(generate_pb2.ResponseFormat(**{kind: text})))
            for kind, text in (("json_schema", json.dumps(SCHEMA)), ("regex", REGEX))]


@pytest.mark.parametrize("proposer,k,nodes", [("draft", 2, None), ("draft", 5, None), ("hybrid", None, None),
                                              ("suffix", 4, None), ("prompt_lookup", 3, None), ("draft", 0, None),
                                              ("suffix", 4, 10), ("prompt_lookup", 3, 8), ("hybrid", None, 10)])
def test_constrained_greedy_equals_the_constrained_target(cluster, tiny_target_model, tokenizer, proposer, k, nodes):
    """For every proposer and K, and with token trees (nodes: the model-free sources' trees, a mask per node)."""
    eos = list(cluster.pipeline.target_info.eos_token_ids)
    jobs = []
    for i, (kind, text, grammar) in enumerate(formats()):
        ids = prompt(900 + i, 12)
        jobs.append((dict(response_format={kind: text}), ids,
                     constrained_reference(tiny_target_model, tokenizer, grammar, ids, eos)))
    jobs.append((dict(), prompt(950, 10), None))  # an unconstrained session in the same batches

    def one(job):
        extra, ids, _ = job
        with Client(cluster.address) as c:
            return c.generate(token_ids=ids, max_new_tokens=N, proposer=proposer, num_speculative_tokens=k,
                              num_speculative_nodes=nodes, **extra)

    trees = []  # (nodes, masks sent) of every tree the target verified
    to_work = cluster.target_servicer.to_work

    def recording(request):
        if request.draft_parents:
            trees.append((len(request.draft_tokens), len(request.token_masks)))
        return to_work(request)

    cluster.target_servicer.to_work = recording
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(one, jobs))
    finally:
        cluster.target_servicer.to_work = to_work
    assert all(m in (0, n + 1) for n, m in trees), trees  # a constrained tree: a mask for the root and each node
    if nodes and proposer != "prompt_lookup":  # (lookup finds few repeated n-grams in 40 tokens of these outputs)
        assert any(m for _, m in trees), trees  # constrained trees were verified
    for (extra, ids, want), out in zip(jobs, outs):
        if want is None:
            continue
        assert out.token_ids == want, (extra, out.token_ids, want)
        text = tokenizer.decode([t for t in out.token_ids if t not in eos])
        if "json_schema" in extra["response_format"]:  # bounded by the schema and the fixed layout: it ends
            assert out.finish_reason == "eos", (out.finish_reason, text)
            doc = json.loads(text)
            assert set(doc) == {"name", "age", "tags"} and 0 <= doc["age"] <= 150 and text == json.dumps(doc)
        if "regex" in extra["response_format"]:  # a language of short strings: it always ends, at EOS
            assert out.finish_reason == "eos" and re.fullmatch(REGEX, text), (out.finish_reason, text)


def test_forced_tokens_cost_no_forward(cluster, tokenizer):
    """A regex with one possible output: every token is forced, so the whole output comes with no round."""
    with Client(cluster.address) as c:
        out = c.generate(token_ids=prompt(960, 8), max_new_tokens=N, response_format={"regex": "hello world"})
    text = tokenizer.decode([t for t in out.token_ids if t not in cluster.pipeline.target_info.eos_token_ids])
    assert (text, out.finish_reason) == ("hello world", "eos")
    assert out.stats["rounds"] == 0


BAD = [({"json_schema": "{not json"}, "response_format.json_schema"),
       ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
        "response_format.json_schema"),
       ({"regex": "(unclosed"}, "response_format.regex"),
       ({"lark": "start: nothing_defined"}, "response_format.lark")]


@pytest.mark.parametrize("fmt,field", BAD)
def test_a_format_that_cannot_compile_is_refused_before_any_token(cluster, fmt, field):
    with Client(cluster.address) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=prompt(970, 8), max_new_tokens=4, response_format=fmt)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field), e.value.details()
        assert len(c.generate(token_ids=prompt(971, 8), max_new_tokens=4).token_ids) == 4  # still healthy


def _verify(cluster, requests):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await asyncio.gather(*(stub.Verify(r) for r in requests), return_exceptions=True)
    return asyncio.run(run())


def _end(cluster, *session_ids: str) -> None:
    """End the sessions a test's raw Verify calls opened on the target (the cluster is shared)."""
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            for sid in session_ids:
                await stub.EndSession(common_pb2.EndSessionRequest(session_id=sid))
    asyncio.run(run())


def _mask(allowed: list[int], vocab: int) -> bytes:
    bits = 0
    for t in allowed:
        bits |= 1 << t
    return bits.to_bytes((vocab + 31) // 32 * 4, "little")


def test_the_target_applies_masks_and_refuses_bad_ones_alone(cluster):
    vocab = cluster.pipeline.target_info.vocab_size

    def req(sid, masks, drafts=(5, 6)):
        return target_pb2.VerifyRequest(context=common_pb2.SessionContext(session_id=sid, new_tokens=prompt(980, 8)),
                                        draft_tokens=list(drafts), sampling=common_pb2.SamplingParams(),
                                        token_masks=masks)

    forced = [_mask([5], vocab), _mask([6], vocab), _mask([321], vocab)]  # the grammar allows d_1, d_2, then 321
    good, short, empty, wide = _verify(cluster, [
        req("m-good", forced), req("m-short", forced[:2]),
        req("m-empty", [forced[0], bytes((vocab + 31) // 32 * 4), forced[2]]),
        req("m-wide", [forced[0] + b"\1\0\0\0", forced[1], forced[2]])])
    assert (good.num_accepted, good.next_token) == (2, 321)
    _end(cluster, "m-good")
    for error, message in ((short, "token_masks has 2 masks but 3 positions"), (empty, "token_masks[1] allows no token"),
                           (wide, f"token_masks[0] allows token {vocab}, outside the vocabulary")):
        assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(message), error.details()


def test_the_target_applies_a_mask_per_tree_node(cluster):
    """A tree's masks: the root's, then one per node (the grammar after the node's path). Greedy walks the
    masked argmax: the root allows only node 0's token, node 0 only node 2's, node 2 only 321."""
    vocab = cluster.pipeline.target_info.vocab_size
    masks = [_mask([5], vocab), _mask([6], vocab), _mask([9], vocab), _mask([321], vocab)]

    def req(sid, masks):
        return target_pb2.VerifyRequest(context=common_pb2.SessionContext(session_id=sid, new_tokens=prompt(985, 8)),
                                        draft_tokens=[5, 7, 6], draft_parents=[-1, -1, 0],
                                        sampling=common_pb2.SamplingParams(), token_masks=masks)

    good, short = _verify(cluster, [req("t-good", masks), req("t-short", masks[:3])])
    assert (good.num_accepted, list(good.accepted_path), good.next_token) == (2, [0, 2], 321)
    _end(cluster, "t-good")
    assert isinstance(short, grpc.aio.AioRpcError) and short.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert short.details().startswith("token_masks has 3 masks but 4 positions"), short.details()


def test_sampled_tree_verification_with_masks_keeps_the_constrained_law():
    """Deterministic candidates (no q) at the root, two of three refused by the mask, V = 6: the first committed
    token follows p restricted to the mask and renormalised."""
    vocab = 6
    p = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    allowed = torch.tensor([True, True, False, True, False, True])
    n, counts = 30_000, torch.zeros(vocab)
    rows = p.log()[None].expand(4, -1).masked_fill(~allowed, float("-inf"))  # the root's row and each node's
    works = [VerifyWork.create("s", 0, 0, [1], [2, 0, 4], None, SamplingParams(temperature=1.0), seed=trial,
                               parents=[-1, -1, -1], scheme=CANDIDATES, allowed=allowed[None].expand(4, -1))
             for trial in range(n)]
    for w, (path, nxt) in zip(works, _verify_trees(works, [rows] * n, vocab)):
        counts[w.drafts[path[0]] if path else nxt] += 1
    want = torch.where(allowed, p, torch.zeros(())) / p[allowed].sum()
    assert int(counts[~allowed].sum()) == 0
    kept = allowed.nonzero()[:, 0]
    expected = (want[kept] * n).double().numpy()
    assert chisquare(counts[kept].double().numpy(), expected / expected.sum() * n).pvalue > 1e-3


def test_sampled_verification_with_masks_keeps_the_constrained_law():
    """One position, V = 6: p restricted to the mask and renormalised is the law of the committed first token,
    whatever q proposed (including drafts the mask refuses)."""
    vocab = 6
    p = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    q = torch.tensor([0.05, 0.05, 0.4, 0.1, 0.3, 0.1])  # puts mass where the grammar refuses
    allowed = torch.tensor([True, True, False, True, False, True])
    from specdec.engine.draft_probs import DraftProbs

    n, counts = 40_000, torch.zeros(vocab)
    logits = p.log()
    for trial in range(n):
        d = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(trial)))
        w = VerifyWork.create("s", 0, 0, [1], [d], DraftProbs.from_rows([(torch.arange(vocab), q)]),
                              SamplingParams(temperature=1.0), seed=trial, allowed=allowed[None].expand(2, -1))
        rows = logits[None].expand(2, -1).masked_fill(~w.allowed, float("-inf"))
        n_acc, nxt = _verify_sampled([w], [rows], vocab)
        counts[d if int(n_acc[0]) else int(nxt[0])] += 1
    want = torch.where(allowed, p, torch.zeros(())) / p[allowed].sum()
    assert int(counts[~allowed].sum()) == 0
    kept = allowed.nonzero()[:, 0]
    expected = (want[kept] * n).double().numpy()
    assert chisquare(counts[kept].double().numpy(), expected / expected.sum() * n).pvalue > 1e-3


def test_the_openai_client_gets_schema_valid_json(oai, model, tokenizer):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Ada, 36, tags a and d."}],
                                    max_tokens=80, response_format=fmt, extra_body={"proposer": "draft"})
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert reason in ("stop", "length") and len(ids) > 0
    if reason == "stop":
        doc = json.loads(text)
        assert set(doc) == {"name", "age", "tags"}
    obj = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                      response_format={"type": "json_object"})
    assert obj.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("fmt,param", [({"type": "xml"}, "response_format.type"),
                                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}},
                                        "response_format.json_schema")])
def test_the_openai_api_refuses_a_bad_response_format_with_400(oai, model, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    response_format=fmt)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "sampled"])
def test_the_drafts_q_is_masked_by_the_grammar(tiny_target, tokenizer, params):
    """A Propose with the grammar proposes only tokens it allows after the session's output, and q has no
    mass outside them, greedy or sampled (specdec.engine.grammar)."""
    from specdec.engine.config import TierConfig
    from specdec.engine.engine import Engine
    from specdec.engine.propose import ProposeWork
    from specdec.models import ModelConfig, load_model
    from tests.helpers import device_model

    grammar = grammar_text(generate_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA)))
    engine = Engine(TierConfig(ModelConfig("tiny")), load_model(device_model(tiny_target)), TokenizerSource.of(tokenizer))
    engine.start()
    ids = prompt(990, 8)
    output = tokenizer.encode('{"name": "Ada", "age": ', add_special_tokens=False)  # digits must follow
    try:
        work = ProposeWork.create("g", 0, 0, ids + output, 8, params, seed=5, top_n=32, prompt_len=len(ids), grammar=grammar)
        result = asyncio.run(_submit(engine, work))
    finally:
        engine.close()
    check = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=engine.vocab_size,
                                                              eos_token=engine.eos_token_ids[0]), grammar)
    assert check.consume_tokens(output)
    for j, d in enumerate(result.tokens):
        allowed = token_masks.decode([check.compute_bitmask()], 1, engine.vocab_size)[0]
        assert allowed[d], (j, d)
        if result.q is not None:
            q_ids, q_probs = result.q.row(j)
            assert bool(allowed[q_ids].all()) and abs(float(q_probs.sum()) - 1) < 1e-5
        if check.is_stopped():
            break
        assert check.consume_token(d)


async def _submit(engine, work):
    return await engine.submit(work)
