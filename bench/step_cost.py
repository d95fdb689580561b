"""The cost of a step: forward time against tokens scored and sessions batched, per device, dtype and
step mode, beside the weight-bytes / memory-bandwidth floor, and the K = 0 decode loop against Hugging
Face `generate` at its best settings.

Speculative decoding pays only where scoring K + 1 tokens costs about what one does, so v(T), the time
of a forward that scores T tokens, is the engine's most important curve. For each tier's model this
bench times, in one process and interleaved (so a noisy machine shifts every mode alike):

1. **tokens**: one session with a 100-token prefix, a forward over T = 1, 2, 3, 5, 9, 17, 33 new tokens
   (a verify of K = T - 1 drafts), every T's logits wanted; median of --repeats;
2. **batch**: B = 1, 4, 16, 64 sessions, each feeding 1 token (decode) and 4 tokens (a K = 3 verify);
3. **floor**: the weights' bytes over the memory bandwidth this machine measures (a large copy, bytes
   read plus written): no one-token step can run faster on this device;
4. **decode loop** (target only): N greedy tokens, our runner one token per step (the K = 0 path,
   without the network) against transformers' `generate` eager, and with a static cache and
   torch.compile'd forward (its best settings on this device).

Modes: eager, packed (float32 on an AVX-512 or AVX2 CPU: every linear on specdec's skinny GEMM kernel, a GGUF's
matrices in their blocks), packed-float32 (the same over the GGUF dequantised once to float32:
--no-gguf-blocks), packed-q8_0 (the draft only: its matrices quantised into Q8_0 blocks at load, the draft
tier's default, --quantize auto, on this kernel), packed-onednn
(the packed mode without that kernel: the LM head on oneDNN-packed weights, the layers on the library's
products, as on a CPU without AVX-512 or AVX2), compile (torch.compile, frozen weights) on a CPU; eager and
cuda-graphs (and cuda-graphs-plain, its graphs without fused ops) on CUDA. Writes a section to the month's log in docs/bench-logs/ and docs/bench_step_cost[_gpu_<dtype>].png.

Each mode's row names its weights' format, and its floor is that format's bytes over the bandwidth.

    python -m bench.step_cost [--device cpu] [--dtype float32] [--modes eager,packed,packed-float32,packed-q8_0,packed-onednn,compile] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bench_log, git_commit, gpu_name, machine_info, plot_dir, publish
from bench.propose_cost import propose_cost

TOKENS = (1, 2, 3, 5, 9, 17, 33)
BATCHES = (1, 4, 16, 64)
PREFIX = 100


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bandwidth_probe(device):
    """A callable: bytes read plus written per second by one large device-to-device copy (GB/s), its buffers
    allocated (and touched) once."""
    import torch

    n = 256 * 2**20 // 4  # 256 MiB of float32
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    for _ in range(2):
        dst.copy_(src)
    return lambda: 2 * n * 4 / (median_ms(lambda: dst.copy_(src), 1, device) / 1e3) / 1e9


def bandwidth_gbs(device) -> float:
    """The median of 7 copies' bandwidth_probe (GB/s)."""
    probe = bandwidth_probe(device)
    return statistics.median(probe() for _ in range(7))


def free(device) -> None:
    """Give a dropped model's device memory back before the next one loads (an 8B model is 16 GB)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def weight_bytes(model) -> int:
    """Bytes a forward must stream: every parameter once (a tied embedding / head counts once), and every
    matrix kept in a GGUF's blocks at its quantised bytes (specdec.engine.quant_gemm)."""
    from specdec.engine.quant_gemm import QuantLinear

    seen, total = set(), 0
    tensors = [*model.parameters(), *(m.packed for m in model.modules() if isinstance(m, QuantLinear))]
    for p in tensors:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def weight_format(model) -> str:
    """The weights' format: "float32", or the GGUF block formats its matrices stay in ("Q4_1+Q8_0 blocks")."""
    from specdec.engine.quant_gemm import QuantLinear

    blocks = sorted({m.fmt.name for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(blocks) + " blocks" if blocks else str(next(model.parameters()).dtype).removeprefix("torch.")


def step_config(mode: str, **kw):
    """The StepConfig of a bench mode: a step mode, packed-onednn (packed without the skinny GEMM), or
    cuda-graphs-plain (graphs of the decoder without fused ops: --no-fused-ops)."""
    from specdec.engine.config import StepConfig

    if mode == "packed-onednn":
        return StepConfig(mode="packed", skinny_gemm=False, **kw)
    if mode == "packed-float32":
        return StepConfig(mode="packed", gguf_blocks=False, **kw)
    if mode == "packed-q8_0":
        return StepConfig(mode="packed", quantize="q8_0", **kw)
    if mode == "cuda-graphs-plain":
        return StepConfig(mode="cuda-graphs", fused_ops=False, **kw)
    return StepConfig(mode=mode, **kw)


def load(path: str, device: str, dtype: str, random_weights: bool = False, blocks: bool = False):
    """The model at `path` (a GGUF's matrices in their blocks with `blocks`, as the packed mode serves them:
    specdec.engine.gguf_weights), or with --random-weights one of its shape (config.json alone) with random
    weights made on the device: a step's time depends on shapes, not values (bench/shapes/ holds the default
    target's and an 8B Llama's)."""
    from specdec.engine.gguf_weights import load_model
    from specdec.models import ModelConfig

    cfg = ModelConfig(path, device=device, dtype=dtype)
    if not random_weights:
        return load_model(cfg, blocks=blocks)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=cfg.torch_dtype)
    return model.eval()


def make_runner(path: str, device: str, dtype: str, mode: str, slots: int, random_weights: bool = False):
    import torch

    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.runner import Feed, ModelRunner
    from specdec.engine.step import resolve_mode

    step = step_config(mode, capture_sessions=BATCHES, capture_tokens=(1, 2, 4, 8, 16, 32))
    resolved = resolve_mode(step.mode, torch.device(device))  # `auto` as the tiers resolve it
    model = load(path, device, dtype, random_weights, blocks=resolved == "packed" and step.skinny_gemm and step.gguf_blocks)
    if step.quantize != "none":  # as the draft tier serves it by default (specdec.engine.quantize)
        from specdec.engine.quantize import quantize_model

        quantize_model(model, step.quantize.upper())
    weights = (weight_bytes(model), weight_format(model))  # before a mode packs them (packed weights are no parameters)
    cache = SlotKVCache(KVGeometry.of(model), slots, PREFIX + 64, scratch=resolved == "cuda-graphs")
    t0 = time.perf_counter()
    runner = ModelRunner(model, cache, step)
    for s in range(slots):  # every session holds the same 100-token prefix (prefill chunks run eager-sized)
        runner.forward([Feed(s, 0, list(range(1000, 1000 + PREFIX)), 1)])
    for n in (1, 5):  # compile both graphs (or capture) before timing
        runner.forward([Feed(0, PREFIX, [5] * n, n)])
    return runner, Feed, time.perf_counter() - t0, weights


def measure_model(path: str, device: str, dtype: str, modes: list[str], repeats: int, quick: bool,
                  random_weights: bool = False) -> dict:
    import torch

    dev = torch.device(device)
    batches = BATCHES[:3] if quick else BATCHES
    runners, setup_s, weights = {}, {}, {}
    for mode in modes:
        runners[mode], Feed, setup_s[mode], weights[mode] = make_runner(path, device, dtype, mode, max(batches),
                                                                        random_weights)
    tokens = {m: {t: [] for t in TOKENS} for m in modes}
    batch = {m: {(b, n): [] for b in batches for n in (1, 4)} for m in modes}
    probe, bandwidth = bandwidth_probe(dev), []  # the memory's speed beside each repeat's steps (it drifts)
    for _ in range(repeats):  # interleaved: each round times every mode at every shape once
        bandwidth.append(probe())
        for t in TOKENS:
            for m, r in runners.items():
                tokens[m][t].append(median_ms(lambda: r.forward([Feed(0, PREFIX, [5] * t, t)]), 1, dev))
        for b in batches:
            for n in (1, 4):
                for m, r in runners.items():
                    feeds = [Feed(s, PREFIX, [7] * n, n) for s in range(b)]
                    batch[m][(b, n)].append(median_ms(lambda: r.forward(feeds), 1, dev))
    weights_bytes = {m: weights[m][0] for m in modes}
    # one token / its floor, per repeat (the step against the bandwidth measured just before it), then the median
    floor_ratio = {m: statistics.median(step / (weights_bytes[m] / (gbs * 1e9) * 1e3)
                                        for step, gbs in zip(tokens[m][1], bandwidth)) for m in modes}
    del probe
    result = {"tokens": {m: {t: statistics.median(v) for t, v in d.items()} for m, d in tokens.items()},
              "floor_ratio": floor_ratio, "bandwidth_gbs": statistics.median(bandwidth),
              "batch": {m: {k: statistics.median(v) for k, v in d.items()} for m, d in batch.items()},
              "setup_s": setup_s, "weight_bytes": weights,
              "compile_s": {m: r.compile_s for m, r in runners.items()}}
    runners.clear()
    free(dev)
    return result


def decode_loop(path: str, device: str, dtype: str, modes: list[str], n_tokens: int,
                random_weights: bool = False) -> dict:
    """Tokens/s of N greedy tokens: our runner (per mode) vs transformers' generate eager and compiled."""
    import torch
    import torch._dynamo
    import torch._inductor.config

    dev = torch.device(device)
    prompt = list(range(1000, 1000 + PREFIX))
    out = {}
    for mode in modes:
        runner, Feed, _, _ = make_runner(path, device, dtype, mode, 1, random_weights)
        seq = list(prompt)

        def run():
            del seq[PREFIX:]
            logits = runner.forward([Feed(0, 0, prompt, 1)])[0]
            for i in range(n_tokens):
                nxt = int(logits[-1].argmax())
                seq.append(nxt)
                logits = runner.forward([Feed(0, PREFIX + i, [nxt], 1)])[0]

        run()
        out[f"specdec runner, {mode}"] = n_tokens / (median_ms(run, 3, dev) / 1e3)
        del runner
        free(dev)
    model = load(path, device, dtype, random_weights)
    ids = torch.tensor([prompt], device=dev)
    mask = torch.ones_like(ids)

    def gen(**kw):
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                           do_sample=False, pad_token_id=2, **kw)

    gen()
    out["HF generate, eager"] = n_tokens / (median_ms(gen, 3, dev) / 1e3)
    from transformers import CompileConfig

    label = "HF generate, static cache + torch.compile"
    for freezing in ([True, False] if dev.type == "cpu" else [False]):  # frozen (packed) weights first on a CPU
        config = CompileConfig(fullgraph=True, dynamic=False)
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        torch._inductor.config.freezing = freezing
        torch._dynamo.reset()
        compiled = dict(cache_implementation="static", compile_config=config)
        try:
            gen(**compiled)  # compiles
            out[label + (", frozen weights" if freezing else "")] = n_tokens / (median_ms(lambda: gen(**compiled), 3, dev) / 1e3)
            break
        except Exception as e:  # noqa: BLE001 -- a peer setting that cannot run is reported, not fatal
            out[label + (", frozen weights" if freezing else "")] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    return out


def plot(results: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        for mode, curve in r["tokens"].items():
            ax.plot(list(curve), [curve[t] for t in curve], marker="o", label=mode)
        for floor in sorted(set(r["floor_ms"].values())):
            ax.axhline(floor, color="grey", linestyle="--", label=f"weights / bandwidth ({floor:.1f} ms)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens scored in one forward")
        ax.set_ylabel("ms per forward")
        ax.set_title(f"{name}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--modes", default=None, help="comma list (default: eager,packed,packed-float32,packed-q8_0 (draft only),packed-onednn,compile on CPU; "
                                                 "eager,cuda-graphs-plain,cuda-graphs on CUDA)")
    p.add_argument("--target", default=None, help="target model (default: the shared pair's)")
    p.add_argument("--draft", default=None, help="draft model (default: the shared pair's; '' to skip)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats per figure (default 9; 5 with --quick)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens of the decode-loop comparison (0: skip it)")
    p.add_argument("--random-weights", action="store_true",
                   help="build each model from its config.json with random weights on the device (times depend on "
                        "shapes only; e.g. --target bench/shapes/llama-3-8b --draft '' --dtype bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the tiers' default here)")
    p.add_argument("--quick", action="store_true", help="batches up to 16, 5 repeats unless --repeats says")
    p.add_argument("--out", default=str(bench_log()))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from specdec.models import default_draft, default_target

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    modes = args.modes.split(",") if args.modes else (["eager", "cuda-graphs-plain", "cuda-graphs"] if device.type == "cuda"
                                                       else ["eager", "packed", "packed-float32", "packed-q8_0",
                                                             "packed-onednn", "compile"])
    only_draft = {"packed-q8_0"}  # the draft's weights may be quantised, the target's may not
    repeats = args.repeats or (5 if args.quick else 9)
    bw = bandwidth_gbs(device)
    models = {"target": args.target or default_target()}
    if args.draft != "":
        models["draft"] = args.draft or default_draft()
    results = {}
    for name, path in models.items():
        own = [m for m in modes if name == "draft" or m not in only_draft]
        print(f"measuring {name} ({path}) in {own}", flush=True)
        r = measure_model(path, args.device, args.dtype, own, repeats, args.quick, args.random_weights)
        r["floor_ms"] = {m: nbytes / (r["bandwidth_gbs"] * 1e9) * 1e3 for m, (nbytes, _) in r["weight_bytes"].items()}
        results[name] = r
    decode = (decode_loop(models["target"], args.device, args.dtype, [m for m in modes if m not in only_draft],
                          args.decode_tokens, args.random_weights)
              if args.decode_tokens else {})
    propose_ks, propose_batches = (1, 2, 4, 8), (1, 4)
    draft_mode = "cuda-graphs" if device.type == "cuda" else "auto"
    propose = {}
    if "draft" in models:
        with tempfile.TemporaryDirectory() as tmp:
            draft = models["draft"]
            if args.random_weights:  # the engine loads from a directory: the random draft and the pair's tokenizer
                from specdec.models import load_tokenizer

                load(draft, "cpu", "float32", random_weights=True).save_pretrained(tmp)
                load_tokenizer(default_draft()).save_pretrained(tmp)
                draft = tmp
            propose = propose_cost(draft, args.device, args.dtype, draft_mode, propose_ks, propose_batches, repeats,
                                   PREFIX)

    cmd = "python -m bench.step_cost " + shlex.join(argv if argv is not None else sys.argv[1:])
    info = machine_info()
    machine = (f"GPU {gpu_name(args.device)}" if device.type == "cuda"
               else f"{info['cpu']}, {info['cores']} cores, {args.threads} torch threads")
    machine += f"; torch {info.get('torch')}, transformers {info.get('transformers')}; git {git_commit()}"
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: step cost ({args.device}, {args.dtype})", "",
             f"Command: `{cmd}`. Machine: {machine}; memory bandwidth (copy, read + write) {bw:.1f} GB/s at the "
             f"start. Median of {repeats} interleaved repeats; one session holds a {PREFIX}-token prefix. A floor is a "
             f"model's weights over the bandwidth measured beside its steps (a copy before each repeat: the median "
             f"here); one token / its floor is the median over the repeats of each step against its repeat's "
             f"floor, as the machine's memory speed drifts." +
             (" Random weights of the models' shapes (`--random-weights`: times depend on shapes only)."
              if args.random_weights else ""), ""]
    for name, r in results.items():
        formats = {f"{fmt}, {nbytes / 2**20:.0f} MiB, floor {r['floor_ms'][m]:.2f} ms" for m, (nbytes, fmt) in r["weight_bytes"].items()}
        lines += [f"**{name}**: weights {'; '.join(sorted(formats))} per forward (weights / bandwidth). Start-up "
                  "(load prefix, compile or capture): " + ", ".join(f"{m} {s:.1f} s" for m, s in r["setup_s"].items()) + ".", "",
                  "| mode | weights | " + " | ".join(f"T={t}" for t in TOKENS) + " | one token / its floor | one token / eager's |",
                  "|---|---|" + "---|" * (len(TOKENS) + 2)]
        eager_one = r["tokens"].get("eager", {}).get(1)
        for mode, curve in r["tokens"].items():
            one = curve[1]
            cells = [f"{curve[1]:.1f} ms"] + [f"{curve[t] / one:.2f}x" for t in TOKENS[1:]]
            rel = f"{one / eager_one:.2f}x" if eager_one else "–"
            lines.append(f"| {mode} | {r['weight_bytes'][mode][1]} | " + " | ".join(cells) +
                         f" | {r['floor_ratio'][mode]:.2f}x | {rel} |")
        lines += ["", f"{name}, batched (ms per forward; B sessions x n tokens each):", "",
                  "| mode | " + " | ".join(f"B={b}, n={n}" for (b, n) in next(iter(r["batch"].values()))) + " |",
                  "|---|" + "---|" * len(next(iter(r["batch"].values())))]
        for mode, cells in r["batch"].items():
            lines.append(f"| {mode} | " + " | ".join(f"{v:.1f}" for v in cells.values()) + " |")
        lines.append("")
    if decode:
        lines += [f"Decode loop, target, {args.decode_tokens} greedy tokens after a {PREFIX}-token prompt (tokens/s; "
                  "ours is the runner's K = 0 step loop in-process, without the network):", "",
                  "| path | tok/s |", "|---|---|"]
    for k, v in decode.items():
        lines.append(f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |")
    if propose:
        lines += ["", f"Draft Propose, {draft_mode} steps: ms per Propose of K greedy tokens for B sessions at once "
                  f"(in-process engine, {PREFIX}-token context, the draft tier's default --quantize auto), step by step (`--no-draft-chain`) against the draft "
                  "chain (the default):", "",
                  "| B | " + " | ".join(f"K={k}: steps / chain" for k in propose_ks) + " |",
                  "|---|" + "---|" * len(propose_ks)]
        for b in propose_batches:
            lines.append(f"| {b} | " + " | ".join(f"{propose[(False, b, k)]:.1f} / {propose[(True, b, k)]:.1f} ms "
                                                  f"({propose[(True, b, k)] / propose[(False, b, k)]:.2f}x)"
                                                  for k in propose_ks) + " |")
    suffix = "" if device.type == "cpu" else f"_gpu_{args.dtype}"
    png = plot_dir(args.out) / f"bench_step_cost{suffix}.png" if args.out else None
    if png is not None and plot(results, png, f"step cost, {args.device} {args.dtype}"):
        lines += ["", f"![step cost]({os.path.relpath(png, Path(args.out).resolve().parent)})"]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
