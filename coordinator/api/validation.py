"""Request validation, shared by every public API: a GenerateRequest (the gRPC message; the HTTP API
converts its JSON into one) becomes GenerationParams or a RequestError(INVALID_ARGUMENT) naming the field,
before any token is generated. It tokenises the prompt and compiles the grammar: the Frontend runs it after
admission, on a thread (both release the GIL), so the event loop and the streams on it never wait for it."""

from __future__ import annotations

import secrets

from coordinator.constraint import ConstraintError
from coordinator.params import MAX_CACHE_KEY_LEN, GenerationParams
from coordinator.pipeline import Pipeline
from specdec.core.proposer_names import Proposer
from specdec.math.params import SamplingParams
from specdec.proto import generate_pb2
from specdec.core.errors import RequestError, check_token_ids, invalid_argument

CHAT_ROLES = {"system", "user", "assistant", "tool"}  # "tool": a function call's result (OpenAI tools)
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's cap; the target's too)


class RequestValidator:
    """Checks a request against the server's limits and the pipeline's models (known after connect())."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.config = pipeline.config

    def max_k(self) -> int:
        """The largest K accepted: the server's cap and each tier's."""
        return self.pipeline.max_k()

    def __call__(self, r: generate_pb2.GenerateRequest) -> GenerationParams:
        """The request as GenerationParams, or RequestError(INVALID_ARGUMENT) naming the field."""
        c = self.config
        prompt_ids = self.prompt_ids(r)
        if r.HasField("truncate_prompt_tokens"):
            if r.truncate_prompt_tokens < 1:
                raise invalid_argument(f"truncate_prompt_tokens must be >= 1, got {r.truncate_prompt_tokens}",
                                       "truncate_prompt_tokens")
            prompt_ids = prompt_ids[-r.truncate_prompt_tokens:]
        context = self.pipeline.target_info.max_context
        if len(prompt_ids) > c.max_prompt_tokens:
            raise invalid_argument(f"prompt has {len(prompt_ids)} tokens, more than max_prompt_tokens={c.max_prompt_tokens}", "prompt")
        if len(prompt_ids) >= context:
            raise invalid_argument(f"prompt has {len(prompt_ids)} tokens; the target's context is {context}, leaving no room to generate", "prompt")
        max_new = r.max_new_tokens if r.HasField("max_new_tokens") else c.default_max_new_tokens
        least = 0 if r.prompt_logprobs else 1  # (0: the prompt scored only)
        if not least <= max_new <= c.max_new_tokens_cap:
            raise invalid_argument(f"max_new_tokens must be in [{least}, {c.max_new_tokens_cap}], got {max_new}", "max_new_tokens")
        sampling = SamplingParams(
            temperature=r.temperature if r.HasField("temperature") else 0.0,
            top_k=r.top_k if r.HasField("top_k") else 0,
            top_p=r.top_p if r.HasField("top_p") else 1.0,
            presence_penalty=r.presence_penalty if r.HasField("presence_penalty") else 0.0,
            frequency_penalty=r.frequency_penalty if r.HasField("frequency_penalty") else 0.0,
            repetition_penalty=r.repetition_penalty if r.HasField("repetition_penalty") else 1.0,
            min_p=r.min_p if r.HasField("min_p") else 0.0,
            logit_bias=SamplingParams.bias_items(r.logit_bias),
        )
        try:
            sampling.validate(self.pipeline.target_info.vocab_size)
        except ValueError as e:
            raise invalid_argument(str(e), str(e).split()[0]) from None  # the message starts with the field
        if r.top_logprobs and not (r.logprobs or r.prompt_logprobs):
            raise invalid_argument("top_logprobs needs logprobs or prompt_logprobs")
        if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_argument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {r.top_logprobs}")
        if r.HasField("num_speculative_tokens"):
            k = r.num_speculative_tokens
            if not 0 <= k <= self.max_k():
                raise invalid_argument(f"num_speculative_tokens must be in [0, {self.max_k()}], got {k}", "num_speculative_tokens")
        else:
            k = c.default_num_speculative_tokens
            k = None if k is None else min(k, self.max_k())
        try:
            proposer = Proposer.from_proto(r.proposer) or Proposer.parse(str(c.default_proposer))
        except ValueError as e:
            raise invalid_argument(str(e)) from None
        if len(r.stop) > MAX_STOP_STRINGS:
            raise invalid_argument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(r.stop)}", "stop")
        for s in r.stop:
            if not s or len(s) > MAX_STOP_LEN:
                raise invalid_argument(f"stop: each string must have 1..{MAX_STOP_LEN} characters", "stop")
        if len(r.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid_argument(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(r.stop_token_ids)}",
                                   "stop_token_ids")
        try:
            check_token_ids(r.stop_token_ids, self.pipeline.target_info.vocab_size, "stop_token_ids")
        except RequestError as e:
            raise invalid_argument(e.message, "stop_token_ids") from None
        seed = r.seed if r.HasField("seed") else secrets.randbits(63)
        if len(r.prompt_cache_key) > MAX_CACHE_KEY_LEN:
            raise invalid_argument(f"prompt_cache_key: at most {MAX_CACHE_KEY_LEN} characters, got {len(r.prompt_cache_key)}")
        response_format, grammar = None, None
        if r.HasField("response_format"):
            if r.response_format.WhichOneof("format") is None:
                raise invalid_argument("response_format: set one of json_object, json_schema, regex, lark", "response_format")
            if r.ignore_eos:
                raise invalid_argument("response_format: cannot be combined with ignore_eos (the grammar ends the output)",
                                       "response_format")
            try:
                grammar = self.pipeline.grammar.compile(r.response_format)  # refused before any token
            except ConstraintError as e:
                raise invalid_argument(str(e), str(e).split(":")[0]) from None
            response_format = r.response_format
        if not 0 <= r.min_tokens <= max_new:
            raise invalid_argument(f"min_tokens must be in [0, max_new_tokens = {max_new}], got {r.min_tokens}", "min_tokens")
        if r.min_tokens and response_format is not None:
            raise invalid_argument("min_tokens: not with response_format (the grammar decides where the output ends)",
                                   "min_tokens")
        nodes = None
        if r.HasField("num_speculative_nodes"):
            nodes = r.num_speculative_nodes
            if not 0 <= nodes <= self.max_k():
                raise invalid_argument(f"num_speculative_nodes must be in [0, {self.max_k()}], got {nodes}", "num_speculative_nodes")
            if k is not None and 0 < nodes < k:
                raise invalid_argument(f"num_speculative_nodes ({nodes}) must be 0 or at least num_speculative_tokens ({k}): "
                                       "a tree of depth K holds at least K nodes", "num_speculative_nodes")
            if nodes and sampling.penalized:
                raise invalid_argument("num_speculative_nodes: token trees take no presence, frequency or repetition "
                                       "penalty (their rounds verify chains); leave it unset or 0", "num_speculative_nodes")
        return GenerationParams(prompt_ids=prompt_ids, max_new_tokens=max_new, sampling=sampling, seed=seed,
                                seeded=r.HasField("seed"),
                                num_speculative_tokens=k, proposer=proposer, stop=tuple(r.stop), ignore_eos=r.ignore_eos,
                                stop_token_ids=frozenset(r.stop_token_ids), include_stop=r.include_stop_str_in_output,
                                min_tokens=r.min_tokens,
                                cache_key=r.prompt_cache_key, logprobs=r.top_logprobs if r.logprobs else -1,
                                response_format=response_format, grammar=grammar, tree_nodes=nodes,
                                whole_result=r.whole_result, prompt_logprobs=r.top_logprobs if r.prompt_logprobs else -1)

    def prompt_ids(self, r: generate_pb2.GenerateRequest) -> list[int]:
        """The request's prompt as token ids (a chat rendered with the template), or RequestError naming the field."""
        tok = self.pipeline.tokenizer
        which = r.WhichOneof("prompt")
        if which is None:
            raise invalid_argument("prompt is required: set text, chat or token_ids", "prompt")
        if which == "text":
            if not r.text:
                raise invalid_argument("prompt text is empty", "prompt")
            ids = tok(r.text)["input_ids"]
        elif which == "chat":
            if not r.chat.messages:
                raise invalid_argument("prompt chat.messages is empty", "chat.messages")
            for i, m in enumerate(r.chat.messages):
                if m.role not in CHAT_ROLES:
                    raise invalid_argument(f"chat.messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {m.role!r}", f"chat.messages[{i}].role")
            if not tok.chat_template:
                raise invalid_argument("the model's tokenizer has no chat template; send text or token_ids")
            messages = [{"role": m.role, "content": m.content} for m in r.chat.messages]
            chat = r.chat
            opening = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not chat.continue_final_message
            if chat.continue_final_message and (opening or messages[-1]["role"] != "assistant"):
                raise invalid_argument("chat.continue_final_message: the last message must be the assistant's, and "
                                       "add_generation_prompt not set", "chat.continue_final_message")
            ids = tok.apply_chat_template(messages, add_generation_prompt=opening,
                                          continue_final_message=chat.continue_final_message, tokenize=True)
            if not isinstance(ids, list):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
        else:
            ids = list(r.token_ids.ids)
            if not ids:
                raise invalid_argument("prompt token_ids is empty", "prompt")
            try:
                check_token_ids(ids, self.pipeline.target_info.vocab_size, "prompt token_ids")
            except RequestError as e:
                raise invalid_argument(e.message, "prompt") from None
        if not ids:
            raise invalid_argument("prompt tokenizes to no tokens", "prompt")
        return list(ids)
