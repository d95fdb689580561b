"""The llama.cpp peer row of bench.run: the same GGUF and prompts through llama-cpp-python, greedy, where it
is importable. A CPU user serving a GGUF would pick llama.cpp; it computes a different function (it
quantises the activations to 8 bits for its dot products), so its tokens are not the reference model's:
this row is about speed only.

llama-cpp-python ships as a source distribution for this platform (no wheel on the package index this
project installs from): `make llama-cpp` builds llama.cpp with CMake (~12 minutes on 2 shared cores) and
installs it, which `make setup` does not. Without it the row says so, plainly.
"""

from __future__ import annotations

import statistics
import time


def measure(target: str, prompt_ids: dict[str, list[int]], max_new_tokens: int, threads: int) -> dict:
    """{"tok_s": median tokens/s over the prompts, "per_prompt": {...}, "version": ...} or {"error": why}."""
    from specdec.engine.gguf_weights import gguf_file

    path = gguf_file(target)
    if path is None:
        return {"error": f"the target {target} is not a GGUF file"}
    try:
        import llama_cpp
    except ImportError:
        return {"error": "llama-cpp-python is not installed (a source build: `make llama-cpp`)"}
    longest = max(len(ids) for ids in prompt_ids.values()) + max_new_tokens + 8
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=longest, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    rates = {}
    for name, ids in prompt_ids.items():
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(prompt=ids, max_tokens=max_new_tokens, temperature=0.0, top_k=1)
        n = int(out["usage"]["completion_tokens"])
        rates[name] = n / (time.perf_counter() - t0)
    return {"tok_s": statistics.median(rates.values()), "per_prompt": rates, "version": llama_cpp.__version__,
            "threads": threads}


def section_lines(result: dict, specdec_k0: float | None) -> list[str]:
    """The peer row's lines for bench.run's section (specdec_k0: specdec's K = 0 tok/s in the same run)."""
    if "error" in result:
        return [f"llama.cpp peer (same GGUF and prompts): not measured: {result['error']}.", ""]
    ratio = f"; specdec K = 0 / llama.cpp = {specdec_k0 / result['tok_s']:.2f}x" if specdec_k0 else ""
    return [f"llama.cpp peer (llama-cpp-python {result['version']}, {result['threads']} threads, the same GGUF and "
            f"prompts, greedy, end to end per prompt incl. its prefill): median {result['tok_s']:.1f} tok/s{ratio}. "
            "It computes with 8-bit activations: not the reference model's tokens.", ""]
