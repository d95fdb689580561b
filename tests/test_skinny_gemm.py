"""The skinny GEMM kernel (specdec.engine.skinny_gemm): exact cases, closeness to float64 products, and batch
invariance (a row's result is bitwise the same alone, among others, at any place among them, and with its
weights fused with other linears'); the packed step mode runs float32 models on it."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import skinny_gemm
from specdec.engine.skinny_gemm import SkinnyLinear
from specdec.engine.step import MovedLinear, StepProgram, skinny_applies
from specdec.models import ModelConfig, load_model
from tests.helpers import needs_cpu_kernels

# The kernel needs AVX-512 or AVX2 (every x86-64 CPU of the last decade has one) and a compiler: make setup builds it,
# and a build that fails fails these tests. Without either the packed mode keeps oneDNN's products (test_step_program).
pytestmark = needs_cpu_kernels("the skinny GEMM kernel")


def linear(n_out: int, n_in: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out, bias=bias)


def test_the_kernel_is_built():
    assert skinny_gemm.kernel() is not None, skinny_gemm.unavailable()


def test_exact_on_integers():
    """Small integers: every partial sum is exact in float32, so the product must equal the true one."""
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 1, 1), (3, 65, 17), (7, 130, 33), (13, 64, 100)]:
        lin = torch.nn.Linear(k, n, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randint(-8, 9, (n, k), generator=g).float())
            lin.bias.copy_(torch.randint(-8, 9, (n,), generator=g).float())
        x = torch.randint(-8, 9, (m, k), generator=g).float()
        want = (x.long() @ lin.weight.long().T + lin.bias.long()).float()
        assert torch.equal(SkinnyLinear([lin])(x), want), (m, n, k)


@pytest.mark.parametrize("n_out,n_in", [(1, 5), (63, 16), (64, 64), (65, 100), (200, 576), (576, 1536)])
def test_close_to_float64_at_every_row_count(n_out, n_in):
    lin = linear(n_out, n_in, bias=True)
    fast = SkinnyLinear([lin])
    for m in (*range(1, 14), 40, 129):
        x = torch.randn(m, n_in)
        want = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
        got = fast(x)
        assert got.shape == (m, n_out) and got.dtype == torch.float32
        bound = 4 * n_in * torch.finfo(torch.float32).eps * (x.abs().double() @ lin.weight.abs().double().T + 1)
        assert bool(((got.double() - want).abs() <= bound).all()), (m, float((got.double() - want).abs().max()))


def test_a_row_is_the_same_alone_among_others_and_anywhere_among_them():
    fast = SkinnyLinear([linear(300, 576)])
    x = torch.randn(37, 576)
    together = fast(x)
    for i in range(37):
        assert torch.equal(fast(x[i : i + 1]), together[i : i + 1]), i
    for m in (2, 3, 5, 9, 17):  # the rows in other blocks: the first row at every place of an m-row product
        for place in range(m):
            others = torch.randn(m, 576)
            others[place] = x[0]
            assert torch.equal(fast(others)[place], together[0]), (m, place)


def test_fused_linears_give_bitwise_their_separate_products():
    q, k, v = linear(576, 576, seed=1), linear(192, 576, seed=2), linear(100, 576, bias=True, seed=3)
    fused = SkinnyLinear([q, k, v])
    x = torch.randn(9, 576)
    parts = fused.split(fused(x))
    assert [p.shape[-1] for p in parts] == [576, 192, 100]
    for part, lin in zip(parts, (q, k, v)):
        assert torch.equal(part, SkinnyLinear([lin])(x))


def test_leading_dimensions_and_strided_rows():
    lin = linear(70, 48, bias=True)
    fast = SkinnyLinear([lin])
    x = torch.randn(2, 3, 48)
    assert torch.equal(fast(x), fast(x.reshape(6, 48)).reshape(2, 3, 70))
    wide = torch.randn(5, 100)
    rows = wide[:, 10:58]  # rows 100 floats apart
    assert torch.equal(fast(rows), fast(rows.contiguous()))
    cols = torch.randn(48, 6).T  # stride(-1) == 6: copied first, not read wrongly
    assert torch.equal(fast(cols), fast(cols.contiguous()))
    assert fast(torch.randn(0, 48)).shape == (0, 70)


def test_bad_inputs_are_refused_with_a_message():
    ops = skinny_gemm.kernel()
    packed = ops.skinny_pack(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match="float32"):
        ops.skinny_linear(torch.randn(2, 8, dtype=torch.float64), packed, 10, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.skinny_linear(torch.randn(2, 9), packed, 10, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.skinny_linear(torch.randn(2, 8), packed, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.skinny_linear(torch.randn(2, 8), packed, 10, torch.zeros(9))
    with pytest.raises(ValueError, match="same in_features"):
        SkinnyLinear([linear(4, 8), linear(4, 9)])
    with pytest.raises(ValueError, match="float32"):
        SkinnyLinear([linear(4, 8).to(torch.bfloat16)])


def test_packed_mode_runs_float32_models_on_the_kernel(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    assert skinny_applies(model) is None
    program = StepProgram(model, kind="packed")
    assert program.skinny and isinstance(program.head, SkinnyLinear)
    moved = [m for m in model.base_model.modules() if isinstance(m, MovedLinear)]
    assert len(moved) == 7 * model.config.num_hidden_layers  # q k v o gate up down: their weights now packed
    with pytest.raises(RuntimeError, match="moved"):
        moved[0](torch.zeros(1, moved[0].in_features))
    again = StepProgram(model, kind="packed")  # another engine on the same model shares the packed decoder
    assert again.skinny and again.decoder is program.decoder and again.head is program.head
    with pytest.raises(ValueError, match="load it again"):
        StepProgram(model, kind="packed", use_skinny_gemm=False)
    off = StepProgram(load_model(ModelConfig(tiny_target)), kind="packed", use_skinny_gemm=False)
    assert not off.skinny and not isinstance(off.head, SkinnyLinear)
    assert "turned off" in skinny_applies(load_model(ModelConfig(tiny_target)), enabled=False)
    assert "bfloat16" in skinny_applies(load_model(ModelConfig(tiny_target, dtype="bfloat16")))


def test_a_build_lock_left_by_a_dead_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's builder waits forever on a lock a killed build left: cpu_kernels removes one older than
    STALE_LOCK_S (and never a build's own, younger one)."""
    from specdec.engine.cpu_kernels import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # none there
    lock.touch()
    assert not clear_stale_lock(tmp_path, now=lock.stat().st_mtime + STALE_LOCK_S / 2) and lock.exists()
    assert clear_stale_lock(tmp_path, now=lock.stat().st_mtime + STALE_LOCK_S + 1) and not lock.exists()
