"""A small synchronous Python client for the coordinator's Generation API.

    from specdec.client import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)
        print(out.text, out.stats["tokens_per_s"])

    # TLS (the coordinator's CA) and the coordinator's bearer token, if it requires one:
    Client("coordinator.example:50051", tls_ca="ca.pem", token=os.environ["SPECDEC_TOKEN"])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.core.proposer_names import Proposer
from specdec.proto import generate_pb2, generate_pb2_grpc


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "context"
    stats: dict = field(default_factory=dict)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)  # per token, when asked for
    prompt_logprobs: generate_pb2.PromptLogprobs | None = None  # the prompt's scores, when asked for


def finish_reason_name(value: int) -> str:
    return generate_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    num_speculative_tokens: int | None = None,
    num_speculative_nodes: int | None = None,
    ignore_eos: bool = False,
    proposer: str | None = None,
    prompt_cache_key: str = "",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    response_format: dict | None = None,
    whole_result: bool = False,
    prompt_logprobs: bool = False,
    stop_token_ids: Sequence[int] = (),
    continue_final_message: bool = False,
    min_tokens: int | None = None,
) -> generate_pb2.GenerateRequest:
    """Exactly one of prompt / messages / token_ids; None leaves a field to the server's default.
    proposer: a name or alias of specdec.core.proposer_names (e.g. "suffix", "draft_model" or its alias "draft").
    prompt_cache_key: requests with the same key reach the same replicas (and their prefix caches).
    response_format: structured output, one of {"json_object": True}, {"json_schema": "<schema JSON>"},
    {"regex": "..."}, {"lark": "..."} (generate.proto's ResponseFormat). whole_result: nothing reads the tokens
    before the end, so rounds may commit more of them (generate.proto). prompt_logprobs: score the prompt first
    (with max_new_tokens 0, only that). stop_token_ids: tokens that end the output. continue_final_message: the
    answer continues the last message of `messages` (an assistant's)."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    req = generate_pb2.GenerateRequest(stop=list(stop), ignore_eos=ignore_eos, prompt_cache_key=prompt_cache_key,
                                       proposer=Proposer.parse(proposer).proto if proposer is not None else 0,
                                       logit_bias=logit_bias or {}, logprobs=logprobs, top_logprobs=top_logprobs,
                                       whole_result=whole_result, prompt_logprobs=prompt_logprobs,
                                       stop_token_ids=list(stop_token_ids))
    if response_format:
        req.response_format.CopyFrom(generate_pb2.ResponseFormat(**response_format))
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.chat.messages.extend(generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        req.chat.continue_final_message = continue_final_message
    else:
        req.token_ids.ids.extend(token_ids)
        if not token_ids:
            req.token_ids.SetInParent()
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed), ("num_speculative_tokens", num_speculative_tokens),
                        ("num_speculative_nodes", num_speculative_nodes),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_p", min_p), ("min_tokens", min_tokens)):
        if value is not None:
            setattr(req, name, value)
    return req


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OSError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


class Client:
    """tls_ca: PEM of the CA that signed the coordinator's certificate; set = TLS (else plaintext).
    client_cert / client_key: PEM pair for a coordinator that requires client certificates (mutual TLS).
    tls_server_name: name to verify in the coordinator's certificate instead of the address's host.
    token: bearer token, sent as `authorization: Bearer <token>` metadata on every call."""

    def __init__(self, address: str, timeout_s: float | None = None, *, tls_ca: str | None = None,
                 token: str | None = None, client_cert: str | None = None, client_key: str | None = None,
                 tls_server_name: str | None = None) -> None:
        if bool(client_cert) != bool(client_key):
            raise ValueError("client_cert and client_key must be given together")
        if (client_cert or tls_server_name) and not tls_ca:
            raise ValueError("client_cert / tls_server_name need tls_ca (TLS)")
        if tls_ca:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca, "TLS CA"),
                private_key=_read(client_key, "client key") if client_key else None,
                certificate_chain=_read(client_cert, "client certificate") if client_cert else None,
            )
            options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[generate_pb2.GenerateResponse]:
        """The raw response stream: TokenChunk events, then one GenerationResult. Cancel with .cancel()."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationOutput:
        text, ids, logprobs, result, scores = [], [], [], None, None
        for event in self.stream(prompt, **kwargs):
            if event.HasField("chunk"):
                ids.extend(event.chunk.token_ids)
                logprobs.extend(event.chunk.logprobs)
                text.append(event.chunk.text)
            elif event.HasField("prompt_logprobs"):
                scores = event.prompt_logprobs
            else:
                result = event.result
        if result is None:
            raise RuntimeError("stream ended without a result")
        stats = MessageToDict(result.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        return GenerationOutput("".join(text), ids, finish_reason_name(result.finish_reason), stats, logprobs, scores)

    def info(self) -> dict:
        resp = self.stub.GetInfo(generate_pb2.GetInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)
        return MessageToDict(resp, preserving_proto_field_name=True)
