"""Whether Triton's kernels can be compiled here, decided once per kernel family before a step uses them.

Triton compiles a kernel at its first launch: it writes to its cache directory (TRITON_CACHE_DIR, else
~/.triton/cache) and builds a small C launcher with the host's C compiler. In a container with a read-only
root filesystem, or an image without a compiler, that first launch raises inside the first step (or the
CUDA-graph capture) and the tier dies. Here the same conditions are checked first, and the kernels'
first compile is tried on a few rows (compile_first), so that where anything is missing the tier logs why
once and its decoder runs PyTorch's operators: slower, the same outputs (docs/deployment.md, GPU images).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

COMPILERS = ("cc", "gcc", "clang")  # what Triton looks for when CC is unset


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where Triton writes its compiled kernels: TRITON_CACHE_DIR, else ~/.triton/cache (Triton's default)."""
    return Path(environ.get("TRITON_CACHE_DIR") or Path(environ.get("HOME") or Path.home()) / ".triton" / "cache")


def toolchain_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why Triton could not compile a kernel here (no writable cache directory, no C compiler), or None."""
    cache = cache_dir(environ)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, prefix=".probe-"):
            pass
    except OSError as e:
        return (f"Triton's cache directory {cache} is not writable ({e.strerror or e}): "
                "point TRITON_CACHE_DIR at a writable volume")
    cc = environ.get("CC")
    found = shutil.which(cc, path=environ.get("PATH")) if cc else None
    found = found or next((p for p in (shutil.which(c, path=environ.get("PATH")) for c in COMPILERS) if p), None)
    if found is None:
        return (f"no C compiler ({'CC=' + cc if cc else ', '.join(COMPILERS)} not on PATH), which Triton needs "
                "to build its kernels' launcher: use an image with one (deploy/Dockerfile's CUDA build has gcc)")
    return None


def compile_first(what: str, probe: Callable[[], None], environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the kernels `what` cannot run here, or None once probe() (a first launch of each, on a few rows)
    has compiled and run them; logged where they cannot (the caller then uses PyTorch's operators; the
    kernel modules decide once per process and device). Any failure counts (a missing compiler, a
    read-only cache, a PTX the driver refuses): a tier that would crash at its first step runs slower."""
    reason = toolchain_problem(environ)
    if reason is None:
        try:
            probe()
        except Exception as e:  # noqa: BLE001 - whatever the first compile raises, the step must not
            lines = [line for line in str(e).strip().splitlines() if line.strip()]
            reason = f"compiling them failed: {type(e).__name__}: {lines[-1] if lines else ''}"
    if reason is not None:
        log.warning("%s unavailable (%s): the step runs PyTorch's operators there", what, reason)
    return reason
