"""specdec's own Llama container (specdec.engine.llama_weights): what a CPU tier's packed step loads instead of
transformers' modeling classes. Exact cases: a checkpoint's parameters, rotary frequencies and config fields
are transformers' bitwise; the packed step's logits over it are those over transformers' model; configs it
does not hold are left to transformers. In a fresh process: a tier's engine loads the default-shaped tiny
model and a GGUF without importing transformers' modeling code or torch's compiler stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from specdec.engine import gguf_weights, llama_weights
from specdec.engine.config import StepConfig
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import Feed, ModelRunner
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import TEST_DEVICE

FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "pad_token_id",
          "eos_token_id", "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters"]


@pytest.mark.real_pair
def test_a_checkpoint_loads_as_transformers_loads_it(tiny_target, real_pair):
    for path in (tiny_target, real_pair[1]):
        ours, reference = llama_weights.load(path), load_model(ModelConfig(path))
        theirs = dict(reference.named_parameters())
        assert sorted(dict(ours.named_parameters())) == sorted(theirs)
        assert all(torch.equal(p, theirs[name]) for name, p in ours.named_parameters()), path
        assert sorted(ours.state_dict()) == sorted(reference.state_dict())
        assert torch.equal(ours.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
        assert ours.model.rotary_emb.attention_scaling == reference.model.rotary_emb.attention_scaling
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (reference.lm_head.weight is reference.model.embed_tokens.weight)
        assert ours.generation_config.eos_token_id == reference.generation_config.eos_token_id
        config, hf = llama_weights.read_config(path), AutoConfig.from_pretrained(path)
        assert {f: getattr(config, f) for f in FIELDS} == {f: getattr(hf, f) for f in FIELDS}, path


@pytest.mark.real_pair
def test_a_plain_tokenizer_loads_as_autotokenizer_loads_it(tiny_target, real_pair):
    """load_tokenizer reads a tokenizer.json-only class through PreTrainedTokenizerFast: the same vocabulary,
    special tokens, ids and chat template as AutoTokenizer (a tier and the coordinator compare fingerprints)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from specdec.models import tokenizer_fingerprint

    text = "Hello <|im_start|> world, \u00fcn\u00efcode 123\n\tdef f(x): return x"
    for path in (tiny_target, real_pair[1]):
        ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert isinstance(ours, PreTrainedTokenizerFast)
        assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs)
        assert ours(text).input_ids == theirs(text).input_ids and ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids)
        assert ours.chat_template == theirs.chat_template and ours.eos_token_id == theirs.eos_token_id


def test_configs_it_does_not_hold_are_left_to_transformers(tiny_target, tmp_path):
    raw = json.loads((Path(tiny_target) / "config.json").read_text())
    for change in ({"model_type": "mistral"}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                   {"hidden_act": "gelu"}, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        assert llama_weights.read_config(tmp_path) is None, change
    assert llama_weights.read_config(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="not a plain Llama"):
        llama_weights.load(tmp_path)


def test_a_missing_or_extra_tensor_is_refused(tiny_target, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((Path(tiny_target) / name).read_text())
    state = load_file(str(next(Path(tiny_target).glob("*.safetensors"))))
    save_file({k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.up_proj"):
        llama_weights.load(tmp_path)
    save_file({**state, "model.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*model.extra"):
        llama_weights.load(tmp_path)


def test_a_checkpoint_without_safetensors_loads_through_transformers(tiny_target, tmp_path):
    """A pytorch_model.bin checkpoint: the container reads safetensors only, so the packed step's loader hands
    it to transformers."""
    reference = load_model(ModelConfig(tiny_target))
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((Path(tiny_target) / name).read_text())
    torch.save({k: v.clone() for k, v in reference.state_dict().items()}, tmp_path / "pytorch_model.bin")
    model = gguf_weights.load_model(ModelConfig(str(tmp_path)), blocks=True, light=True)
    assert type(model).__module__.startswith("transformers.")
    assert all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in model.named_parameters())
    light = gguf_weights.load_model(ModelConfig(tiny_target), blocks=True, light=True)
    assert type(light) is llama_weights.LlamaForCausalLM


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the container serves the CPU's packed step")
def test_the_packed_step_over_it_is_the_step_over_transformers_model(tiny_target):
    logits = []
    for model in (llama_weights.load(tiny_target), load_model(ModelConfig(tiny_target))):
        runner = ModelRunner(model, SlotKVCache(KVGeometry.of(model), 2, 128), StepConfig(mode="packed"))
        slot = runner.cache.allocate()
        prompt = [1, 17, 530, 42, 9, 1200, 7]
        first = runner.forward([Feed(slot, 0, prompt, 1)])[0]
        logits.append(torch.cat([first, runner.forward([Feed(slot, len(prompt), [88, 3, 301], 3)])[0]]))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.real_pair
@pytest.mark.processes
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the container serves the CPU's packed step")
def test_a_tier_loads_without_transformers(tiny_target, real_pair):
    """A fresh interpreter (the tests' own has imported everything): a tier's imports and the engine's load of a
    checkpoint directory and of a GGUF in its blocks (its index and its tokenizer's facts cached by an earlier
    load) import no transformers at all (~20 MiB of a tier), nor torch's compiler stack (the draft tier's entry
    point neither: an EAGLE-3 head's modules load only for a head), and, with their matrices in blocks (as the
    draft tier's --quantize auto), keep no checkpoint file mapped."""
    gguf_weights.load_blocks(gguf_weights.gguf_file(real_pair[0]))  # indexes it once, if no earlier load did
    for path in (tiny_target, real_pair[0]):
        TokenizerSource.at(path)
    script = (
        "import sys\n"
        "import target_service.__main__, draft_service.__main__\n"
        "from specdec.engine.engine import Engine\n"
        "from specdec.engine.config import StepConfig, TierConfig\n"
        "from specdec.models import ModelConfig\n"
        f"for path in ({tiny_target!r}, {real_pair[0]!r}):\n"
        "    engine = Engine.load(TierConfig(model=ModelConfig(path), step=StepConfig(quantize='auto'), cost_curve_s=0.0))\n"
        "    print(type(engine.runner.model).__module__)\n"
        "    engine.close()\n"
        "print(sorted(m for m in ('transformers', 'tokenizers', 'torch._dynamo', 'sympy') if m in sys.modules))\n"
        "print(sum('.safetensors' in line or '.gguf' in line for line in open('/proc/self/maps')))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["specdec.engine.llama_weights", "specdec.engine.llama_weights", "[]", "0"], out.stdout
