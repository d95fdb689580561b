"""Traffic meant to hurt, through a real coordinator and its real HTTP server (uvicorn, raw sockets where
the point is what the server does before it has read a body): a body over max_body_bytes gets 413 from its
Content-Length after a few of its bytes, and a chunked one is cut at the limit; a request without the token
gets 401 before its body is read; /metrics asks for the token on both ports unless metrics_public; a prompt
that takes seconds to tokenise and a grammar that takes too long to compile are refused naming their
field while a running stream keeps producing; a grammar is compiled once for a request of n choices."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import openai
import pytest

from coordinator.api.http_server import HttpServer
from coordinator.api.openai_api import create_app
from coordinator.constraint import ConstraintError, GrammarCompiler, GrammarLimits
from specdec.models import load_tokenizer
from specdec.proto import generate_pb2
from specdec.serving.metrics import MetricsServer
from tests.helpers import Cluster

pytestmark = pytest.mark.servers  # in-process servers (make test, not make test-fast)

TOKEN = "bad-traffic-token"
LIMIT = 8 * 2**20  # the fixture's max_body_bytes
HUGE = 256 * 2**20  # what the hostile requests announce
# A schema whose compile takes far longer than the fixture's compile_timeout_s (measured ~0.1 s for 400
# properties on this 2-core host; 1400 here, under MAX_GRAMMAR_CHARS): the refusal comes at the timeout, naming the field.
HOSTILE_SCHEMA = {"type": "object", "required": [f"k{i}" for i in range(1400)],
                  "properties": {f"k{i}": {"type": "string", "pattern": f"(a|b)*a(a|b){{{i % 25}}}"} for i in range(1400)}}


@pytest.fixture(scope="module")
def cluster(tiny_target):
    c = Cluster(tiny_target, tiny_target, coordinator_overrides={
        "auth_token": TOKEN, "max_body_bytes": LIMIT, "grammar": GrammarLimits(compile_timeout_s=0.05)})
    yield c
    c.close()


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120) as client:
        yield client


def raw_post(url: str, headers: dict[str, str], first_bytes: bytes) -> tuple[int, dict, int]:
    """POST /v1/completions with these headers, sending only first_bytes of the body, then read the answer:
    (status, JSON body, bytes of body sent). The server answers without waiting for the rest."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json", **headers}.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + first_bytes)
        return read_response(s) + (len(first_bytes),)


def read_response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), json.loads(body[:length])


def test_a_body_over_the_limit_gets_413_from_its_content_length(cluster):
    status, body, sent = raw_post(cluster.http_url, {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(HUGE)},
                                  b'{"model": "x", "prompt": "' + b"a" * 1024)
    assert status == 413 and sent < HUGE
    assert body["error"]["code"] == "request_too_large" and f"max_body_bytes={LIMIT}" in body["error"]["message"]
    assert httpx.get(cluster.http_url + "/health", timeout=10).status_code == 200


def test_an_unauthenticated_request_gets_401_before_its_body_is_read(cluster):
    status, body, sent = raw_post(cluster.http_url, {"Content-Length": str(HUGE)}, b'{"model": "x", "prompt": "' + b"a" * 1024)
    assert status == 401 and sent < HUGE
    assert body["error"]["type"] == "authentication_error" and body["error"]["message"].startswith("missing credentials")
    status, body, _ = raw_post(cluster.http_url, {"Authorization": "Bearer wrong", "Content-Length": str(HUGE)}, b"{")
    assert status == 401 and body["error"]["message"] == "invalid bearer token"


def test_a_chunked_body_is_cut_at_the_limit(cluster):
    host, port = cluster.http_url.removeprefix("http://").split(":")
    chunk = b"a" * 2**16
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        while not select.select([s], [], [], 0)[0]:  # until the server answers
            assert sent < 16 * LIMIT, "the server read on past the limit"
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, body = read_response(s)
    assert status == 413 and sent > LIMIT  # cut once the bytes read passed the limit, not before
    assert httpx.get(cluster.http_url + "/health", timeout=10).status_code == 200


def test_metrics_ask_for_the_token_on_every_port_unless_public(cluster):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for url in (cluster.http_url + "/metrics", cluster.metrics_url):
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        r = httpx.get(url, headers=auth, timeout=10)
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text
    assert httpx.get(cluster.http_url + "/health", timeout=10).status_code == 200  # probes need no token
    c = cluster.coordinator  # the same coordinator with metrics_public: both ports open
    public = HttpServer(create_app(c.frontend, TOKEN, metrics_public=True), "127.0.0.1:0")
    cluster._call(public.start())
    metrics = MetricsServer(c.registry, "127.0.0.1:0", token=None)
    try:
        assert httpx.get(public.url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(metrics.url, timeout=10).status_code == 200
        assert httpx.get(public.url + "/v1/models", timeout=10).status_code == 401  # the API is still closed
    finally:
        metrics.close()
        cluster._call(public.stop())


def test_a_running_stream_keeps_producing_while_hostile_requests_are_refused(cluster, oai):
    model = cluster.coordinator.frontend.model_name
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        for _ in oai.completions.create(model=model, prompt="Once", max_tokens=900, stream=True,
                                        extra_body={"ignore_eos": True, "num_speculative_tokens": 0}):
            arrivals.append(time.monotonic())
            if len(arrivals) == 5:
                started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    assert started.wait(120)
    # A prompt that takes the tokenizer seconds (~1M tokens), then is too long; a schema over the compile time.
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as long_prompt:
        oai.completions.create(model=model, prompt="The quick brown fox jumps over the lazy dog 12345. " * 60000, max_tokens=4)
    t1 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as schema:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": HOSTILE_SCHEMA}})
    runner.join(300)
    assert long_prompt.value.body["param"] == "prompt" and "max_prompt_tokens" in long_prompt.value.body["message"]
    assert schema.value.body["param"] == "response_format.json_schema"
    assert "longer than 0.05s to compile" in schema.value.body["message"]
    during = [t for t in arrivals if t0 < t < t1]
    # The stream went on while the prompt was tokenised (off the event loop): a stalled loop sends nothing.
    assert len(during) >= 2, f"{len(during)} chunks in the {t1 - t0:.2f}s the long prompt took"
    assert httpx.get(cluster.http_url + "/health", timeout=10).status_code == 200


def test_a_grammar_is_compiled_once_for_a_request_of_n_choices(cluster, oai):
    model = cluster.coordinator.frontend.model_name
    grammar = cluster.pipeline.grammar
    before = grammar.compiles
    schema = {"type": "object", "properties": {"once": {"type": "integer"}}, "required": ["once"]}
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, n=3,
                                    temperature=1.0, response_format={"type": "json_schema",
                                                                      "json_schema": {"name": "once", "schema": schema}})
    assert len(r.choices) == 3 and all(c.message.content.startswith('{"once": ') for c in r.choices)
    assert grammar.compiles == before + 1


def test_llguidance_limits_are_set_and_name_the_field(tiny_target):
    tok = load_tokenizer(tiny_target)
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(initial_lexer_fuel=10_000))
    try:
        with pytest.raises(ConstraintError, match=r"^response_format.json_schema: .*too big"):
            compiler.compile(generate_pb2.ResponseFormat(json_schema=json.dumps(HOSTILE_SCHEMA)))
        assert compiler.compile(generate_pb2.ResponseFormat(regex="[0-9]+")).session().forced(4) == []
    finally:
        compiler.close()
