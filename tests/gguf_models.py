"""Tiny Llama GGUFs written by the tests with gguf-py's own writer and quantiser, in any block format it can
quantise: the default target's tokenizer (its GGUF metadata, copied), random weights, a tied embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from specdec.models import default_target

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2  # 2 layers of width 64, like make_tiny_model's


def tokenizer_fields(vocab: int = 2048) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """(key, value, type, element type) of the default target GGUF's tokenizer metadata (~5 s to read), its
    vocabulary cut to the first `vocab` tokens (the specials, the bytes and the first merges' results) and
    its merges to those within them: a working BPE tokenizer whose GGUF arrays transformers and gguf-py
    read ~20x faster than the full 49,152 tokens (each read of the full arrays takes seconds)."""
    target = next(Path(default_target()).glob("*.gguf"))
    fields = {}
    for field in GGUFReader(str(target)).fields.values():
        if field.name.startswith("tokenizer."):
            array = field.types[0] == GGUFValueType.ARRAY
            fields[field.name] = (field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        name, value, vtype, sub_type = fields[key]
        fields[key] = (name, value[:vocab], vtype, sub_type)
    kept = set(fields["tokenizer.ggml.tokens"][1])
    name, merges, vtype, sub_type = fields["tokenizer.ggml.merges"]
    fields[name] = (name, [m for m in merges if set(m.split(" ")) | {m.replace(" ", "")} <= kept], vtype, sub_type)
    return list(fields.values())


def write_tiny_gguf(path: Path, fmt: str, tokenizer: list, seed: int = 0) -> str:
    """A 2-layer Llama with every matrix (the tied embedding too) in block format `fmt`; returns its path."""
    vocab = len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    g = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    qtype = GGMLQuantizationType[fmt]

    def matrix(name: str, rows: int, cols: int, scale: float = 0.3) -> None:
        w = (g.standard_normal((rows, cols)) * scale).astype(np.float32)
        writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * g.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", vocab, HIDDEN, 1.0)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", HIDDEN // HEADS * KV_HEADS, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", HIDDEN // HEADS * KV_HEADS, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
