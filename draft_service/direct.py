"""Direct rounds (docs/DESIGN.md, Direct rounds): a session's rounds run from the draft replica. It proposes K
tokens with its engine, sends them to the target tier on the session's own VerifyStream, commits the verdict
and proposes again; the caller (the coordinator) reads each round off the Drive stream and is off the path
between them. A round is then two hops (draft -> target -> draft) instead of four through the caller.

Each request is the one the caller's own rounds would have sent: the same contexts (whole on the first round,
then from what each tier reports it caches), K capped by the budget as the caller caps it, and the target's
seed derived from the committed length, so the committed tokens are the caller's rounds' tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specdec.core.errors import RequestError, invalid_argument
from specdec.core.prefix import PrefixHashes
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.proto import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from specdec.serving.routing import RoutingConfig

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetLink:
    """The draft replica's channel to the target tier (--direct-target), opened at the first Drive: to all its
    replicas with the coordinator's routing (ring hash on the session's routing key, health-checked), so a
    session's Verify calls reach the replica that holds its prefix whichever process makes them."""

    def __init__(self, address: str, max_message_bytes: int, routing: RoutingConfig = RoutingConfig()) -> None:
        self.address, self.routing = address, routing
        self._options = [("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.max_send_message_length", max_message_bytes),
                         *routing.channel_options(health_service=TARGET_SERVICE)]
        self._channel: grpc.aio.Channel | None = None
        self._stub: target_pb2_grpc.TargetServiceStub | None = None

    @property
    def stub(self) -> target_pb2_grpc.TargetServiceStub:
        if self._stub is None:  # on the serving loop, at the first Drive
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        return self._stub


def _target_error(e: grpc.aio.AioRpcError) -> RequestError:
    """A failed target call, as the status the Drive stream ends with (the caller's own rounds take over)."""
    return RequestError(e.code(), f"direct rounds: the target tier's VerifyStream: {e.details()}")


async def drive(request: draft_pb2.DriveRequest, propose: Callable[[draft_pb2.ProposeRequest], Awaitable],
                target: TargetLink, max_context: int) -> AsyncIterator[draft_pb2.DriveEvent]:
    """The session's rounds; propose(request) is the draft's own Propose (checks, engine, response), max_context
    the draft's (a round that would pass it drafts nothing, as the caller's would not ask). Ends when
    max_new_tokens are committed or an EOS is; raises RequestError on a failed call. Each round's next proposal
    is under way in the engine while the round's event is written to the caller."""
    if request.context.prefix_len != 0:
        raise invalid_argument("context.prefix_len: a Drive sends the whole committed sequence (prefix_len 0)")
    if request.max_new_tokens < 1:
        raise invalid_argument(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    session = DirectSession(request, max_context)
    call = target.stub.VerifyStream(metadata=target.routing.metadata(request.target_routing_key or session.id))
    proposing = session.propose(propose)
    try:
        while True:
            t0 = time.perf_counter()
            proposed = await proposing if proposing is not None else None
            draft_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            try:
                await call.write(session.verify_request(proposed))
                verdict = await call.read()
            except grpc.aio.AioRpcError as e:
                raise _target_error(e) from None
            if verdict is grpc.aio.EOF:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "direct rounds: the target tier ended the stream")
            event = draft_pb2.DriveEvent(verdict=verdict, verify_wall_ms=(time.perf_counter() - t0) * 1e3)
            if proposed is not None:
                event.draft_tokens.extend(proposed.tokens)
                event.draft_parents.extend(proposed.parents)
                event.draft_compute_ms, event.draft_queue_ms = proposed.compute_ms, proposed.queue_ms
                event.draft_wall_ms, event.speculated = draft_ms, proposed.speculated
                event.draft_trace.CopyFrom(proposed.trace)
            done = session.commit(proposed, verdict)
            proposing = None if done else session.propose(propose)  # the next round's, while the event is written
            yield event
            if done:
                break
    finally:
        if proposing is not None:
            proposing.cancel()
        call.cancel()


class DirectSession:
    """What the driver knows of a session: its committed tokens, and how many of them each tier caches."""

    def __init__(self, request: draft_pb2.DriveRequest, max_context: int) -> None:
        self.request, self.max_context = request, max_context
        self.id, self.fingerprint = request.context.session_id, request.context.tokenizer_fingerprint
        self.committed = list(request.context.new_tokens)
        self.hashes = PrefixHashes(self.committed)
        self.eos = set(request.eos_token_ids)
        self.draft_at = self.target_at = 0  # leading committed tokens each tier caches (the contexts' prefix_len)
        self.produced = 0

    def propose(self, propose: Callable[[draft_pb2.ProposeRequest], Awaitable]) -> asyncio.Future | None:
        """The next round's proposal, under way; None where the round drafts nothing (the budget's last token,
        or no room in the draft's context)."""
        r = self.request
        k = max(min(r.num_tokens, r.max_new_tokens - self.produced - 1), 0)  # a round adds one of its own
        if k == 0 or len(self.committed) + k > self.max_context:
            return None
        ask = draft_pb2.ProposeRequest(context=self.context(self.draft_at), num_tokens=k, sampling=r.sampling,
                                       seed=r.draft_seed)
        if r.speculate > 0:  # a chain asked as a tree of branching 1, with the speculation cache on
            ask.tree_nodes, ask.tree_depth, ask.tree_branching = k, k, 1
            ask.tree_scheme, ask.speculate = r.tree_scheme, r.speculate
        return asyncio.ensure_future(propose(ask))

    def verify_request(self, proposed: draft_pb2.ProposeResponse | None) -> target_pb2.VerifyRequest:
        r = self.request
        ask = target_pb2.VerifyRequest(
            context=self.context(self.target_at), sampling=r.sampling, logprobs=r.logprobs, top_logprobs=r.top_logprobs,
            seed=derive_seed(r.target_seed, len(self.committed), TARGET_STREAM))
        if proposed is not None:
            ask.draft_tokens.extend(proposed.tokens)
            ask.q.extend(proposed.q)
            if proposed.parents:
                ask.draft_parents.extend(proposed.parents)
                ask.tree_scheme = proposed.tree_scheme
        return ask

    def commit(self, proposed: draft_pb2.ProposeResponse | None, verdict: target_pb2.VerifyResponse) -> bool:
        """The round's verdict: commit its tokens; True when the Drive is done (its budget spent, or an EOS)."""
        drafts = list(proposed.tokens) if proposed is not None else []
        tree = proposed is not None and bool(proposed.parents)
        n, before = verdict.num_accepted, len(self.committed)
        path = list(verdict.accepted_path) if tree else list(range(n))
        if not 0 <= n <= len(drafts) or len(path) != n or any(not 0 <= i < len(drafts) for i in path):
            raise RequestError(grpc.StatusCode.INTERNAL, f"direct rounds: the target accepted {path} of {len(drafts)}")
        accepted = [drafts[i] for i in path] + [verdict.next_token]
        self.committed.extend(accepted)
        self.hashes.extend(accepted)
        self.produced += len(accepted)
        # Each tier caches the committed tokens it was sent and its own tokens of this round that were
        # committed (the draft: its drafts fed back; the target: the accepted drafts).
        # (A tree's accepted entries are moved into place by the draft at its next request: count none.)
        if proposed is not None:
            self.draft_at = min(proposed.cached_len, before if tree else before + n)
        self.target_at = min(verdict.cached_len, before + n)
        return self.produced >= self.request.max_new_tokens or bool(self.eos.intersection(accepted))

    def context(self, prefix: int) -> common_pb2.SessionContext:
        """A request's context to a tier caching the first `prefix` committed tokens (0: the whole sequence, with
        the caller's tokenizer fingerprint, as any full send)."""
        prefix = min(prefix, len(self.committed) - 1)
        return common_pb2.SessionContext(
            session_id=self.id, prefix_len=prefix, prefix_hash=self.hashes.at(prefix),
            new_tokens=self.committed[prefix:], tokenizer_fingerprint=self.fingerprint if prefix == 0 else "")
