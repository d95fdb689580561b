"""A draft quantised into Q8_0 blocks at load (specdec.engine.quantize; the draft service's default).

Exact cases: every float32 matrix becomes Q8_0 blocks whose values are gguf-py's quantise-then-dequantise of the
checkpoint's, bitwise (the tied embedding reads the head's blocks), and the packed step's logits are bitwise
those of the same step over a float32 model holding those values: the tier serves exactly a Q8_0 draft. Where
the step is not on the block kernel the weights stay float32, and a log line says why (for the draft tier's
default, auto, silently). Settings: the draft tier quantises by default; the target refuses (exit 2, naming the flag). End to end through real servers: with
a quantised draft, greedy output is still the target's own, token for token, and a quantised copy of the target
drafting for it keeps most of its drafts (the quantisation moves few argmaxes).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.client import Client
from specdec.engine import quantize as quantize_module
from specdec.engine.config import StepConfig
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.quant_gemm import QuantEmbedding, QuantLinear
from specdec.engine.quantize import quantize, quantize_model
from specdec.engine.runner import Feed, ModelRunner
from specdec.models import ModelConfig, load_model
from tests.helpers import Cluster, needs_cpu_kernels, reference_greedy

needs_kernel = needs_cpu_kernels("Q8_0 blocks (served on the skinny GEMM)")

PROMPTS = [[1, 9038, 2115, 253, 1345], [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]]


def packed_logits(model, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, SlotKVCache(KVGeometry.of(model), 2, 64), StepConfig(mode="packed"))
    return runner.forward([Feed(0, 0, ids, len(ids))])[0]


@needs_kernel
def test_matrices_become_q8_0_blocks_that_the_step_serves_bitwise(tiny_target):
    from gguf import GGMLQuantizationType, dequantize

    checkpoint, model, twin = (load_model(ModelConfig(tiny_target)) for _ in range(3))
    count = quantize_model(model)
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert count == len(blocks) == 1 + 7 * 2 and all(m.fmt.name == "Q8_0" for m in blocks.values())
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    assert model.get_output_embeddings() is model.get_input_embeddings().table  # one table, as a GGUF's
    assert all(p.dim() == 1 for p in model.parameters()), "only the norms stay float32 parameters"
    # The twin holds gguf-py's dequantised values in float32: what a GGUF of the draft in Q8_0 would load as
    for name, linear in blocks.items():
        name = "lm_head" if name.endswith(".table") else name  # the embedding's and the head's one table
        source = checkpoint.get_submodule(name)
        raw = quantize_module.quantize_blocks(source.weight)
        want = torch.from_numpy(np.asarray(dequantize(raw.numpy(), GGMLQuantizationType.Q8_0), dtype=np.float32))
        assert torch.equal(linear.dequantized(), want), name
        assert not torch.equal(want, source.weight), "Q8_0 changes the values (else this test proves nothing)"
        twin.get_submodule(name).weight.data.copy_(want)
    ids = PROMPTS[1]
    assert torch.equal(packed_logits(model, ids), packed_logits(twin, ids))


@needs_kernel
def test_a_gguf_in_its_blocks_needs_nothing_quantised_and_keeps_no_file_mapped(tiny_target, real_pair):
    """A GGUF served from its blocks as the draft (the draft tier's --quantize auto): nothing is left to quantise
    (this crashed on its tied head in blocks); a checkpoint quantised at load lets its file's memory map go (a
    norm's few bytes had kept all of it resident)."""
    from specdec.engine import gguf_weights, llama_weights

    model = gguf_weights.load_blocks(gguf_weights.gguf_file(real_pair[0]))
    assert quantize_model(model) == 0
    checkpoint = llama_weights.load(tiny_target)  # as a CPU draft tier loads it: zero-copy from the file's map
    mapped = [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in open("/proc/self/maps")
              if str(Path(tiny_target).resolve() / "model.safetensors") in line]
    assert mapped and any(lo <= p.data_ptr() < hi for p in checkpoint.parameters() for lo, hi in mapped)
    assert quantize_model(checkpoint) > 0
    assert not any(lo <= p.data_ptr() < hi for p in checkpoint.parameters() for lo, hi in mapped)


def test_off_the_block_kernel_the_weights_stay_float32_and_a_log_line_says_why(tiny_target, caplog):
    model = load_model(ModelConfig(tiny_target))
    with caplog.at_level(logging.WARNING, logger=quantize_module.__name__):
        out = quantize(model, "q8_0", ModelConfig("tiny", device="cpu", dtype="float32"), on_kernel=False)
    assert out is model and not any(isinstance(m, QuantLinear) for m in model.modules())
    assert "--quantize q8_0 not applied" in caplog.text and "skinny GEMM" in caplog.text
    caplog.clear()
    assert quantize(model, "auto", ModelConfig("tiny", device="cuda"), on_kernel=True) is model  # auto: no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert quantize(model, "none", ModelConfig("tiny"), on_kernel=True) is model


def test_the_draft_tier_quantizes_by_default_and_the_target_refuses(capsys):
    import draft_service.__main__ as draft_main
    import target_service.__main__ as target_main
    from specdec.serving.flags import service_parser

    draft = draft_main.settings()
    config = draft.parse(service_parser(draft, ""), [], environ={})["config"]
    assert config.tier.step.quantize == "auto"
    assert draft.parse(service_parser(draft, ""), ["--quantize", "none"], environ={})["config"].tier.step.quantize == "none"
    target = target_main.settings()
    assert target.parse(service_parser(target, ""), [], environ={})["config"].tier.step.quantize == "none"
    with pytest.raises(SystemExit) as exit_:
        target.parse(service_parser(target, ""), [], environ={"SPECDEC_TARGET_QUANTIZE": "q8_0"})
    assert exit_.value.code == 2
    assert "--quantize 'q8_0' would make the target another model than the reference" in capsys.readouterr().err


@needs_kernel
@pytest.mark.servers
def test_a_quantized_draft_keeps_the_target_greedy_output_and_most_drafts(tiny_target, tiny_target_model):
    cluster = Cluster(tiny_target, tiny_target, draft_quantize="q8_0")  # the target's Q8_0 copy drafts for it
    try:
        assert any(isinstance(m, QuantLinear) for m in cluster.draft_tier.runner.model.modules())
        assert not any(isinstance(m, QuantLinear) for m in cluster.target_tier.runner.model.modules())
        with Client(cluster.address) as client:
            accepted = drafted = 0
            for prompt in PROMPTS:
                for k in (2, 5):
                    out = client.generate(token_ids=prompt, max_new_tokens=40, num_speculative_tokens=k,
                                          proposer="draft")
                    assert out.token_ids == reference_greedy(tiny_target_model, prompt, 40, [2])
                    accepted, drafted = accepted + out.stats["accepted_tokens"], drafted + out.stats["draft_tokens"]
        assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)  # 0.78 measured; a random draft: < 0.1
    finally:
        cluster.close()


@needs_kernel
def test_an_eagle3_head_quantized_serves_its_q8_0_blocks_bitwise(tiny_head, tiny_target, tiny_target_model):
    """A feature draft takes the same setting: its fc, layer and LM head in Q8_0 blocks on the kernel give bitwise
    the logits of a float32 head holding the blocks' values (both on the kernel), and HeadEngine.load applies it."""
    from gguf import GGMLQuantizationType, dequantize

    from specdec.engine.config import TierConfig
    from specdec.engine.eagle3 import load_head
    from specdec.engine.head_engine import HeadEngine
    from specdec.engine.head_weights import pack_linears
    from tests.helpers import device_model

    embedding = tiny_target_model.get_input_embeddings()
    head, twin = (load_head(tiny_head, tiny_target_model.config, embedding) for _ in range(2))
    linears = [name for name, m in twin.named_modules() if type(m) is torch.nn.Linear]
    for name in linears:
        w = twin.get_submodule(name).weight
        raw = quantize_module.quantize_blocks(w).numpy()
        w.data.copy_(torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType.Q8_0), dtype=np.float32)))
    assert pack_linears(head, "q8_0") and pack_linears(twin, "none")
    assert all(isinstance(head.get_submodule(name), QuantLinear) for name in linears) and len(linears) >= 7
    out = torch.randn(3, head.norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    features = torch.randn(3, head.fc.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.logits(out), twin.logits(out)) and torch.equal(head.fuse(features), twin.fuse(features))
    engine = HeadEngine.load(TierConfig(device_model(tiny_head), cost_curve_s=0, step=StepConfig(quantize="auto")),
                             tiny_target)
    try:
        assert isinstance(engine.head.lm_head, QuantLinear)
    finally:
        engine.close()
