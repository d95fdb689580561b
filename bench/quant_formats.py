"""What a decoder layer's products cost in each weight format the CPU kernel serves (specdec.engine.quant_gemm):
float32 panels, Q8_0, Q4_1, the K-quants Q2_K to Q6_K and llama.cpp's Q4_K_M mix, at a model's shapes, random weights.

Per format: the layer's seven matrices (q, k, v, o, gate, up, down; q / k / v and gate / up fused as the
packed step fuses them where their formats agree) multiplied into 1 and into 5 rows, the median over
interleaved repeats, and the floor of the layer's bytes at this machine's copy bandwidth. Whole-model steps are
bench.step_cost's; this isolates the formats at shapes the default target (576 wide: no whole 256-weight
super-blocks) cannot have.

    python -m bench.quant_formats                                  # TinyLlama-1.1B's layer: 2048 wide, FFN 5632
    python -m bench.quant_formats --hidden 4096 --ffn 14336 --kv 1024   # Llama-3-8B's layer
    python -m bench.quant_formats --write-gguf M.gguf --format Q4_K_M --layers 22 --heads 32
        # a whole model of those shapes, random weights, for bench.step_cost --target M.gguf
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import bench_log, git_commit, machine_info, md_table, publish
from bench.step_cost import bandwidth_gbs
from specdec.engine.quant_gemm import FORMATS, QuantLinear, pack
from specdec.engine.skinny_gemm import SkinnyLinear, fused_product
from bench.gguf_models import K_QUANTS, format_of, k_quant_blocks

ROWS = (1, 5)


def matrix(fmt: str, n: int, k: int, seed: int) -> torch.nn.Module:
    """A random [n, k] linear in `fmt` ("float32": SkinnyLinear's panels)."""
    if fmt == "float32":
        lin = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
        return lin
    if fmt in K_QUANTS:
        raw = k_quant_blocks(fmt, n, k, seed)
    else:
        from gguf import GGMLQuantizationType, quants

        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
        raw = quants.quantize(w, GGMLQuantizationType[fmt])
    return QuantLinear(pack(torch.from_numpy(np.ascontiguousarray(raw)), FORMATS[fmt]), FORMATS[fmt], n, k)


def layer(fmt: str, hidden: int, kv: int, ffn: int) -> tuple[list, int]:
    """The layer's products as the packed step runs them ([(product, in_features)]) and its weights' bytes."""
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    mats = {part: matrix(format_of(fmt, part), n, k, seed) for seed, (part, (n, k)) in enumerate(shapes.items())}
    nbytes = sum(m.nbytes() if isinstance(m, QuantLinear) else 4 * m.weight.numel() for m in mats.values())

    def product(parts):
        linears = [mats[p] for p in parts]
        if fmt == "float32":
            return SkinnyLinear(linears)
        return fused_product(linears)

    groups = [("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)]
    return [(product(g), shapes[g[0]][1]) for g in groups], nbytes


def measure(fmts: list[str], hidden: int, kv: int, ffn: int, repeats: int) -> dict:
    layers = {fmt: layer(fmt, hidden, kv, ffn) for fmt in fmts}
    times = {(fmt, m): [] for fmt in fmts for m in ROWS}
    xs = {(m, k): torch.randn(m, k) for m in ROWS for k in {hidden, ffn}}
    for _ in range(repeats):  # interleaved: each repeat times every format once
        for fmt, (products, _) in layers.items():
            for m in ROWS:
                t0 = time.perf_counter()
                for _ in range(5):
                    for prod, k in products:
                        prod(xs[(m, k)])
                times[(fmt, m)].append((time.perf_counter() - t0) / 5 * 1e3)
    return {"ms": {key: statistics.median(v) for key, v in times.items()},
            "bytes": {fmt: nbytes for fmt, (_, nbytes) in layers.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--kv", type=int, default=256, help="the k and v projections' rows (kv heads x head dim)")
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--formats", default="float32,Q8_0,Q4_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q4_K_M")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    p.add_argument("--write-gguf", metavar="PATH", help="instead: write a random Llama GGUF of these shapes in --format "
                   "(the default target's tokenizer, its first 2,048 tokens; a tied embedding) and stop")
    p.add_argument("--format", default="Q4_K_M", help="--write-gguf's weight format (a block format, or Q4_K_M)")
    p.add_argument("--layers", type=int, default=22, help="--write-gguf's decoder layers")
    p.add_argument("--heads", type=int, default=32, help="--write-gguf's attention heads (k / v: --kv / head dim)")
    args = p.parse_args(argv)
    if args.write_gguf:
        from pathlib import Path

        from bench.gguf_models import tokenizer_fields, write_tiny_gguf

        head_dim = args.hidden // args.heads
        write_tiny_gguf(Path(args.write_gguf), args.format, tokenizer_fields(), shape={
            "hidden": args.hidden, "ffn": args.ffn, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv // head_dim})
        print(f"wrote {args.write_gguf}")
        return 0
    fmts = [f.strip() for f in args.formats.split(",") if f.strip()]
    result = measure(fmts, args.hidden, args.kv, args.ffn, args.repeats)
    gbs = bandwidth_gbs(torch.device("cpu"))
    rows = []
    base = result["ms"].get(("float32", 1))
    for fmt in fmts:
        nbytes, one, five = result["bytes"][fmt], result["ms"][(fmt, 1)], result["ms"][(fmt, 5)]
        floor = nbytes / (gbs * 1e9) * 1e3
        rows.append([fmt, f"{nbytes / 2**20:.1f}", f"{floor:.2f}", f"{one:.2f}", f"{one / floor:.1f}x",
                     f"{five:.2f}", f"{five / one:.2f}x", f"{one / base:.2f}x" if base else "-"])
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: a layer's products by weight format", "",
             f"Command: `{shlex.join(['python', '-m', 'bench.quant_formats', *(argv if argv is not None else sys.argv[1:])])}`",
             "", f"- Machine: {machine_info()['cpu']}, {torch.get_num_threads()} torch threads; copy bandwidth {gbs:.1f} "
                 f"GB/s; torch {torch.__version__}; git {git_commit()}",
             f"- One decoder layer of width {args.hidden} (k / v {args.kv} rows, FFN {args.ffn}), random weights: its seven "
             "matrices as the packed step multiplies them (q / k / v and gate / up fused where their formats agree), "
             f"1 and 5 rows, median of {args.repeats} interleaved repeats; the floor is the layer's bytes at the copy "
             "bandwidth.", "",
             *md_table(["format", "MiB a layer", "floor (ms)", "1 row (ms)", "1 row / floor", "5 rows (ms)",
                        "5 rows / 1", "1 row / float32"], rows)]
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
