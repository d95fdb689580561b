"""Structured output: the grammar a session's output must follow, held by the coordinator.

One llguidance matcher per session follows the committed tokens. Each round it
- fast-forwards (jump-forward): while the grammar allows exactly one token at the next position, that
  token is committed with no forward on either tier. The constrained target puts probability 1 on it,
  greedy or sampled, so this is what the target would produce;
- checks the proposal: the mask at each position after the committed tokens and d_1..d_j (the grammar
  advanced through the drafts before it), for the target to apply to its logits before verification
  (VerifyRequest.token_masks). Drafts the grammar refuses are cut off at the first one when the proposal
  is deterministic (prompt lookup, suffix decoding) or the request greedy: the target would reject it for
  sure, and the length of a deterministic proposal is a function of the context, so verification stays
  exact. A sampled draft-model chain is sent whole, because its q is the draft's unconstrained
  distribution: cutting it where a draw went astray would bias the output; the target rejects the
  refused draft with probability 1 (p = 0 there) and draws from the residual, which keeps the law exact.
  Masks after a refused draft are never used (verification stops there): the last valid one is repeated.
  A token tree (prompt lookup's and suffix decoding's) gets a mask per node, the grammar advanced along
  the node's path (one step down and back up per node, depth first); a refused node is cut with its
  subtree on the same terms, or else kept with its subtree's masks (never read) its parent's;
- commits what the round committed.

The grammar engine is llguidance (chosen over xgrammar by measured mask cost and because it needs no torch:
docs/DESIGN.md, "Structured output"); its compiled tokenizer is built once per coordinator, and a request's
grammar is compiled once (after admission, off the event loop, within GrammarLimits), each session stepping
a copy of it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf

from coordinator.proposers.base import Proposal
from coordinator.proposers.token_tree import children, select
from specdec.core.errors import invalid_argument
from specdec.proto import generate_pb2

MAX_GRAMMAR_CHARS = 100_000  # a response_format's schema / regex / grammar text


class ConstraintError(ValueError):
    """A response format the engine cannot use; the message starts with the field."""


@dataclass(frozen=True)
class GrammarLimits:
    """How much a request's grammar may cost: llguidance's own limits (its fuel counts work, so they bound
    time on any machine) and a wall-clock bound on compiling, after which the request gets INVALID_ARGUMENT."""

    compile_timeout_s: float = 1.0  # compiling (and the first mask) longer than this: refused, naming the field
    initial_lexer_fuel: int = 1_000_000  # building the lexer's regexes (~50k/ms: about 20 ms); llguidance's default
    step_lexer_fuel: int = 200_000  # one mask's lexer work (~14k/ms: about 15 ms); llguidance's default
    step_max_items: int = 50_000  # Earley items per mask (~20k/ms); llguidance's default
    max_lexer_states: int = 20_000  # lexer states (1-2 kB each: at most ~40 MB a grammar); llguidance's is 250k
    max_grammar_size: int = 200_000  # symbols in the grammar's productions; llguidance's is 500k
    cache_entries: int = 64  # compiled grammars kept (n choices and repeated schemas compile once)

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.initial_lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items, max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size, verbose_errors=False)


class Grammar:
    """A compiled response format: a matcher at the start of the output, copied for each session."""

    def __init__(self, field: str, text: str, matcher: llguidance.LLMatcher, eos: set[int]) -> None:
        self.field, self.text, self._matcher, self._eos = field, text, matcher, eos  # text: llguidance's grammar

    def session(self, jump_forward: bool = True) -> "Constraint":
        """A session's constraint. jump_forward=False: forced tokens go through the target too (a request
        for logprobs gets the target's own for them)."""
        return Constraint(self._matcher.deep_copy(), jump_forward, self._eos, self.field)


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built on first use, ~0.5 s) and the grammars of requests: each
    compiled once on a thread of its own (llguidance drops the GIL), within GrammarLimits, and kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], limits: GrammarLimits = GrammarLimits()) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self.limits = limits
        self._parser_limits = limits.parser_limits()
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()  # (field, grammar) -> Future[Grammar]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.compiles = 0  # grammars compiled (not taken from the cache) so far

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = self._eos[0] if self._eos else None
                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size, eos_token=eos)
            return self._ll

    def compile(self, fmt: generate_pb2.ResponseFormat) -> Grammar:
        """The request's grammar, or ConstraintError naming the field (also when compiling takes longer
        than limits.compile_timeout_s: the compile goes on within llguidance's limits, and is kept)."""
        field = f"response_format.{fmt.WhichOneof('format')}"
        key = (field, grammar_text(fmt))
        self.tokenizer()  # built once, outside the time a request's grammar is given
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, *key)
                while len(self._compiled) > self.limits.cache_entries:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        try:
            return future.result(timeout=self.limits.compile_timeout_s)
        except TimeoutError:
            raise ConstraintError(f"{field}: the grammar takes longer than {self.limits.compile_timeout_s:g}s to compile; "
                                  "simplify it") from None

    def _compile(self, field: str, grammar: str) -> Grammar:
        self.compiles += 1
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer(), limits=self._parser_limits)
        if error:
            raise ConstraintError(f"{field}: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=self._parser_limits)
        if matcher.is_error():
            raise ConstraintError(f"{field}: {matcher.get_error()}")
        if _allowed(matcher.compute_bitmask()) == 0:  # also the first step within the limits
            raise ConstraintError(f"{field}: {matcher.get_error() or 'the grammar allows no token'}")
        return Grammar(field, grammar, matcher, set(self._eos))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# JSON as json.dumps writes it: no free whitespace between tokens, ", " and ": " as separators. The keys a
# schema requires, the braces and the separators are then forced (jump-forward commits them for free) and
# the output's layout is fixed; a schema may ask otherwise with llguidance's "x-guidance" options.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(fmt: generate_pb2.ResponseFormat) -> str:
    """The llguidance grammar of a response format, or ConstraintError naming the field."""
    kind = fmt.WhichOneof("format")
    field = f"response_format.{kind}"
    text = getattr(fmt, kind) if kind != "json_object" else ""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"{field}: at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_LAYOUT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"{field}: {e}") from None


def _allowed(mask: bytes) -> int:
    """How many tokens a bitmask allows."""
    return int.from_bytes(mask, "little").bit_count()


def _only(mask: bytes) -> int:
    """The one token a bitmask allows (it must allow exactly one)."""
    return int.from_bytes(mask, "little").bit_length() - 1


class NoConstraint:
    """An unconstrained session: the loop's calls do nothing."""

    def forced(self, limit: int) -> list[int]:
        return []

    def check(self, proposal: Proposal, greedy: bool) -> tuple[Proposal, list[bytes]]:
        return proposal, []

    def commit(self, tokens: list[int]) -> None:
        pass


class Constraint:
    def __init__(self, matcher: llguidance.LLMatcher, jump_forward: bool = True, eos: set[int] = frozenset(),
                 field: str = "response_format") -> None:
        self.matcher = matcher
        self.jump_forward = jump_forward
        self.eos = eos  # a forced EOS ends the output: nothing is forced after it
        self.field = field  # the request's field, named when the engine's limits stop the grammar mid-output

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces one after another (each the only one allowed); consumed.
        Once the grammar is complete only EOS is allowed: it is forced too (and ends the output)."""
        out = []
        while self.jump_forward and len(out) < limit:
            mask = self.matcher.compute_bitmask()
            if _allowed(mask) != 1:
                break
            out.append(_only(mask))
            if self.matcher.is_stopped() or out[-1] in self.eos:
                break
            self._consume(out[-1:])
        return out

    def check(self, proposal: Proposal, greedy: bool) -> tuple[Proposal, list[bytes]]:
        """The proposal (cut at its first refused draft where that is exact) and the K + 1 masks. A round does not
        run on: the positions after its verdict would need masks of their own."""
        if proposal.run_on:
            proposal = dataclasses.replace(proposal, run_on=0)
        if proposal.parents:
            return self._check_tree(proposal, greedy)
        tokens = proposal.tokens
        masks, valid = [self.matcher.compute_bitmask()], 0
        for d in tokens:
            if not self.matcher.try_consume_tokens([d]):
                break
            valid += 1
            masks.append(self.matcher.compute_bitmask())
        if valid:
            self.matcher.rollback(valid)
        if valid < len(tokens):
            if greedy or not proposal.q:  # exact to cut: the target would refuse d_{valid+1} for sure
                proposal = dataclasses.replace(proposal, tokens=tokens[:valid], q=proposal.q[:valid],
                                               probs=proposal.probs[:valid])
            else:  # verification stops at the refused draft; later masks are never read
                masks += [masks[-1]] * (len(tokens) - valid)
        return proposal, masks

    def _check_tree(self, proposal: Proposal, greedy: bool) -> tuple[Proposal, list[bytes]]:
        """A token tree: the root's mask, then one per node, the grammar advanced along the node's path. A refused
        node goes with its subtree where that is exact (greedy, or deterministic candidates with no q: the
        target never takes a token its mask refuses); else it stays, its subtree's masks its parent's."""
        tokens, parents = proposal.tokens, proposal.parents
        below = children(parents)
        masks: dict[int, bytes] = {-1: self.matcher.compute_bitmask()}
        refused: set[int] = set()

        def walk(node: int) -> None:  # the matcher has read node's path
            for child in below.get(node, []):
                if self.matcher.try_consume_tokens([tokens[child]]):
                    masks[child] = self.matcher.compute_bitmask()
                    walk(child)
                    self.matcher.rollback(1)
                else:
                    refused.add(child)

        walk(-1)
        for i, parent in enumerate(parents):  # parents come before their children
            if parent in refused:
                refused.add(i)
            if i not in masks:
                masks[i] = masks[parent]  # never read: the walk cannot reach a refused node's row
        if refused and (greedy or not proposal.q):
            keep = [i for i in range(len(tokens)) if i not in refused]
            proposal = dataclasses.replace(
                proposal, tokens=[tokens[i] for i in keep], parents=select(keep, parents),
                q=[proposal.q[i] for i in keep] if proposal.q else proposal.q,
                probs=[proposal.probs[i] for i in keep if i < len(proposal.probs)])
            return proposal, [masks[-1]] + [masks[i] for i in keep]
        return proposal, [masks[-1]] + [masks[i] for i in range(len(tokens))]

    def commit(self, tokens: list[int]) -> None:
        self._consume(tokens)

    def _consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.matcher.is_stopped():  # the grammar is complete: what follows is the EOS it allowed
                return
            if not self.matcher.consume_token(t):  # the engine's limits (a grammar too costly to follow)
                raise invalid_argument(f"{self.field}: the grammar engine stopped: {self.matcher.get_error()}", self.field)
