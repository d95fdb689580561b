"""One session's target features on their way to a feature draft (an EAGLE-3 head serving as the draft tier).

The target returns, with each verdict, its layer outputs at the positions the round added to its cache
(VerifyResponse.features: one bfloat16 row per position, from features_start); the head needs a row for every
committed position but the last before it can draft. Whoever runs the session's rounds (the coordinator, or the
draft replica in direct rounds) keeps the session's rows (bytes, as they came) and sends the head those it has not
yet sent with the next proposal request; a full send to the draft
(context.prefix_len 0: a new replica, or one that lost the session) sends them all again. Rows are facts about
committed positions, so nothing here ever rolls back. A response whose rows start past the ones held (the reply
to an earlier request was lost after the target had cached its positions) cannot be filled in: the target's
cursor is reset, so its next request is a full send and the target feeds, and returns, every position again.
"""

from __future__ import annotations

from collections.abc import Callable


class SessionFeatures:
    def __init__(self, layers: list[int], width: int) -> None:
        """layers: the target layers the head reads (VerifyRequest.feature_layers); width: numbers per row."""
        self.layers = list(layers)
        self.row_bytes = 2 * width
        self._data = bytearray()
        self._sent = 0  # rows the draft tier holds (as far as its last successful reply says)
        self._sending = 0

    @property
    def rows(self) -> int:
        """Positions 0 .. rows - 1 have their row."""
        return len(self._data) // self.row_bytes

    def ready(self, committed_len: int) -> bool:
        """Whether the head can draft after committed_len tokens: a row for each but the last."""
        return committed_len >= 2 and self.rows >= committed_len - 1

    def absorb(self, start: int, data: bytes, on_gap: Callable[[], None]) -> None:
        """A verdict's rows for positions start.. (on_gap: what to do when they start past the rows held)."""
        if not data:
            return
        if start > self.rows:
            on_gap()
            return
        del self._data[start * self.row_bytes :]
        self._data += data
        self._sent = min(self._sent, start)  # rows from `start` may differ from the ones the draft holds

    def for_draft(self, prefix_len: int) -> tuple[int, bytes]:
        """(features_start, features) for a proposal request whose context keeps prefix_len tokens: the rows the
        draft tier lacks (all of them on a full send)."""
        start = 0 if prefix_len == 0 else self._sent
        self._sending = self.rows
        return start, bytes(self._data[start * self.row_bytes :])

    def sent(self) -> None:
        """The last request built by for_draft succeeded: the draft tier holds its rows."""
        self._sent = self._sending
