"""Llama GGUFs with random weights, written with gguf-py's own writer and quantiser in any block format it can
quantise, and in the K-quants Q4_K, Q5_K and Q6_K (which gguf-py reads but cannot write: random super-blocks,
every byte a valid value): the default target's tokenizer (its GGUF metadata, copied), a tied embedding. Tiny
ones for the tests (tests/test_gguf_blocks.py), ones of real shapes for the benches (bench.quant_formats)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from specdec.models import default_target

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2  # 2 layers of width 64, like make_tiny_model's
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # rows of whole 256-weight super-blocks: such a model is 256 wide (FFN 512)
# llama.cpp's Q4_K_M mix, as its quantiser assigns it to a small model: Q6_K for the value and down projections
# and the (here tied) embedding table, Q4_K for the rest
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


def format_of(fmt: str, tensor: str) -> str:
    """The block format of GGUF tensor `tensor` ("blk.0.attn_v.weight", or just "attn_v") in a model of format
    `fmt`: `fmt` itself, or for "Q4_K_M" the mix's."""
    return fmt if fmt != "Q4_K_M" else next((f for part, f in Q4_K_M.items() if part in tensor), "Q4_K")


def k_quant_blocks(fmt: str, n: int, k: int, seed: int = 0, scale: float = 0.1, integers: bool = False) -> np.ndarray:
    """Random K-quant bytes (Q2_K to Q6_K) [n, k / 256 * super-block bytes] of weights about +-scale: random quants,
    scales and minima, float16 factors set so that the values stay in range. integers: every weight a small
    integer (Q4_K: d = dmin = 1, sc = 1, m = 8: q - 8 in [-8, 7]; Q5_K: m = 16, [-16, 15]; Q6_K: d = 1, scales 1:
    [-32, 31]; Q3_K: d = 1, scales 1: [-4, 3]; Q2_K: d = dmin = 1, sc = 1, m = 2: [-2, 1])."""
    g = np.random.default_rng(seed)
    ns = k // 256

    def f16(values) -> np.ndarray:
        return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(n, ns, 2)

    if fmt in ("Q4_K", "Q5_K"):  # d, dmin, then 6-bit scales and minima as gguf-py's get_scale_min unpacks them
        size, top, hi, mix = (144, 15, 8, 0x81) if fmt == "Q4_K" else (176, 31, 0x50, 0x01)  # m = 8 / 16 (integers)
        b = g.integers(0, 256, (n, ns, size), dtype=np.uint8)
        if integers:
            b[..., 0:2], b[..., 2:4] = f16(np.ones((n, ns, 1))), f16(np.ones((n, ns, 1)))
            b[..., 4:8], b[..., 8:12], b[..., 12:16] = 1, hi, mix  # sc = 1 and that m in all 8 sub-blocks
        else:
            b[..., 0:2] = f16(scale / (63 * top) * g.uniform(0.5, 1.5, (n, ns, 1)))
            b[..., 2:4] = f16(scale / 63 * g.uniform(0.0, 1.0, (n, ns, 1)))
    elif fmt == "Q3_K":  # hmask, 2-bit quants, 12 bytes of 6-bit scales (stored + 32), d
        b = g.integers(0, 256, (n, ns, 110), dtype=np.uint8)
        if integers:
            b[..., 96:104], b[..., 104:108], b[..., 108:110] = 0x11, 0xAA, f16(np.ones((n, ns, 1)))  # every scale 33 - 32
        else:
            b[..., 108:110] = f16(scale / (32 * 4) * g.uniform(0.5, 1.5, (n, ns, 1)))
    elif fmt == "Q2_K":  # 4-bit scales and minima, 2-bit quants, d, dmin
        b = g.integers(0, 256, (n, ns, 84), dtype=np.uint8)
        if integers:
            b[..., :16], b[..., 80:82], b[..., 82:84] = 0x21, f16(np.ones((n, ns, 1))), f16(np.ones((n, ns, 1)))
        else:
            b[..., 80:82] = f16(scale / (15 * 3) * g.uniform(0.5, 1.5, (n, ns, 1)))
            b[..., 82:84] = f16(scale / 15 * g.uniform(0.0, 1.0, (n, ns, 1)))
    elif fmt == "Q6_K":
        b = g.integers(0, 256, (n, ns, 210), dtype=np.uint8)
        if integers:
            b[..., 192:208], b[..., 208:210] = 1, f16(np.ones((n, ns, 1)))
        else:
            b[..., 208:210] = f16(scale / (127 * 32) * g.uniform(0.5, 1.5, (n, ns, 1)))
    else:
        raise ValueError(f"not a K-quant: {fmt}")
    return b.reshape(n, -1)


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


def write_tiny_gguf(path: Path, fmt: str, tokenizer: list, seed: int = 0, shape: dict | None = None) -> str:
    """A 2-layer Llama with every matrix (the tied embedding too) in block format `fmt` (or "Q4_K_M": Q4_K and Q6_K
    mixed as llama.cpp mixes them); returns its path. A K-quant's model is 256 wide with an FFN of 512 (whole
    super-blocks), 4 heads of 64. shape: any of hidden, ffn, layers, heads, kv_heads instead (bench.quant_formats
    writes models of real shapes)."""
    vocab = len(next(value for key, value, _, _ in tokenizer if key == "tokenizer.ggml.tokens"))
    g = np.random.default_rng(seed)
    k_quant = fmt in K_QUANTS or fmt == "Q4_K_M"
    hidden, ffn = (256, 512) if k_quant else (HIDDEN, FFN)
    shape = {"hidden": hidden, "ffn": ffn, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, **(shape or {})}
    hidden, ffn, layers, heads, kv_heads = (shape[key] for key in ("hidden", "ffn", "layers", "heads", "kv_heads"))
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    qtype = GGMLQuantizationType[fmt] if fmt != "Q4_K_M" else None

    def matrix(name: str, rows: int, cols: int, scale: float = 0.3) -> None:
        if k_quant:
            kind = format_of(fmt, name)
            writer.add_tensor(name, k_quant_blocks(kind, rows, cols, int(g.integers(1 << 30)), scale),
                              raw_dtype=GGMLQuantizationType[kind])
            return
        w = (g.standard_normal((rows, cols)) * scale).astype(np.float32)
        writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * g.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, 1.0)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", hidden // heads * kv_heads, hidden)
        matrix(f"blk.{i}.attn_v.weight", hidden // heads * kv_heads, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
