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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from specdec.core.errors import RequestError
from specdec.core.prefix import PrefixHashes
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.proto import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from specdec.serving.features import SessionFeatures
from specdec.serving.routing import RoutingConfig
from specdec.serving.tier import DRAINING

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetLink:
    """The draft replica's channel to the target tier (--direct-target), opened at the first Drive: to all its
    replicas with the coordinator's routing (ring hash on the session's routing key, health-checked), so a
    session's Verify calls reach the replica that holds its prefix whichever process makes them."""

    def __init__(self, address: str, max_message_bytes: int, routing: RoutingConfig = RoutingConfig(),
                 credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, str]] = ()) -> None:
        """credentials: TLS to the target (specdec.serving.server.client_credentials, with its options); None: plaintext."""
        self.address, self.routing, self.credentials = address, routing, credentials
        self._options = [("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.max_send_message_length", max_message_bytes),
                         *routing.channel_options(health_service=TARGET_SERVICE), *options]
        self._channel: grpc.aio.Channel | None = None
        self._stub: target_pb2_grpc.TargetServiceStub | None = None

    @property
    def stub(self) -> target_pb2_grpc.TargetServiceStub:
        if self._stub is None:  # on the serving loop, at the first Drive
            self._channel = (grpc.aio.insecure_channel(self.address, options=self._options) if self.credentials is None
                             else grpc.aio.secure_channel(self.address, self.credentials, options=self._options))
            self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        return self._stub

    @property
    def tls(self) -> bool:
        return self.credentials is not None


def _target_error(e: grpc.aio.AioRpcError) -> RequestError:
    """A failed target call, as the status the Drive stream ends with (the caller's own rounds take over)."""
    return RequestError(e.code(), f"direct rounds: the target tier's VerifyStream: {e.details()}")


async def drive(request: draft_pb2.DriveRequest, propose: Callable[..., Awaitable],
                target: TargetLink, max_context: int, draining: Callable[[], bool] = lambda: False,
                features: SessionFeatures | None = None) -> AsyncIterator[draft_pb2.DriveEvent]:
    """The session's rounds; propose(request) is the draft's own Propose (checks, engine, response; with
    inline=False its steps stay on the engine thread, Engine._take_inline), max_context
    the draft's (a round that would pass it drafts nothing, as the caller's would not ask). Ends when
    max_new_tokens are committed or an EOS is; raises RequestError on a failed call, and UNAVAILABLE once
    draining() (the replica shuts down: the caller's own rounds go on elsewhere at once, not after the grace).
    A round's event is written to the caller while the target verifies the next round (the first and the last
    at once): the write takes the replica's interpreter, which the draft's own steps need. features: an EAGLE-3
    head's (this replica serves one): each verify asks the target for its rows, which go to the head with the next
    proposal, and a round drafts only once they cover the context (the first is the target's alone)."""
    session = DirectSession(request, max_context, features)
    call = target.stub.VerifyStream(metadata=target.routing.metadata(request.target_routing_key or session.id))
    proposing, ahead, pending, first = session.propose(propose), None, None, True
    try:
        while True:
            if draining():
                raise RequestError(grpc.StatusCode.UNAVAILABLE, DRAINING)
            t0 = time.perf_counter()
            proposed = await proposing if proposing is not None else None
            draft_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            try:
                await call.write(session.verify_request(proposed))
                ahead = session.draft_ahead(propose, proposed)  # while the target verifies
                if pending is not None:  # the last round's event, written while the target verifies this one
                    yield pending
                    pending = None
                verdict = await call.read()
            except grpc.aio.AioRpcError as e:
                raise _target_error(e) from None
            if verdict is grpc.aio.EOF:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "direct rounds: the target tier ended the stream")
            event = draft_pb2.DriveEvent(verdict=verdict, verify_wall_ms=(time.perf_counter() - t0) * 1e3)
            if proposed is not None:
                event.draft_tokens.extend(proposed.tokens)
                event.draft_compute_ms, event.draft_queue_ms = proposed.compute_ms, proposed.queue_ms
                event.draft_wall_ms, event.speculated = draft_ms, proposed.speculated
                event.draft_trace.CopyFrom(proposed.trace)
            done = session.commit(proposed, verdict)
            ready = None
            if ahead is not None:  # the next round's proposal, if the verdict was the outcome it was drafted for
                ready, ahead = session.take_ahead(await ahead, proposed, verdict), None
            if done:
                proposing = None
            elif ready is not None:
                proposing = asyncio.get_running_loop().create_future()
                proposing.set_result(ready)
            else:
                proposing = session.propose(propose)
            if done or first:
                yield event  # the last round's, and the first's (its token is the client's first) at once
            else:
                pending = event
            first = False
            if done:
                break
    finally:
        for future in (proposing, ahead):
            if future is not None:
                future.cancel()
        call.cancel()

class DirectSession:
    """What the driver knows of a session: its committed tokens, and how many of them each tier caches."""

    def __init__(self, request: draft_pb2.DriveRequest, max_context: int,
                 features: SessionFeatures | None = None) -> None:
        self.request, self.max_context, self.features = request, max_context, features
        self.id, self.fingerprint = request.context.session_id, request.context.tokenizer_fingerprint
        self.committed = list(request.context.new_tokens)
        self.hashes = PrefixHashes(self.committed)
        self.eos = set(request.eos_token_ids)
        self.draft_at = self.target_at = 0  # leading committed tokens each tier caches (the contexts' prefix_len)
        self.produced = 0
        self.whole = 1.0  # how often a whole proposal is accepted (decaying): drafting ahead pays only if often

    def _k(self, produced: int, length: int) -> int:
        """K for a round after `produced` tokens, over `length` committed ones: the request's, capped by the budget
        (a round adds one of its own); 0 where the draft's context has no room for it."""
        r = self.request
        k = max(min(r.num_tokens, r.max_new_tokens - produced - 1), 0)
        return 0 if length + k > self.max_context else k

    def propose(self, propose: Callable[[draft_pb2.ProposeRequest], Awaitable]) -> asyncio.Future | None:
        """The next round's proposal, under way; None where the round drafts nothing."""
        k = self._k(self.produced, len(self.committed))
        if k == 0 or (self.features is not None and not self.features.ready(len(self.committed))):
            return None
        r = self.request
        ask = draft_pb2.ProposeRequest(context=self.context(self.draft_at), num_tokens=k, sampling=r.sampling,
                                       seed=r.draft_seed)
        if self.features is None:
            return asyncio.ensure_future(propose(ask))
        ask.features_start, ask.features = self.features.for_draft(ask.context.prefix_len)

        async def with_rows() -> draft_pb2.ProposeResponse:
            response = await propose(ask)
            self.features.sent()  # the head holds the rows now
            return response

        return asyncio.ensure_future(with_rows())

    def draft_ahead(self, propose, proposed: draft_pb2.ProposeResponse | None) -> asyncio.Future | None:
        """Drafting ahead (module docstring): the chain e_1..e_K'+1 after the proposal's last draft, under way; None
        where not asked, with no proposal, with whole proposals seldom accepted of late, or no next round."""
        r = self.request
        if r.speculate <= 0 or proposed is None or not proposed.tokens or self.whole < 0.5 or self.features is not None:
            return None  # (a head has no speculation cache)
        drafts = list(proposed.tokens)
        k_next = self._k(self.produced + len(drafts) + 1, len(self.committed) + len(drafts) + 1)
        if k_next == 0:
            return None
        return asyncio.ensure_future(propose(draft_pb2.ProposeRequest(  # the draft caches the tokens and d_1..d_K-1
            context=self.context(proposed.cached_len, drafts), num_tokens=k_next + 1, sampling=r.sampling,
            seed=r.draft_seed), inline=False))  # on the engine thread: this one reads the verdict meanwhile

    def take_ahead(self, ahead: draft_pb2.ProposeResponse, proposed: draft_pb2.ProposeResponse,
                   verdict: target_pb2.VerifyResponse) -> draft_pb2.ProposeResponse | None:
        """After commit(): the next round's proposal if the verdict was the outcome drafted ahead for (every draft
        accepted, then e_1), else None; either way what the draft now caches of the committed tokens."""
        n = verdict.num_accepted
        before = len(self.committed) - n - 1
        if n < len(proposed.tokens) or not ahead.tokens or verdict.next_token != ahead.tokens[0]:
            self.draft_at = min(ahead.cached_len, before + n)  # the next request crops the rest
            return None
        self.draft_at = min(ahead.cached_len, len(self.committed))
        ready = draft_pb2.ProposeResponse(
            tokens=ahead.tokens[1:], q=ahead.q[1:], cached_len=ahead.cached_len, compute_ms=ahead.compute_ms,
            queue_ms=ahead.queue_ms, batch_sessions=ahead.batch_sessions, step_ms=ahead.step_ms, step_id=ahead.step_id,
            speculated=True)
        ready.trace.CopyFrom(ahead.trace)
        return ready

    def verify_request(self, proposed: draft_pb2.ProposeResponse | None) -> target_pb2.VerifyRequest:
        r = self.request
        ask = target_pb2.VerifyRequest(
            context=self.context(self.target_at), sampling=r.sampling, logprobs=r.logprobs, top_logprobs=r.top_logprobs,
            seed=derive_seed(r.target_seed, len(self.committed), TARGET_STREAM), race_seed=r.race_seed)
        if proposed is not None:
            ask.draft_tokens.extend(proposed.tokens)
            if not r.race_seed:  # (a keyed race uses no q)
                ask.q.extend(proposed.q)
        if self.features is not None:
            ask.feature_layers.extend(self.features.layers)
        return ask

    def commit(self, proposed: draft_pb2.ProposeResponse | None, verdict: target_pb2.VerifyResponse) -> bool:
        """The round's verdict: commit its tokens; True when the Drive is done (its budget spent, or an EOS)."""
        drafts = list(proposed.tokens) if proposed is not None else []
        n, before = verdict.num_accepted, len(self.committed)
        if not 0 <= n <= len(drafts):
            raise RequestError(grpc.StatusCode.INTERNAL, f"direct rounds: the target accepted {n} of {len(drafts)}")
        accepted = drafts[:n] + [verdict.next_token]
        self.committed.extend(accepted)
        self.hashes.extend(accepted)
        self.produced += len(accepted)
        # Each tier caches the committed tokens it was sent and its own tokens of this round that were
        # committed (the draft: its drafts fed back; the target: the accepted drafts).
        if drafts:
            self.draft_at = min(proposed.cached_len, before + n)
            self.whole = 0.8 * self.whole + 0.2 * (n == len(drafts))
        self.target_at = min(verdict.cached_len, before + n)
        if self.features is not None:  # rows past the ones held: the target is sent the whole sequence, and returns all
            self.features.absorb(verdict.features_start, verdict.features, on_gap=self._resend_to_target)
        return self.produced >= self.request.max_new_tokens or bool(self.eos.intersection(accepted))

    def _resend_to_target(self) -> None:
        self.target_at = 0

    def context(self, prefix: int, extra: list[int] = ()) -> common_pb2.SessionContext:
        """A request's context over the committed tokens + `extra` (drafting ahead's hypothesis) to a tier caching
        the first `prefix` of them (0: the whole sequence, with the caller's tokenizer fingerprint, as any full
        send)."""
        sequence, hashes = (self.committed + list(extra), self.hashes.extended(extra)) if extra else (self.committed,
                                                                                                      self.hashes)
        prefix = min(prefix, len(sequence) - 1)
        return common_pb2.SessionContext(
            session_id=self.id, prefix_len=prefix, prefix_hash=hashes.at(prefix),
            new_tokens=sequence[prefix:], tokenizer_fingerprint=self.fingerprint if prefix == 0 else "")
