"""Errors a request can end with, as a gRPC status and a message: raised by the engine (its own failures),
the tiers' servicers (bad input) and the coordinator, and turned into context.abort(code, message) by the
serving layer. No torch."""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


# Trailing metadata on every status a tier's session stream ends with by the tier's own decision. A status
# without it came from the connection: gRPC core reports a connection that died under a call as INTERNAL at
# times ("Internal error from Core"), not only as UNAVAILABLE, and the coordinator must not take that for
# the tier's verdict on the request.
TIER_STATUS_METADATA = (("specdec-status-from", "tier"),)


class RequestError(Exception):
    """A request the service refuses, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        """field: the request field at fault, as the gRPC message names it (e.g. "max_new_tokens"), for an
        API that names its fields otherwise (the OpenAI API: "max_tokens") to say so in its own words."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def invalid_argument(message: str, field: str | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field)


def check_token_ids(ids, vocab_size: int, field_name: str) -> None:
    """INVALID_ARGUMENT naming the field for the first id outside [0, vocab_size)."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise invalid_argument(f"{field_name}: token id {t} is outside the vocabulary [0, {vocab_size})")


def as_request_error(e: Exception) -> RequestError:
    """RequestError as is; anything else is our bug: INTERNAL, logged with its traceback."""
    if isinstance(e, RequestError):
        return e
    log.exception("internal error")
    return RequestError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
