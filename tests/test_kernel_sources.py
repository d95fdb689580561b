"""The CPU kernels' sources compile for every instruction set they are written for (specdec.engine.cpu_kernels'
ISA_FLAGS), whichever the host has: make setup builds and the kernel tests run the host's alone, and code that
only one of simd.h's two halves defines is an error only on the other (a name used under `if constexpr` is looked
up all the same). Syntax only (templates instantiated, no code generated): ~40 s of compiler on 2 cores."""

from __future__ import annotations

import platform
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import get_cxx_compiler, include_paths

from specdec.engine import cpu_kernels

pytestmark = [pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 instruction sets"),
              pytest.mark.slow]  # ~40 s of compiler: make test runs it, make test-fast does not

VECTOR_SOURCES = ["skinny_gemm.cpp", "row_attention.cpp", "row_ops.cpp"]  # the files that include simd.h


def compile_errors(source: str, flags: list[str]) -> str:
    include = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{cpu_kernels.CSRC}"]
    done = subprocess.run([get_cxx_compiler(), "-std=c++17", "-fsyntax-only", "-fopenmp", *flags, *include,
                           str(cpu_kernels.CSRC / source)], capture_output=True, text=True, timeout=600)
    return "" if done.returncode == 0 else "\n".join(line for line in done.stderr.splitlines() if "error" in line)


@pytest.mark.parametrize("isa", sorted(set(cpu_kernels.ISA_FLAGS) - {cpu_kernels.isa()}))
def test_the_sources_compile_for_the_other_instruction_set(isa):
    assert {s for s in cpu_kernels.SOURCES if '"simd.h"' in (cpu_kernels.CSRC / s).read_text()} == set(VECTOR_SOURCES)
    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(VECTOR_SOURCES, pool.map(lambda s: compile_errors(s, cpu_kernels.ISA_FLAGS[isa]), VECTOR_SOURCES)))
    assert not any(errors.values()), errors
