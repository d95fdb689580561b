"""The EAGLE-3 head (specdec.engine.eagle3): q over the full vocabulary from a reduced draft vocabulary (exact
cases), the published checkpoint layout read and written bit for bit, bad checkpoints refused naming the field,
the target's layer features, and a head at Llama-3.1-8B's shapes built and run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from specdec.engine.eagle3 import (ARCHITECTURE, CheckpointError, HeadCache, default_aux_layers, head_config, load_head,
                                   random_head, write_checkpoint)
from specdec.engine.eagle3_checks import check_checkpoint
from specdec.engine.eagle3_features import from_bytes, target_features, to_bytes, wire_bytes
from specdec.models import ModelConfig, load_model, make_tiny_model
from specdec.math.draft_vocab import d2t_from_target_ids, full_vocab_probs, mapping_error, t2d_mask, target_ids

ROOT = Path(__file__).resolve().parent.parent


# --- the vocabulary map ---------------------------------------------------------------------------------
def test_q_over_the_full_vocabulary_exact():
    d2t = d2t_from_target_ids(torch.tensor([4, 1, 3]))  # draft ids 0, 1, 2 stand for target ids 1, 3, 4
    assert d2t.tolist() == [1, 2, 2]
    assert target_ids(d2t).tolist() == [1, 3, 4]
    q_draft = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    q = full_vocab_probs(q_draft, d2t, vocab_size=6)
    assert q.tolist() == [[0.0, 0.5, 0.0, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert t2d_mask(d2t, 6).tolist() == [False, True, False, True, True, False]
    identity = torch.zeros(4, dtype=torch.long)
    assert torch.equal(full_vocab_probs(q_draft[:, :2].repeat(1, 2), identity, 4), q_draft[:, :2].repeat(1, 2))


def test_reduced_vocabulary_keeps_the_target_law():
    """One speculative step with q from a reduced vocabulary (0 outside it), enumerated exactly: accepting d ~ q with
    min(1, p / q), else drawing from norm(max(0, p - q)), emits each token with probability p, outside tokens too."""
    p = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1], dtype=torch.float64)
    q = full_vocab_probs(torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64), d2t_from_target_ids(torch.tensor([1, 3, 4])), 6)
    accepted = torch.minimum(p, q)  # q(x) min(1, p(x) / q(x))
    residual = (p - q).clamp(min=0)
    law = accepted + (1 - accepted.sum()) * residual / residual.sum()
    torch.testing.assert_close(law, p, rtol=0, atol=1e-15)
    assert q[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]


def test_bad_maps_are_named():
    assert mapping_error(torch.tensor([1, 2, 2]), 6) is None
    assert "outside [0, 4)" in mapping_error(torch.tensor([1, 2, 2]), 4)
    assert "two draft ids" in mapping_error(torch.tensor([1, 0, 2]), 6)  # 1, 1, 4
    assert "dtype" in mapping_error(torch.tensor([1.0, 2.0]), 6)
    assert "one dimension" in mapping_error(torch.zeros(2, 2, dtype=torch.long), 6)


# --- the checkpoint -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_target_model):
    return tiny_target_model  # 2 layers, hidden 64, the SmolLM2 vocabulary


def small_head(target, vocab: int = 64, seed: int = 1, dtype=torch.float32):
    head = random_head(head_config(target.config, vocab, [0, 1, 1]), target.get_input_embeddings(), seed=seed, std=0.2,
                       dtype=dtype)
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:vocab]
    head.d2t = d2t_from_target_ids(ids)
    head.t2d = t2d_mask(head.d2t, head.vocab_size)
    return head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trips_bit_exactly(target, tmp_path, dtype):
    head = small_head(target, dtype=dtype)
    write_checkpoint(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 64 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "embed_tokens.weight" not in stored  # the target's embedding is shared, never written
    assert stored["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # attention over [embedding; feature]
    assert stored["fc.weight"].shape == (64, 3 * 64) and stored["t2d"].dtype == torch.bool
    loaded = load_head(tmp_path, target.config, target.get_input_embeddings())
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    write_checkpoint(loaded, tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()
    # random weights, not the target's: the head's LM head is no row block of the target's
    assert not torch.equal(b["lm_head.weight"].float(), target.lm_head.weight[target_ids(loaded.d2t)])
    ids, feats = torch.tensor([5, 9, 7]), torch.randn(3, 3 * 64)
    out_a = head.float().step(ids, head.fuse(feats), torch.arange(3), HeadCache())
    out_b = loaded.float().step(ids, loaded.fuse(feats), torch.arange(3), HeadCache())
    assert torch.equal(head.q_full(out_a), loaded.q_full(out_b))


def _broken(tmp_path: Path, target, config_edit=None, state_edit=None) -> Path:
    write_checkpoint(small_head(target), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    state = load_file(str(tmp_path / "model.safetensors"))
    if config_edit:
        config_edit(config)
    if state_edit:
        state_edit(state)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize("config_edit, state_edit, names", [
    (None, lambda s: s.pop("d2t"), "d2t is missing"),
    (lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [0, 1, 2]), None,
     "eagle_aux_hidden_state_layer_ids [0, 1, 2]: layer 2 is past the target's depth"),
    (_set("hidden_size", 128), None, "hidden_size 128 does not match the target's hidden_size 64"),
    (_set("target_hidden_size", 96), None, "target_hidden_size 96 does not match the target's hidden_size 64"),
    (_set("draft_vocab_size", 60), None, "draft_vocab_size 60 is inconsistent with d2t, which has 64 entries"),
    (None, lambda s: s.__setitem__("d2t", s["d2t"][:60].clone()), "draft_vocab_size 64 is inconsistent with d2t"),
    (None, lambda s: s.__setitem__("d2t", s["d2t"] + 49152), "d2t: d2t maps draft ids to target ids"),
    (None, lambda s: s.__setitem__("t2d", ~s["t2d"]), "t2d is not the mask"),
    (_set("vocab_size", 32000), None, "vocab_size 32000 does not match the target's vocab_size 49152"),
    (_set("architectures", ["LlamaForCausalLM"]), None, "architectures ['LlamaForCausalLM'] is not an EAGLE-3"),
    (_set("num_hidden_layers", 2), None, "num_hidden_layers 2"),
    (None, lambda s: s.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight is missing"),
    (None, lambda s: s.__setitem__("fc.weight", torch.zeros(64, 128)), "fc.weight has shape (64, 128)"),
])
def test_bad_checkpoints_are_refused_naming_the_field(target, tmp_path, config_edit, state_edit, names):
    path = _broken(tmp_path, target, config_edit, state_edit)
    with pytest.raises(CheckpointError, match="refused") as err:
        load_head(path, target.config, target.get_input_embeddings())
    assert names in str(err.value)


def test_full_vocabulary_head_needs_no_map(target, tmp_path):
    head = random_head(head_config(target.config, target.config.vocab_size, [0, 1, 1]), target.get_input_embeddings())
    write_checkpoint(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop("d2t"), state.pop("t2d")
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_head(tmp_path, target.config, target.get_input_embeddings())
    assert torch.equal(loaded.d2t, torch.zeros(target.config.vocab_size, dtype=torch.long))


def test_a_head_loads_onto_the_device_named_and_leaves_the_targets_embedding_where_it_was(target, tmp_path):
    """Every tensor of the head on the device asked for (here "meta", which any machine has: the checkpoint's tensors
    are read onto the CPU and were once assigned as they came), the shared embedding too, and the target's own
    embedding module untouched (it is the target's, wherever the head goes)."""
    write_checkpoint(small_head(target), tmp_path)
    embedding = target.get_input_embeddings()
    where = embedding.weight.device
    head = load_head(tmp_path, target.config, embedding, device="meta")
    tensors = [*head.parameters(), *head.buffers(), *head._shared[0].parameters()]
    assert {t.device.type for t in tensors} == {"meta"}
    assert embedding.weight.device == where and target.get_input_embeddings() is embedding


def test_a_bfloat16_head_keeps_its_rotary_table_in_float32(target, tmp_path):
    """The rotary table is the target's, float32 whatever the head's dtype (cast with the head, its angles drifted by
    0.14 rad at position 100 and 5.5 at 4,000)."""
    write_checkpoint(small_head(target), tmp_path)
    full = load_head(tmp_path, target.config, target.get_input_embeddings())
    half = load_head(tmp_path, target.config, target.get_input_embeddings(), dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(half.rotary.inv_freq, full.rotary.inv_freq)
    ids = torch.arange(0, target.config.vocab_size, 97)  # the shared table kept in bfloat16: the same rows as cast
    assert half._shared[0].weight.dtype == torch.bfloat16 and torch.equal(half.embed(ids), full.embed(ids).bfloat16())


def test_default_layers_are_low_middle_high():
    assert default_aux_layers(30) == [1, 14, 26]  # the default target
    assert default_aux_layers(32) == [1, 15, 28]  # Llama-3.1-8B
    config = head_config(LlamaConfig(num_hidden_layers=30, hidden_size=64, num_attention_heads=4), 100)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


# --- the head's forward ---------------------------------------------------------------------------------
def test_cached_steps_equal_one_pass(target):
    """Feeding a prefix in pieces through the cache gives what one pass over it gives (and rollback works)."""
    head = small_head(target).double()
    ids, g = torch.randint(0, 1000, (7,)), torch.randn(7, 64, dtype=torch.float64)
    whole = head.step(ids, g, torch.arange(7), HeadCache())
    cache = HeadCache()
    parts = [head.step(ids[a:b], g[a:b], torch.arange(a, b), cache) for a, b in ((0, 3), (3, 4), (4, 7))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)
    cache.truncate(4)
    again = head.step(ids[4:], g[4:], torch.arange(4, 7), cache)
    torch.testing.assert_close(again, whole[4:], rtol=0, atol=1e-12)
    q = head.q_full(whole)
    torch.testing.assert_close(q.sum(-1), torch.ones(7, dtype=q.dtype))
    assert bool((q[:, ~head.t2d] == 0).all())  # outside the draft vocabulary q is exactly 0


# --- the target's features ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    return load_model(ModelConfig(make_tiny_model(tmp_path_factory.mktemp("deep"), seed=2, num_layers=4)))


def test_features_are_the_layer_outputs_16_bit(deep_target):
    target = deep_target
    ids = torch.randint(0, 1000, (2, 9))
    feats, out = target_features(target, ids, [2, 0, 1], output_hidden_states=True)
    assert feats.dtype == torch.bfloat16 and feats.shape == (2, 9, 3 * 64)
    # transformers' hidden_states[i + 1] is layer i's output (below the last layer, which it reports normed)
    expected = torch.cat([out.hidden_states[3], out.hidden_states[1], out.hidden_states[2]], dim=-1)
    assert torch.equal(feats, expected.to(torch.bfloat16))
    assert torch.equal(out.logits, target(ids).logits)  # the forward is the model's own
    rows, _ = target_features(target, ids, [0, 1, 1], rows=torch.tensor([3, 8]), dtype=torch.float16)
    assert rows.dtype == torch.float16 and rows.shape == (2, 2, 192)
    with pytest.raises(ValueError, match="past the model's depth"):
        target_features(target, ids, [0, 1, 4])
    with pytest.raises(ValueError, match="16-bit"):
        target_features(target, ids, [0, 1, 1], dtype=torch.float32)
    assert wire_bytes(576) == 3456 and wire_bytes(4096, layers=1) == 8192


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_features_round_trip_through_bytes(dtype):
    features = torch.randn(5, 192).to(dtype)
    features[0, :3] = torch.tensor([float("inf"), -0.0, float("nan")])
    data = to_bytes(features)
    assert len(data) == 5 * wire_bytes(64)
    back = from_bytes(data, 192, dtype)
    assert torch.equal(back.view(torch.int16), features.view(torch.int16))  # bit for bit, NaN and -0 included
    assert from_bytes(b"", 192).shape == (0, 192)
    with pytest.raises(ValueError, match="whole rows"):
        from_bytes(data[:-2], 192, dtype)
    with pytest.raises(ValueError, match="16-bit"):
        to_bytes(features.float())


# --- Llama-3.1-8B's shapes ------------------------------------------------------------------------------
def test_llama_8b_head_builds_checks_and_runs_on_cpu():
    target = LlamaConfig.from_json_file(ROOT / "bench" / "shapes" / "llama-3-8b" / "config.json")
    config = head_config(target, 32000)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    embedding = torch.nn.Embedding(1024, 4096, dtype=torch.bfloat16)  # a stand-in for the first rows of the target's
    head = random_head(config, embedding, dtype=torch.bfloat16)
    state = head.state_dict()
    assert state["fc.weight"].shape == (4096, 3 * 4096) and state["lm_head.weight"].shape == (32000, 4096)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (4096, 8192)
    assert state["midlayer.self_attn.k_proj.weight"].shape == (1024, 8192)
    check_checkpoint(config, state, target)  # the published layout at these shapes passes the checks
    with torch.no_grad():
        features = torch.randn(4, 3 * 4096, dtype=torch.bfloat16)
        out = head.step(torch.tensor([11, 12, 13, 14]), head.fuse(features), torch.arange(4), HeadCache())
        q = head.q_full(out)
    assert q.shape == (4, 128256)
    torch.testing.assert_close(q.sum(-1), torch.ones(4), atol=1e-4, rtol=0)
    assert bool((q[:, 32000:] == 0).all())
