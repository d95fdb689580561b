"""The proposer names: the one table the gRPC API, the OpenAI API, the CLI and the Python client use.

Each proposer has a canonical name (what the server reports: GenerationStats.proposer, metrics labels),
its value in the gRPC enum (generate.proto, Proposer), and documented short aliases (the CLI's spellings)
that every API accepts too. Imports nothing of the coordinator: the client uses it.
"""

from __future__ import annotations

import enum

from specdec.proto import generate_pb2


class Proposer(str, enum.Enum):
    """A proposer's canonical name. A str, so it compares equal to its name and prints as it."""

    DRAFT_MODEL = "draft_model"  # the draft tier's model
    PROMPT_LOOKUP = "prompt_lookup"  # n-gram continuation from the session's own tokens
    SUFFIX = "suffix"  # suffix decoding over the session's tokens and recent outputs
    HYBRID = "hybrid"  # per round, the policy's pick among the three

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its name's: a dict keyed by names finds the member, and the reverse
        return str.__hash__(self)

    @property
    def proto(self) -> int:
        """The gRPC enum value (generate_pb2.Proposer)."""
        return _PROTO[self]

    @classmethod
    def parse(cls, name: str) -> "Proposer":
        """A canonical name or an alias; ValueError naming the accepted spellings otherwise."""
        found = _BY_NAME.get(name)
        if found is None:
            raise ValueError(f"proposer must be one of {list(NAMES)}, got {name!r}")
        return found

    @classmethod
    def from_proto(cls, value: int) -> "Proposer | None":
        """The proposer of a gRPC enum value; None for PROPOSER_UNSPECIFIED; ValueError if unknown."""
        if value == generate_pb2.PROPOSER_UNSPECIFIED:
            return None
        for p, v in _PROTO.items():
            if v == value:
                return p
        raise ValueError(f"proposer: unknown value {value}")


DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX, HYBRID = Proposer.DRAFT_MODEL, Proposer.PROMPT_LOOKUP, Proposer.SUFFIX, Proposer.HYBRID

_PROTO = {
    DRAFT_MODEL: generate_pb2.PROPOSER_DRAFT_MODEL,
    PROMPT_LOOKUP: generate_pb2.PROPOSER_PROMPT_LOOKUP,
    SUFFIX: generate_pb2.PROPOSER_SUFFIX,
    HYBRID: generate_pb2.PROPOSER_HYBRID,
}
# Documented short spellings (the CLI's), accepted by every API as the canonical name.
ALIASES = {"draft": DRAFT_MODEL, "lookup": PROMPT_LOOKUP}
PROPOSERS = tuple(Proposer)  # the canonical names
NAMES = tuple(p.value for p in Proposer) + tuple(ALIASES)  # every accepted spelling
_BY_NAME = {**{p.value: p for p in Proposer}, **ALIASES}
