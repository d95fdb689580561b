"""In-process baselines: the target alone and Hugging Face assisted generation ("the peer").

Runs in a child process (`python -m bench.run --baseline-only SPEC.json`) so that it can pin itself to
one core for the `separate` placement, and so that the parent holds no model while the services run.
The spec names the rows to measure; the result (one JSON file) has per-sample timings and token ids.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from bench.common import DISTURBED


def _log(msg: str) -> None:
    print(f"[baseline] {msg}", file=sys.stderr, flush=True)


def _peak_rss_kib() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes), from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return (f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def own_cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class BackgroundMeter:
    """Fraction of the machine's CPU used by *other* processes over an interval: busy time minus the
    CPU time of our own processes (`own` returns it), over wall time x cores."""

    def __init__(self, own=own_cpu_seconds) -> None:
        self.own = own
        self.reset()

    def reset(self) -> None:
        self.t, self.busy, self.mine = time.perf_counter(), busy_cpu_seconds(), self.own()

    def fraction(self) -> float:
        wall = time.perf_counter() - self.t
        other = (busy_cpu_seconds() - self.busy) - (self.own() - self.mine)
        return max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0




def wait_quiet(max_s: float, own=own_cpu_seconds, threshold: float = DISTURBED) -> float:
    """Sleep in 2 s windows until other processes use <= threshold of the CPU, at most max_s seconds.
    Returns the last reading."""
    deadline = time.perf_counter() + max_s
    while True:
        m = BackgroundMeter(own)
        time.sleep(2.0)
        load = m.fraction()
        if load <= threshold or time.perf_counter() >= deadline:
            return load


class RetryPolicy:
    """Measure a generation again when other processes disturbed it: at most `max_retries` times per
    generation, each after waiting up to `wait_s` for quiet, and no more than `budget_s` seconds of
    waiting + re-measuring in all (so a busy machine slows the bench down by a bounded amount)."""

    def __init__(self, max_retries: int = 1, wait_s: float = 15.0, budget_s: float = 60.0, own=own_cpu_seconds) -> None:
        self.max_retries, self.wait_s, self.budget_s, self.own = max_retries, wait_s, budget_s, own
        self.spent = 0.0
        self.retries = 0
        self._t = None

    def again(self, bg: float, retried: int) -> bool:
        """Call after each measurement; True (after waiting for quiet) means measure again."""
        if self._t is not None:  # the previous retry's measurement counts against the budget
            self.spent += time.perf_counter() - self._t
            self._t = None
        if bg <= DISTURBED or retried >= self.max_retries or self.spent >= self.budget_s:
            return False
        t = time.perf_counter()
        wait_quiet(min(self.wait_s, self.budget_s - self.spent), self.own)
        self.spent += time.perf_counter() - t
        self.retries += 1
        self._t = time.perf_counter()
        return True


def kv_bytes_per_token(config, dtype_bytes: int) -> dict:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": dtype_bytes,
            "bytes_per_token": 2 * layers * kv_heads * head_dim * dtype_bytes,
            "params": None}


class _ForwardCounter:
    """Counts forward calls of a module (target forwards = verification rounds for the peer)."""

    def __init__(self, module) -> None:
        self.calls = 0
        self.module = module
        self._handle = module.register_forward_pre_hook(self._hook)

    def pause(self) -> None:
        """Detach the hook (a compiled forward would trace it, and recompile as the count changes)."""
        self._handle.remove()

    def resume(self) -> None:
        self._handle = self.module.register_forward_pre_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.calls += 1

    def reset(self) -> int:
        n, self.calls = self.calls, 0
        return n


def run_baselines(spec: dict) -> dict:
    """spec: {pin_cpus, threads, target, draft, device, dtype, draft_dtype, max_new_tokens, repeats,
    warmup_tokens, prompts: [{id, workload, messages}], rows: [{key, method, workload, temperature, k}]}
    The target runs on `device` in `dtype` (as the target tier does), the draft in `draft_dtype`."""
    if spec.get("pin_cpus"):
        os.sched_setaffinity(0, set(spec["pin_cpus"]))
    import torch
    import transformers

    from specdec.models import ModelConfig, load_model, load_tokenizer

    transformers.logging.set_verbosity_error()
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    t0 = time.perf_counter()
    tok = load_tokenizer(spec["target"])
    device = spec.get("device", "cpu")
    target = load_model(ModelConfig(spec["target"], device=device, dtype=spec.get("dtype", "float32")))
    from specdec.engine.head_weights import is_head

    # An EAGLE-3 head as specdec's draft: transformers' assisted generation has no use for it (no peer rows)
    draft = None if is_head(spec["draft"]) else load_model(
        ModelConfig(spec["draft"], device=device, dtype=spec.get("draft_dtype") or spec.get("dtype", "float32")))
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        from specdec.engine.runner import use_exact_float32_matmuls

        use_exact_float32_matmuls()  # as the tiers do
    _log(f"models loaded in {time.perf_counter() - t0:.1f}s; torch threads {torch.get_num_threads()}, "
         f"cpus {sorted(os.sched_getaffinity(0))}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}")
    target_calls = _ForwardCounter(target)
    draft_calls = _ForwardCounter(draft) if draft is not None else None
    default_draft_gen = {k: getattr(draft.generation_config, k, None) for k in (
        "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")} if draft is not None else {}

    n_new = int(spec["max_new_tokens"])
    meter = BackgroundMeter()
    retry = RetryPolicy(**spec.get("retry", {}))
    inputs = {}
    for p in spec["prompts"]:
        enc = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        inputs[p["id"]] = (enc["input_ids"].to(device), enc["attention_mask"].to(device))

    # The target alone at its best settings: a static KV cache and a torch.compile'd decode step, the cache
    # sized once for every prompt so that one compiled graph serves them all (weights not frozen: inductor's
    # freezing failed to build a kernel here, see bench.step_cost).
    longest = max(ids.shape[1] for ids, _ in inputs.values()) + n_new + 8

    def compiled_kwargs() -> dict:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, dynamic=False)
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        return dict(cache_implementation="static", compile_config=config, max_cache_len=longest)

    def generate(prompt_id: str, row: dict, n: int, seed: int):
        ids, mask = inputs[prompt_id]
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, use_cache=True,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        temperature = float(row.get("temperature") or 0.0)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        method = row["method"]
        # The peer's schedule: None = the library default (left untouched on the draft's generation
        # config), an int = fixed num_assistant_tokens with the confidence early-stop disabled.
        for key, value in default_draft_gen.items():
            setattr(draft.generation_config, key, value)
        compiled = method == "target" and row.get("variant") == "compiled"
        if method == "peer" and draft is None:
            raise ValueError("the draft is an EAGLE-3 head: transformers' assisted generation needs a draft model")
        if method == "peer":
            kw["assistant_model"] = draft
            if row.get("k"):
                draft.generation_config.num_assistant_tokens = int(row["k"])
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                draft.generation_config.assistant_confidence_threshold = 0.0
        elif method == "peer_lookup":
            kw["prompt_lookup_num_tokens"] = int(row["k"])
        elif compiled:
            kw.update(compiled_kwargs())
        elif method != "target" or row.get("variant"):
            raise ValueError(f"unknown in-process method {method!r} {row.get('variant') or ''}")
        torch.manual_seed(seed)
        target_calls.reset()
        if draft_calls is not None:
            draft_calls.reset()
        meter.reset()
        if compiled:
            target_calls.pause()
        t = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(**kw)
        if on_gpu:
            torch.cuda.synchronize()  # the last kernels have finished: the wall time is the generation's
        dt = time.perf_counter() - t
        new = out[0, ids.shape[1]:].tolist()
        if compiled:
            target_calls.resume()
            target_calls.calls = len(new)  # one forward per token: the prompt's, then one per decode step
        return new, dt, target_calls.reset(), draft_calls.reset() if draft_calls is not None else 0, meter.fraction()

    results = []
    warmed = set()  # one warm-up generation per method (and greedy/sampled), not per row
    for row in spec["rows"]:
        prompts = [p for p in spec["prompts"] if p["workload"] == row["workload"]]
        res = {**row, "samples": [], "error": None}
        try:
            group = (row["method"], row.get("variant", ""), bool(row.get("temperature")))
            if spec.get("warmup_tokens") and group not in warmed:
                generate(prompts[0]["id"], row, int(spec["warmup_tokens"]), seed=0)
                warmed.add(group)
            for rep in range(int(spec["repeats"])):
                for i, p in enumerate(prompts):
                    seed = 1000 * i + rep
                    retried = 0
                    while True:
                        new, dt, t_fwd, d_fwd, bg = generate(p["id"], row, n_new, seed)
                        if not retry.again(bg, retried):
                            break
                        retried += 1
                        _log(f"{row['key']}: {p['id']}: other processes used {bg:.0%} of the CPU; measuring again")
                    res["samples"].append({
                        "prompt_id": p["id"], "repeat": rep, "seed": seed, "generated_tokens": len(new),
                        "prompt_tokens": int(inputs[p["id"]][0].shape[1]), "seconds": dt,
                        "tokens_per_s": len(new) / dt if dt > 0 else 0.0,
                        "target_forwards": t_fwd, "draft_forwards": d_fwd, "background_cpu": bg, "retried": retried, "token_ids": new})
                    _log(f"{row['key']}: {p['id']} rep {rep}: {len(new)} tokens in {dt:.2f}s = {len(new) / dt:.2f} tok/s"
                         + (f" (other processes used {bg:.0%} of the CPU)" if bg > 0.05 else ""))
        except Exception as e:  # one broken row must not sink the run
            res["error"] = f"{type(e).__name__}: {e}"
            _log(f"{row['key']}: ERROR {res['error']}")
        results.append(res)

    models = {}
    for name, model in (("target", target), ("draft", draft)):
        if model is None:  # an EAGLE-3 head: its one layer's KV, as the draft tier holds it (in the draft dtype)
            from types import SimpleNamespace

            from safetensors import safe_open

            with safe_open(str(Path(spec[name]) / "model.safetensors"), framework="pt") as f:
                params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
            config = SimpleNamespace(**json.loads((Path(spec[name]) / "config.json").read_text()))
            dtype_bytes = torch.empty(0, dtype=getattr(torch, spec.get("draft_dtype") or spec.get("dtype", "float32"))).element_size()
            models[name] = {**kv_bytes_per_token(config, dtype_bytes), "params": params, "path": spec[name],
                            "arch": "EAGLE-3 head"}
            continue
        info = kv_bytes_per_token(model.config, next(model.parameters()).element_size())
        info["params"] = sum(p.numel() for p in model.parameters())
        info["path"] = spec[name]
        info["arch"] = type(model).__name__
        models[name] = info
    from specdec.models import eos_token_ids

    return {"rows": results, "models": models, "peak_rss_kib": _peak_rss_kib(), "eos_token_ids": eos_token_ids(target, tok),
            "torch_threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)), "device": device,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "retries": retry.retries, "retry_spent_s": retry.spent,
            "torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "peer_default_schedule": _peer_default_schedule(draft) if draft is not None else {}}


def _peer_default_schedule(draft) -> dict:
    """What assisted generation will use when nothing is set (the draft's config + library defaults)."""
    import copy

    cfg = copy.deepcopy(draft.generation_config)
    try:
        cfg.update(**cfg._get_default_generation_params(), defaults_only=True)
    except Exception:  # private API; report what we can
        pass
    out = {k: getattr(cfg, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    try:
        import sklearn  # noqa: F401  (the threshold only adapts when scikit-learn is installed)
        out["threshold_adapts"] = True
    except ImportError:
        out["threshold_adapts"] = False
    return out


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run_baselines(spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0
