"""Every step mode computes the same function as the eager forward, and bounds its own cost.

Modes under test on a CPU: eager, packed (oneDNN-packed linears), compile (torch.compile with frozen
weights) and `static` (the CUDA-graph step's fixed-shape attention and buffers, run uncaptured). On a
GPU (SPECDEC_TEST_DEVICE=cuda) the static step is captured and replayed as CUDA graphs. Each is checked
against transformers' own forward with a NaN-filled KV pool (tests/test_runner.py's cases, all modes),
against the eager runner on random ragged batches, and end to end through real servers.
"""

from __future__ import annotations

import pytest
import torch

from specdec.client import Client
from specdec.engine.config import StepConfig
from specdec.engine.cuda_graphs import Bucket, kv_sizes, next_size
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import Feed, ModelRunner
from specdec.engine.step import resolve_mode
from specdec.models import load_model
from tests.helpers import TEST_DEVICE, Cluster, device_model, reference_greedy
from tests.step_modes import make_runner

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

CUDA = TEST_DEVICE.startswith("cuda")




def test_compiled_step_compiles_two_graphs_for_every_shape(tiny_random_draft):
    """T = 1 and T >= 2 (with any number of logits rows) share two graphs: no recompile per shape. (A
    model no other test compiles, so that its graphs are counted from none.)"""
    from torch._dynamo.utils import counters

    runner = make_runner(tiny_random_draft, "compile", slots=4)
    before = counters["stats"]["unique_graphs"]
    slot = runner.cache.allocate()
    runner.forward([Feed(slot, 0, list(range(3, 40)), 0)])  # a prefill chunk with no logits
    for cached, n, rows in [(37, 1, 1), (38, 2, 2), (40, 5, 1), (45, 9, 9), (54, 17, 3), (71, 3, 0)]:
        runner.forward([Feed(slot, cached, list(range(5, 5 + n)), rows)])
    runner.forward([Feed(slot, 74, [7, 8, 9], 3), Feed(runner.cache.allocate(), 0, [1, 2], 1)])  # a batch
    assert counters["stats"]["unique_graphs"] - before == 2
    assert runner.compile_s > 0


def test_buckets():
    assert next_size((1, 2, 4, 8), 3) == 4 and next_size((1, 2, 4, 8), 8) == 8 and next_size((1, 2, 4), 5) is None
    assert kv_sizes(1000) == (128, 256, 512, 1000) and kv_sizes(128) == (128,)


def test_steps_that_fit_no_bucket_run_eager(tiny_target):
    runner = make_runner(tiny_target, "static", slots=4)
    graphs = runner.graphs
    assert graphs.bucket([Feed(0, 10, [1] * 3, 3)]) == Bucket(1, 4, 128)
    assert graphs.bucket([Feed(0, 200, [1], 1), Feed(1, 0, [1, 2], 1)]) == Bucket(2, 2, 256)
    assert graphs.bucket([Feed(0, 0, [1] * 17, 1)]) is None  # a prefill chunk: more tokens than any bucket
    assert graphs.bucket([Feed(i, 0, [1], 1) for i in range(9)]) is None  # more sessions than any bucket


def test_static_step_pads_into_the_scratch_slot_only(tiny_target):
    """Padding tokens of a bucketed step write the scratch slot and nothing else."""
    runner = make_runner(tiny_target, "static", slots=4, slot_tokens=160)
    cache = runner.cache
    a, b = cache.allocate(), cache.allocate()
    runner.forward([Feed(a, 0, [5, 6, 7], 1)])  # a 3-token step: bucket n = 4, S = 1
    untouched = cache.keys[0][b].clone()
    runner.forward([Feed(a, 3, [8], 1)])
    assert torch.equal(cache.keys[0][b].isnan(), untouched.isnan())  # session b's slot: still all NaN
    assert torch.isfinite(cache.keys[0][a, :, :4]).all()
    assert cache.scratch_slot == 4 and cache.free_slots == 2  # the scratch slot is never handed out


def test_kv_pool_reports_what_it_holds(tiny_target):
    model = load_model(device_model(tiny_target))
    geometry = KVGeometry.of(model)
    assert SlotKVCache.slots_for_budget(geometry, 256, 10 * 256 * geometry.bytes_per_token + 5) == 10
    cache = SlotKVCache(geometry, 4, 256)
    runner = ModelRunner(model, cache, StepConfig(mode="eager"))
    assert cache.resident_bytes == (0 if geometry.device.type == "cpu" else cache.capacity_bytes)
    slot = cache.allocate()
    runner.forward([Feed(slot, 0, list(range(3, 53)), 1)])
    if geometry.device.type == "cpu":  # pages are committed as positions are first written
        assert cache.resident_bytes == 50 * geometry.bytes_per_token
    assert cache.capacity_bytes == 4 * 256 * geometry.bytes_per_token


def test_mode_resolution():
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) in ("packed", "compile")
    assert resolve_mode("eager", cpu) == "eager"
    with pytest.raises(ValueError, match="cuda-graphs needs a CUDA device"):
        resolve_mode("cuda-graphs", cpu)
    with pytest.raises(ValueError, match="step mode must be one of"):
        resolve_mode("fast", cpu)


@pytest.fixture(scope="module")
def compiled_cluster(tiny_target):
    """The target as its own draft, both tiers compiled (CUDA graphs on a GPU); the two engines share one
    model and so one compile."""
    cluster = Cluster(tiny_target, tiny_target, step=StepConfig(mode="cuda-graphs" if CUDA else "compile"))
    yield cluster
    cluster.close()


PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]


@pytest.mark.parametrize("k", [0, 1, 4, None])
def test_compiled_tiers_greedy_equal_generate(compiled_cluster, tiny_target_model, k):
    expected = reference_greedy(tiny_target_model, PROMPT, 40, [2])
    with Client(compiled_cluster.address) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=k, proposer="draft")
    assert out.token_ids == expected
    if not CUDA:
        assert compiled_cluster.target_tier.runner.model is compiled_cluster.draft_tier.runner.model


def test_compiled_tiers_sample_what_eager_tiers_sample(compiled_cluster, self_draft_cluster):
    """Seeded sampling: the same tokens whichever way the tiers run their steps. The compiled step rounds its
    products otherwise than the kernels do, so p differs in its last bits: top_k keeps each draw among a few
    tokens, whose keyed race a last-bit difference does not turn (over the thousands of a flat nucleus, a draw
    lands within such a difference of a boundary about once in a hundred tokens, with any sampler)."""
    runs = []
    for cluster in (compiled_cluster, self_draft_cluster):
        with Client(cluster.address) as client:
            runs.append([client.generate(token_ids=PROMPT, max_new_tokens=32, num_speculative_tokens=k,
                                         proposer="draft", temperature=0.9, top_k=5, seed=seed).token_ids
                         for seed in (1, 2, 3) for k in (3, 0)])
    assert runs[0] == runs[1]
    assert all(runs[1][i] == runs[1][i + 1] for i in (0, 2, 4))  # (and K = 3 draws what K = 0 draws)


def test_packed_mode_keeps_what_onednn_cannot_pack(tiny_target):
    """The packed mode packs the LM head, and in bfloat16 / float16 the decoder's linears as well (float32
    layers stay on the library's own product). A float16 weight on a CPU without AVX-512 FP16 cannot be
    packed: it stays a plain linear, the same function. Either way the model computes what the plain
    one does."""
    from specdec.engine.packed import PackedLinear, pack_head, pack_layers
    from specdec.models import ModelConfig, load_model

    ids = torch.tensor([[5, 17, 300, 42, 9]])
    for dtype in ("float32", "bfloat16", "float16"):
        plain = load_model(ModelConfig(tiny_target, dtype=dtype))
        model = load_model(ModelConfig(tiny_target, dtype=dtype))
        packed = pack_head(model)
        layers = pack_layers(model)
        head = model.get_output_embeddings()
        assert packed == isinstance(head, PackedLinear)
        if dtype == "float32":  # oneDNN packs float32 on every CPU torch supports
            assert packed
        linears = 7 * len(model.model.layers)  # q, k, v, o, gate, up, down
        n_packed = sum(isinstance(m, PackedLinear) for m in model.model.modules())
        assert n_packed == layers and layers in ((0,) if dtype == "float32" else (0, linears))
        if dtype == "bfloat16" and torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX-512 BF16 / AMX
            assert layers == linears
        with torch.inference_mode():
            got, want = model(ids).logits.float(), plain(ids).logits.float()
        tol = 1e-5 if dtype == "float32" else 2e-2
        assert torch.allclose(got, want, atol=tol, rtol=tol), (dtype, float((got - want).abs().max()))
