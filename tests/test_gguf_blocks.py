"""A GGUF served from its blocks (specdec.engine.gguf_weights): tiny Llama GGUFs written here in each block
format the kernel computes (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), llama.cpp's Q4_K_M mix of the last two, and one
format it does not (Q5_0, held in float32). Exact cases: the
loaded weights are transformers' float32 load of the same file bitwise, with no float32 copy of a block
matrix, and the packed step's logits are bitwise those of the same step over that float32 load. End to end:
greedy output through real servers equals transformers' generate() on the float32 load, token for token."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.client import Client
from specdec.engine import gguf_weights
from specdec.engine.config import StepConfig
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.quant_gemm import FORMATS, QuantEmbedding, QuantLinear
from specdec.engine.runner import Feed, ModelRunner
from specdec.models import ModelConfig, load_model, load_tokenizer, make_tiny_model
from bench.gguf_models import tokenizer_fields, write_tiny_gguf
from tests.helpers import Cluster, needs_cpu_kernels, reference_greedy

pytestmark = needs_cpu_kernels("GGUF blocks (served on the skinny GEMM)")


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, str]:
    """{format: path} of a tiny GGUF in each format (one tokenizer read for all; its first 2,048 tokens)."""
    where, tokenizer = tmp_path_factory.mktemp("ggufs"), tokenizer_fields()
    return {fmt: write_tiny_gguf(where / f"tiny-{fmt}.gguf", fmt, tokenizer, seed=i)
            for i, fmt in enumerate([*sorted(FORMATS), "Q5_0", "Q4_K_M"])}


@pytest.fixture(scope="module")
def random_draft(tiny_ggufs, tmp_path_factory) -> str:
    """A tiny random-init draft with the GGUFs' tokenizer (the coordinator refuses a pair whose tokenizers differ)."""
    return make_tiny_model(tmp_path_factory.mktemp("gguf-draft"), seed=1, tokenizer=load_tokenizer(tiny_ggufs["Q4_0"]))


# token ids below 2,048 (tokenizer_fields() keeps the first 2,048 tokens)
PROMPTS = [[1, 1690, 198, 683, 359, 253, 1356, 1646, 11], [1, 504, 1458, 282, 1649, 314, 198]]


def runner(model) -> ModelRunner:
    return ModelRunner(model, SlotKVCache(KVGeometry.of(model), 4, 256), StepConfig(mode="packed"))


@pytest.mark.parametrize("fmt", [*sorted(FORMATS), "Q5_0"])
def test_weights_are_the_float32_loads_bitwise_and_blocks_stay_blocks(tiny_ggufs, fmt, caplog):
    with caplog.at_level(logging.WARNING, logger=gguf_weights.__name__):
        model = gguf_weights.load_blocks(gguf_weights.gguf_file(tiny_ggufs[fmt]))
    reference = load_model(ModelConfig(tiny_ggufs[fmt]))
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if fmt == "Q5_0":  # not a format the kernel computes: float32, the reference's values, and said so
        assert not blocks and "Q5_0" in caplog.text and "float32" in caplog.text
    else:  # every matrix in blocks (the tied head and the embedding share one), no float32 copy of any
        assert isinstance(model.get_input_embeddings(), QuantEmbedding)
        assert model.get_output_embeddings() is model.get_input_embeddings().table
        assert len(blocks) == 1 + 7 * 2 and all(m.fmt.name == fmt for m in blocks.values())
        assert all(p.dim() == 1 for p in model.parameters()), "only the norms are float32 parameters"
        for name, linear in blocks.items():
            shared = name.endswith(".table")  # the embedding's and the head's one table
            want = reference.get_input_embeddings().weight if shared else reference.get_submodule(name).weight
            assert torch.equal(linear.dequantized(), want), name
        ids = torch.arange(0, reference.config.vocab_size, 97)
        assert torch.equal(model.get_input_embeddings()(ids), reference.get_input_embeddings()(ids))
    for name, p in model.named_parameters():
        assert torch.equal(p, reference.get_parameter(name)), name
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_packed_step_over_blocks_is_bitwise_the_step_over_the_float32_load(tiny_ggufs, fmt):
    """The same prefill, verify and decode through both: the block kernel is the float32 kernel term for term."""
    blocks = runner(gguf_weights.load_blocks(gguf_weights.gguf_file(tiny_ggufs[fmt])))
    floats = runner(load_model(ModelConfig(tiny_ggufs[fmt])))
    assert blocks.program.skinny and floats.program.skinny
    prompt = [1, 1690, 198, 683, 359, 253, 1356, 1646, 11, 2, 198] * 3
    for step in ([Feed(0, 0, prompt, 1)], [Feed(0, len(prompt), [28, 29, 30, 31, 32], 5)],
                 [Feed(0, len(prompt) + 5, [33], 1), Feed(1, 0, prompt[:7], 2)]):
        for got, want in zip(blocks.forward(step), floats.forward(step), strict=True):
            assert torch.equal(got, want), fmt


@pytest.mark.servers
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_greedy_through_real_servers_equals_the_float32_reference(tiny_ggufs, random_draft, fmt):
    target = tiny_ggufs[fmt]
    cluster = Cluster(target, random_draft)
    try:
        assert isinstance(cluster.target_tier.runner.model.get_output_embeddings(), QuantLinear)
        reference = load_model(ModelConfig(target))
        with Client(cluster.address) as c:
            for prompt in PROMPTS:
                expected = reference_greedy(reference, prompt, 24, [2])
                for k in (0, 3):
                    out = c.generate(token_ids=prompt, max_new_tokens=24, num_speculative_tokens=k, proposer="draft")
                    assert out.token_ids == expected, (fmt, k, prompt)
    finally:
        cluster.close()


def test_a_q4_k_m_mix_is_served_from_its_blocks_bitwise(tiny_ggufs, random_draft):
    """Q4_K_M (Q4_K, with Q6_K for the value and down projections and the tied table): every matrix in its own
    format's blocks, the weights and the packed step's logits bitwise the float32 load's, and greedy output through
    real servers transformers' own, with and without drafts."""
    path = tiny_ggufs["Q4_K_M"]
    model, reference = gguf_weights.load_blocks(gguf_weights.gguf_file(path)), load_model(ModelConfig(path))
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert {m.fmt.name for m in blocks.values()} == {"Q4_K", "Q6_K"} and len(blocks) == 1 + 7 * 2
    assert all(m.fmt.name == "Q6_K" for name, m in blocks.items() if "v_proj" in name or "down_proj" in name)
    for name, linear in blocks.items():
        want = reference.get_input_embeddings().weight if name.endswith(".table") else reference.get_submodule(name).weight
        assert torch.equal(linear.dequantized(), want), name
    expected = reference_greedy(reference, PROMPTS[1], 24, [2])
    step = [Feed(0, 0, PROMPTS[0] * 2, 1)]  # (a runner takes its model's linears into its products: last)
    for got, want in zip(runner(model).forward(step), runner(reference).forward(step), strict=True):
        assert torch.equal(got, want)
    cluster = Cluster(path, random_draft)
    try:
        with Client(cluster.address) as c:
            for k in (0, 3):
                assert c.generate(token_ids=PROMPTS[1], max_new_tokens=24, num_speculative_tokens=k,
                                  proposer="draft").token_ids == expected, k
    finally:
        cluster.close()
