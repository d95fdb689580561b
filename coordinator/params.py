"""GenerationParams: a validated request (coordinator.api.validation makes them), what the round loop and
its collaborators are built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.core.proposer_names import HYBRID, Proposer
from specdec.math.params import SamplingParams
from specdec.math.seeds import RACE_STREAM, derive_seed
from specdec.proto import generate_pb2

MAX_CACHE_KEY_LEN = 128  # prompt_cache_key (or the OpenAI user standing in for it): characters


@dataclass(frozen=True)
class GenerationParams:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    num_speculative_tokens: int | None  # K; None = adaptive
    proposer: Proposer = HYBRID
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the output (FINISH_REASON_STOP), EOS or not
    include_stop: bool = False  # the text keeps the stop string it ends at
    min_tokens: int = 0  # EOS and the stop tokens refused until the output holds this many (coordinator.min_tokens)
    ignore_eos: bool = False
    cache_key: str = ""  # routes the session to the replicas that served the same key (prompt_cache_key)
    logprobs: int = -1  # -1: no logprobs; n >= 0: each token's logprob and the top n alternatives
    response_format: generate_pb2.ResponseFormat | None = None  # structured output (coordinator.constraint); None: free
    grammar: Any = None  # response_format compiled (a coordinator.constraint.Grammar); set with it
    tree_nodes: int | None = None  # N, each round's token-tree node budget (0: chains); None = the server's defaults
    whole_result: bool = False  # the caller reads only the final result: rounds may run on further (PolicyConfig)
    prompt_logprobs: int = -1  # -1: none; n >= 0: the prompt scored first, each token's logprob and the top n alternatives
    seeded: bool = False  # the request set its seed (else `seed` was drawn for it)

    @property
    def race_seed(self) -> int:
        """A seeded sampled request's key for the keyed race (specdec.math.race), which both tiers draw with so that
        its output is a function of the seed, whatever was proposed; 0 for the rest (greedy, or no seed: rejection
        sampling, which accepts a little more often)."""
        if not self.seeded or self.sampling.temperature == 0:
            return 0
        return derive_seed(self.seed, 0, RACE_STREAM) or 1
