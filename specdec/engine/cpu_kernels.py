"""specdec's CPU kernels (csrc/): compiled once with the host's C++ compiler, then imported with none.

Four float32 kernels serve the packed step mode on a CPU with AVX-512 or AVX2 (csrc/simd.h: one 16-lane vector
type over either, the build's flags picked from what torch reports of the CPU): the skinny GEMM (every linear,
specdec.engine.skinny_gemm; a GGUF's blocks too, specdec.engine.quant_gemm), row attention (each few-token
feed's attention over its own slot, specdec.engine.attention), the row ops (a Llama layer's small operators)
and the decoder (the Llama decoder's layers in one call over the other three; specdec.engine.llama). They are
one torch C++ extension (csrc/kernels.cpp exports them; each file compiled on its own, in parallel), built on
first use (torch.utils.cpp_extension with ninja, ~2 min on 2 cores) into $SPECDEC_KERNELS_DIR (default $SPECDEC_CACHE_DIR/kernels),
in a folder named after the torch version and a hash of the sources and flags; a process that finds the
build there imports it with no compiler at all (`make setup` builds it; the container image ships it).
Without AVX-512 or AVX2 (with FMA and F16C, which every AVX2 CPU has) or without a compiler, load() returns None
and the reason, and the step keeps the libraries' operators.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import time
from pathlib import Path

import torch

from specdec.model_cache import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}  # by torch's CPU capability
STALE_LOCK_S = 600.0  # a build lock older than this was left by a build that died (a build takes ~25 s to 2 min)
SOURCES = ["kernels.cpp", "skinny_gemm.cpp", "row_attention.cpp", "row_ops.cpp", "decoder.cpp"]  # one module
KERNELS = {"skinny_gemm": "the skinny GEMM", "row_attention": "row attention",  # csrc/<name>.cpp: what it is
           "row_ops": "the row ops (RMSNorm with its residual, rotary, SiLU gate)",
           "decoder": "the Llama decoder's layers in one call"}


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU ("AVX512" or "AVX2"), None where neither."""
    capability = torch.backends.cpu.get_cpu_capability()
    return next((name for name in ISA_FLAGS if capability.startswith(name)), None)


def cflags() -> list[str]:
    """The compiler's flags for this CPU's instruction set (-fopenmp: the kernels run on torch's OpenMP threads)."""
    return ["-O3", *ISA_FLAGS[isa() or "AVX2"], "-fopenmp"]


def build_dir() -> Path:
    """Where these sources (every file of csrc/), this CPU's flags and this torch build the kernels."""
    sources = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(cflags()).encode()).hexdigest()[:12]
    root = Path(os.environ.get("SPECDEC_KERNELS_DIR", cache_dir() / "kernels"))
    return root / f"kernels-torch{torch.__version__}-{digest}"


def clear_stale_lock(where: Path, now: float | None = None) -> bool:
    """Remove `where`/lock if a build that died left it (older than STALE_LOCK_S): torch's builder waits on it
    forever otherwise, and the tier hangs at start. True if one was removed."""
    lock = where / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:  # no lock
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("removing %s, left %.0fs ago by a kernel build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build():
    """The compiled extension module of csrc/kernels.cpp, or the reason there is none."""
    if isa() is None:
        return None, f"this CPU has neither AVX-512 nor AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    module_name, where = "specdec_kernels", build_dir()
    built = where / f"{module_name}.so"
    if built.exists():  # built before (by make setup, an earlier process, the image): no compiler needed
        loader = importlib.machinery.ExtensionFileLoader(module_name, str(built))
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(module_name, built, loader=loader))
        loader.exec_module(module)
        return module, None
    from torch.utils.cpp_extension import load as compile_and_load

    try:  # the directory too: a read-only or missing cache path (a container's root filesystem) is a reason, not a crash
        where.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(where)
        return compile_and_load(module_name, [str(CSRC / name) for name in SOURCES], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
                                build_directory=str(where), verbose=False), None
    except Exception as e:  # no writable directory, no compiler, no ninja, a failed build: say why, and run without it
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return None, f"building csrc/ failed: {lines[-1] if lines else type(e).__name__}"


@functools.cache
def _module():
    return _build()


@functools.cache
def load(name: str):
    """(module, None) for kernel `name` (a KERNELS key: the one module holds them all), built on first call;
    (None, why) where unavailable."""
    if name not in KERNELS:
        raise KeyError(f"no CPU kernel {name!r}")
    module, reason = _module()
    if module is None:
        log.warning("%s kernel unavailable (%s): CPU steps use the libraries' operators there", KERNELS[name], reason)
    return module, reason


if __name__ == "__main__":  # `make setup`: build (or explain) each once, so no process pays it later
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for kernel_name, what in KERNELS.items():
        module, why = load(kernel_name)
        print(f"{what} kernel:", "ready" if module is not None else f"unavailable ({why})")
