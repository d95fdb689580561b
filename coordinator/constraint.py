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
docs/DESIGN.md, "Structured output"); its compiled tokenizer is built once per coordinator.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import llguidance
import llguidance.hf

from coordinator.proposers.base import Proposal
from coordinator.proposers.token_tree import children, select
from specdec.proto import generate_pb2

MAX_GRAMMAR_CHARS = 100_000  # a response_format's schema / regex / grammar text


class ConstraintError(ValueError):
    """A response format the engine cannot use; the message starts with the field."""


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built on first use, ~0.5 s) and the grammar of a request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = self._eos[0] if self._eos else None
                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size, eos_token=eos)
            return self._ll

    def constraint(self, fmt: generate_pb2.ResponseFormat, jump_forward: bool = True) -> "Constraint":
        """The session's constraint, or ConstraintError naming the field. jump_forward=False: forced tokens
        go through the target too (a request for logprobs gets the target's own for them)."""
        field = f"response_format.{fmt.WhichOneof('format')}"
        grammar = grammar_text(fmt)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise ConstraintError(f"{field}: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{field}: {matcher.get_error()}")
        if _allowed(matcher.compute_bitmask()) == 0:
            raise ConstraintError(f"{field}: the grammar allows no token")
        return Constraint(matcher, jump_forward, set(self._eos))


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
    def __init__(self, matcher: llguidance.LLMatcher, jump_forward: bool = True, eos: set[int] = frozenset()) -> None:
        self.matcher = matcher
        self.jump_forward = jump_forward
        self.eos = eos  # a forced EOS ends the output: nothing is forced after it

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
        """The proposal (cut at its first refused draft where that is exact) and the K + 1 masks."""
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
            if not self.matcher.consume_token(t):  # the engine's own limits (a grammar too complex to follow)
                raise RuntimeError(f"structured output: the grammar engine stopped: {self.matcher.get_error()}")
