"""The draft's pushed proposals as the coordinator receives them (ProposeResponse.pushed): the next rounds
the draft tier pre-drafted for the outcomes of the last one, each holding for one committed prefix. The
session's draft stream files them here as they arrive; the round loop's proposer takes the one for the
committed prefix after the verdict, if it came, and everything else is dropped: a push is never applied to
any prefix but the one it was drafted from."""

from __future__ import annotations

from specdec.proto import draft_pb2


class PushedProposals:
    def __init__(self) -> None:
        self._by_prefix: dict[tuple[int, int], draft_pb2.ProposeResponse] = {}
        self.received = 0  # pushes that arrived
        self.dropped = 0  # of them, dropped: for another prefix than the committed one, or too late

    def add(self, response: draft_pb2.ProposeResponse) -> None:
        self.received += 1
        self._by_prefix[(response.pushed_prefix_len, response.pushed_prefix_hash)] = response

    def take(self, prefix_len: int, prefix_hash: int) -> draft_pb2.ProposeResponse | None:
        """The push for exactly this committed prefix (its length and fingerprint), or None; every other push
        held is dropped (they were for outcomes that did not happen)."""
        found = self._by_prefix.pop((prefix_len, prefix_hash), None)
        self.dropped += len(self._by_prefix)
        self._by_prefix.clear()
        return found

    def clear(self) -> None:
        """The stream ended: its pushes go with it."""
        self.dropped += len(self._by_prefix)
        self._by_prefix.clear()
