"""A draft's LM head over part of the vocabulary (FR-Spec's frequency-ranked drafting; SGLang's token map).

The default draft is mostly its LM head: 49152 x 256 of its 15M weights, a product over the whole vocabulary
every draft step, and its agreement with the target comes almost all from common tokens. Scoring only the
draft vocabulary (the N most frequent tokens) cuts that product by V / N, and every other token gets a logit far
below any real one (FLOOR), so it has q = 0: it is never proposed, and the target's rejection sampling stays
exact for any q (docs/DESIGN.md, Verification). The logits stay [R, V] rows: penalties, logit bias, grammar
masks and the sampler work as before (a grammar that allows only tokens outside the draft vocabulary leaves
them at FLOOR together: q then spreads over them, still as drawn).

Which tokens: `--draft-vocab N` keeps the N lowest ids, with the end-of-sequence ones wherever they are. A BPE
tokenizer numbers its tokens in the order it merged them, most frequent first, so the lowest ids are its most
common tokens (the default pair's measured agreement: docs/performance.md, "A draft vocabulary"); `auto`, the
draft tier's default, keeps the lowest third of a vocabulary over 32,768 tokens; or a file of token ids:
whitespace-, comma- or JSON-separated text, or a torch tensor (`.pt`, as SGLang's `--speculative-token-map`
loads), for a tokenizer whose lowest ids are not what its users write (a multilingual vocabulary serving a
script it merged late): `python -m specdec.training.token_map` writes one from the target's own answers. A target
never runs this (its output must be the reference model's).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from specdec.engine.quant_gemm import QuantLinear, dequantize_rows
from specdec.engine.quantize import quantized

log = logging.getLogger(__name__)

AUTO_ABOVE = 32768  # `auto` keeps the lowest third of a vocabulary larger than this, the whole of a smaller one
FLOOR = -1e30  # a token outside the draft vocabulary: exp(FLOOR - max) is 0, and FLOOR / temperature stays finite


class DraftVocabError(ValueError):
    """--draft-vocab names no usable vocabulary (the draft tier exits 2 with this message)."""


def floor_for(dtype: torch.dtype) -> float:
    """FLOOR in `dtype` (float16's own minimum where FLOOR would overflow it)."""
    return max(FLOOR, torch.finfo(dtype).min)


def vocabulary_ids(spec: str, vocab_size: int, eos: list[int]) -> torch.Tensor | None:
    """The draft vocabulary StepConfig.draft_vocab names, as sorted distinct int64 ids with every EOS id in it;
    None for the whole vocabulary ("0", or at least vocab_size tokens). Raises DraftVocabError saying what is wrong."""
    spec = spec.strip()
    if spec == "auto":  # a large vocabulary's lowest third (SmolLM2's 49,152: 16,384), a whole panel of 16 rows
        spec = str(-(-vocab_size // 48) * 16 if vocab_size > AUTO_ABOVE else 0)
    if re.fullmatch(r"\d+", spec):
        n = int(spec)
        if n == 0 or n >= vocab_size:
            return None
        ids = torch.arange(n)
    else:
        ids = _ids_from_file(Path(spec))
        if ids.numel() == 0:
            raise DraftVocabError(f"--draft-vocab {spec}: the file holds no token ids")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.numel():
            raise DraftVocabError(f"--draft-vocab {spec}: token id {int(bad[0])} is outside the draft's "
                                  f"vocabulary [0, {vocab_size})")
    ids = torch.unique(torch.cat([ids.long(), torch.tensor(eos, dtype=torch.long)]))
    return None if ids.numel() >= vocab_size else ids


def _ids_from_file(path: Path) -> torch.Tensor:
    if not path.is_file():
        raise DraftVocabError(f"--draft-vocab {path}: neither a number of tokens nor a file")
    if path.suffix in (".pt", ".pth"):
        try:
            ids = torch.as_tensor(torch.load(path, weights_only=True))
        except Exception as e:  # (a pickle's own errors, a list of strings, ...)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # (torch's own run on for lines)
            raise DraftVocabError(f"--draft-vocab {path}: not a tensor of token ids torch can read ({why})") from None
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
            raise DraftVocabError(f"--draft-vocab {path}: expected a 1-D integer tensor of token ids, got "
                                  f"{ids.dtype} {tuple(ids.shape)}")
        return ids.long()
    words = re.split(r"[\s,\[\]]+", path.read_text())
    try:
        return torch.tensor([int(w) for w in words if w], dtype=torch.long)
    except ValueError:
        raise DraftVocabError(f"--draft-vocab {path}: expected token ids (integers) separated by spaces, commas or "
                              f"as a JSON list") from None


class DraftVocabHead(torch.nn.Module):
    """logits [R, V]: `inner` (a linear over the draft vocabulary's rows, in `ids`' order) at `ids`, FLOOR elsewhere."""

    def __init__(self, inner: torch.nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.inner, self.vocab_size = inner, vocab_size
        self.register_buffer("ids", ids, persistent=False)
        self.prefix = bool(torch.equal(ids, torch.arange(ids.numel(), device=ids.device)))  # the lowest ids: one slice copy

    @property
    def columns(self) -> int | None:
        """N where the vocabulary is the N lowest ids (a row's other columns are all the floor), else None."""
        return int(self.ids.numel()) if self.prefix else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        small = self.inner(x)
        out = small.new_full((*small.shape[:-1], self.vocab_size), floor_for(small.dtype))
        if self.prefix:
            out[..., : small.shape[-1]] = small
        else:
            out.index_copy_(out.dim() - 1, self.ids, small)
        return out


def vocabulary_head(model) -> DraftVocabHead | None:
    """The model's DraftVocabHead, or None where its LM head scores the whole vocabulary."""
    head = model.get_output_embeddings()
    return head if type(head) is DraftVocabHead else None


def head_product(model) -> torch.nn.Module:
    """The LM head's product: the head itself, or a DraftVocabHead's linear over its rows."""
    head = vocabulary_head(model)
    return head.inner if head is not None else model.get_output_embeddings()


def set_head_product(model, product: torch.nn.Module) -> None:
    """Replace the LM head's product (head_product) by `product`, in place."""
    head = vocabulary_head(model)
    if head is not None:
        head.inner = product
    else:
        model.set_output_embeddings(product)


def restrict_head(model, ids: torch.Tensor | None):
    """`model` with its LM head replaced, in place, by a DraftVocabHead over `ids` (None: as it is). The kept rows
    are the head's own: a float linear's weights, or a quantised head's values in Q8_0 blocks (a Q8_0 head's bitwise;
    any other format's as near as 8 bits hold them: a draft's weights may change, its q is reported as drawn). The
    input embedding keeps the whole table."""
    if ids is None:
        return model
    head = model.get_output_embeddings()
    vocab_size = int(model.config.vocab_size)
    if isinstance(head, QuantLinear):  # (on a CPU)
        rows = torch.nn.Linear(head.in_features, ids.numel(), bias=False)
        rows.weight.data = dequantize_rows(head.packed, head.fmt, ids)
        inner, device = quantized(rows, "Q8_0"), torch.device("cpu")
    elif type(head) is torch.nn.Linear and head.bias is None:
        inner = torch.nn.Linear(head.in_features, ids.numel(), bias=False, device=head.weight.device,
                                dtype=head.weight.dtype)
        device = head.weight.device
        inner.weight.data = head.weight.detach()[ids.to(device)].clone()
    else:
        raise DraftVocabError(f"--draft-vocab: the draft's LM head ({type(head).__name__}) is not a linear without bias")
    model.set_output_embeddings(DraftVocabHead(inner, ids.to(device), vocab_size))
    log.info("--draft-vocab: the LM head scores %d of %d tokens", ids.numel(), vocab_size)
    return model
