"""Where Triton cannot compile (a read-only root filesystem without a writable TRITON_CACHE_DIR, an image
without a C compiler, a first compile that fails), the CUDA step logs why and runs PyTorch's operators;
the CPU kernels' directory likewise. The conditions are forced for real here (a cache path that cannot be
created, a PATH without a compiler); the CUDA case runs the real kernel modules' decision in a fresh process
(SPECDEC_TEST_DEVICE=cuda: it needs a GPU and Triton)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from specdec.engine import cpu_kernels, triton_env
from tests.helpers import TEST_DEVICE


def unwritable(tmp_path) -> str:
    """A cache path that cannot be created, even by root: its parent is a file."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "triton")


def no_compiler_path(tmp_path) -> str:
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    return str(bare)


def test_the_toolchain_check_names_what_is_missing(tmp_path):
    good = {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "PATH": os.environ["PATH"]}
    assert triton_env.toolchain_problem(good) is None and (tmp_path / "cache").is_dir()
    reason = triton_env.toolchain_problem({**good, "TRITON_CACHE_DIR": unwritable(tmp_path)})
    assert reason.startswith("Triton's cache directory") and "TRITON_CACHE_DIR" in reason
    reason = triton_env.toolchain_problem({**good, "PATH": no_compiler_path(tmp_path)})
    assert reason.startswith("no C compiler")
    assert triton_env.toolchain_problem({**good, "PATH": no_compiler_path(tmp_path), "CC": sys.executable}) is None
    # Triton's default cache is under HOME: a read-only home without TRITON_CACHE_DIR is caught too
    assert "not writable" in triton_env.toolchain_problem({"HOME": unwritable(tmp_path), "PATH": os.environ["PATH"]})


def test_a_failing_first_compile_is_logged_and_refused(tmp_path, caplog):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "PATH": os.environ["PATH"]}

    def first_launch():  # what Triton raises when its launcher cannot be built
        raise RuntimeError("Failed to compile the launcher\ncc1: fatal error: cuda.h: No such file")

    with caplog.at_level(logging.WARNING, logger="specdec.engine.triton_env"):
        reason = triton_env.compile_first("the Triton row ops", first_launch, env)
    assert reason == "compiling them failed: RuntimeError: cc1: fatal error: cuda.h: No such file"
    assert "the Triton row ops unavailable" in caplog.text and "PyTorch's operators" in caplog.text
    ran = []
    assert triton_env.compile_first("the Triton row ops", lambda: ran.append(1), env) is None and ran == [1]
    assert triton_env.compile_first("x", lambda: ran.append(2), {**env, "PATH": no_compiler_path(tmp_path)}) is not None
    assert ran == [1]  # the toolchain is checked first: no launch without it


def test_the_cpu_kernels_directory_is_made_where_failure_is_tolerated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNELS_DIR", unwritable(tmp_path))
    module, reason = cpu_kernels._build()
    assert module is None and reason  # a reason (no AVX-512 or AVX2, or the directory), never an exception


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs a CUDA device (SPECDEC_TEST_DEVICE=cuda)")
def test_cuda_tiers_fall_back_to_pytorch_where_triton_cannot_compile(tmp_path, tiny_target):
    pytest.importorskip("triton")
    script = f"""
import torch
from specdec.engine import triton_attention, triton_row_ops
from specdec.engine.step import graph_decoder
from specdec.models import load_model
from tests.helpers import device_model
device = torch.device("cuda")
rows, attention = triton_row_ops.available(device), triton_attention.available(device, 64)
assert rows and "TRITON_CACHE_DIR" in rows and attention and "TRITON_CACHE_DIR" in attention, (rows, attention)
assert graph_decoder(load_model(device_model({tiny_target!r}))).ops is not triton_row_ops.TritonRowOps
print("fell back:", rows)
"""
    env = {**os.environ, "TRITON_CACHE_DIR": unwritable(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "fell back" in out.stdout, out.stderr[-3000:]
