"""The EAGLE-3 trainer (specdec.training.eagle3): its training-time test computes exactly what the head computes
when drafting over its cache, a short run on a tiny random target lowers the loss and raises the agreement,
the command writes a checkpoint the loader takes back bit for bit, and its prompts are not the benchmark's."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from specdec.engine.config import TierConfig
from specdec.engine.eagle3 import HeadCache, greedy_chain, load_head, write_checkpoint
from specdec.engine.eagle3_features import target_features
from specdec.training import eagle3 as trainer
from specdec.training.eagle3_data import chat_ids, coverage, draft_vocabulary, generated
from specdec.training.prompts import training_prompts
from specdec.models import ModelConfig, eos_token_ids, load_tokenizer

LAYERS = [0, 1, 1]  # the tiny target has two layers


def test_training_time_test_is_the_drafting_computation(tiny_target_model):
    """Row i of step j in one training pass == the head's (j + 1)-th cached draft step after position i, fed
    the true tokens: what the head is trained on is what it will do. To float32's rounding, not float64's:
    transformers' RMSNorm computes in float32 whatever the model's dtype, and how a float32 row's sum of squares
    is vectorised depends on the CPU (AVX-512 and AVX2 machines differ by an ulp here and there); a wrong token,
    position or cache entry moves the outputs by far more."""
    target = tiny_target_model
    d2t = torch.arange(0, 2 * 300, 2) - torch.arange(300)  # target ids 0, 2, 4, ...
    head = trainer.new_head(target, 300, LAYERS, d2t, seed=3).double()
    t, steps = 10, 3
    ids = torch.randint(0, 1000, (1, t))
    features = torch.randn(1, t, 3 * 64, dtype=torch.float64)
    with torch.no_grad():
        outs = list(trainer.ttt_outputs(head, ids, features, steps))
        for i in range(t - steps):
            cache = HeadCache()
            out = head.step(ids[0, 1 : i + 2], head.fuse(features[0, : i + 1]), torch.arange(i + 1), cache)[-1:]
            for j in range(steps):
                torch.testing.assert_close(out[0], outs[j][0, i], rtol=1e-5, atol=1e-7)
                if j + 1 < steps:
                    out = head.step(ids[0, i + j + 2 : i + j + 3], out, torch.tensor([i + j + 1]), cache)


def test_greedy_chain_drafts_what_training_scores(tiny_target_model):
    """The head's greedy chain after a prefix: fed back as the true tokens, the training pass's argmax at the
    prefix's last row, step j, is the chain's token j + 1."""
    target = tiny_target_model
    head = trainer.new_head(target, 300, LAYERS, torch.arange(0, 600, 2) - torch.arange(300), seed=4).double()
    ids, features = torch.randint(0, 1000, (8,)), torch.randn(12, 3 * 64, dtype=torch.float64)
    with torch.no_grad():
        chain = greedy_chain(head, ids, features[:7], 4)
        assert all(t % 2 == 0 for t in chain)  # target ids of the draft vocabulary
        full = torch.cat([ids, torch.tensor(chain[:3])])[None]
        outs = list(trainer.ttt_outputs(head, full, features[None, :11], 4))
    assert [int(head.target_ids(head.logits(o[0, 6]).argmax())) for o in outs] == chain


def test_the_data_is_the_targets_own_answers_features_and_argmaxes(tiny_target, tiny_target_model):
    """Generated on specdec's step with taps, sessions at a time: each greedy answer is transformers' greedy
    generate's, its features the layers' outputs and its argmaxes the logits' of transformers' forward over it;
    a sampled answer is another, the same from its seed whatever else is generated beside it (one at a time too)."""
    target, tok, prompts = tiny_target_model, load_tokenizer(tiny_target), training_prompts(5)
    data = generated(TierConfig(ModelConfig(tiny_target)), tok, prompts, LAYERS, max_new_tokens=12, samples=1, sessions=3)
    assert len(data) == 10 and all(ex.features.dtype == ex.hidden.dtype == torch.bfloat16 for ex in data)
    eos = set(eos_token_ids(target, tok))
    for i, prompt in enumerate(prompts):
        greedy, sampled = data[2 * i], data[2 * i + 1]
        ids = chat_ids(tok, prompt)
        assert greedy.prompt_len == sampled.prompt_len == len(ids) and greedy.ids[: len(ids)].tolist() == ids
        reference = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        cut = next((j + 1 for j, t in enumerate(reference) if t in eos), len(reference))
        assert greedy.ids[len(ids):].tolist() == reference[:cut]
        assert not torch.equal(sampled.ids, greedy.ids)
        with torch.no_grad():
            features, out = target_features(target.base_model, greedy.ids[None], LAYERS)
            logits = target(greedy.ids[None]).logits[0]
        torch.testing.assert_close(greedy.features.float(), features[0].float(), rtol=1e-2, atol=1e-2)  # (bfloat16)
        torch.testing.assert_close(greedy.hidden.float(), out.last_hidden_state[0], rtol=2e-2, atol=2e-2)
        assert torch.equal(greedy.best[len(ids) - 1 :], logits[len(ids) - 1 :].argmax(-1))
    one_at_a_time = generated(TierConfig(ModelConfig(tiny_target)), tok, prompts, LAYERS, max_new_tokens=12, samples=1,
                              sessions=1)
    assert [ex.ids.tolist() for ex in one_at_a_time] == [ex.ids.tolist() for ex in data]
    assert all(torch.equal(a.features, b.features) for a, b in zip(one_at_a_time, data))


def test_tiny_run_lowers_the_loss_and_writes_a_loadable_head(tiny_target, tiny_target_model, tmp_path):
    target = tiny_target_model
    data = generated(TierConfig(ModelConfig(tiny_target)), load_tokenizer(tiny_target), training_prompts(8), LAYERS,
                     max_new_tokens=16)
    assert len(data) == 8 and all(0 < ex.ids.shape[0] - ex.prompt_len <= 16 for ex in data)
    assert data[0].features.dtype == torch.bfloat16 and data[0].features.shape[-1] == 3 * 64
    d2t = draft_vocabulary(data, 128, target.config.vocab_size)
    assert 0 < coverage(data, d2t) < 1 == coverage(data, draft_vocabulary(data, 4096, target.config.vocab_size))
    head = trainer.new_head(target, 128, LAYERS, d2t)
    full = target.get_output_embeddings().weight
    tensors = trainer.batch(data)
    with torch.no_grad():
        before, _ = trainer.ttt_loss(head, *tensors, full, 3)
    agree_before = trainer.agreement(head, data, full)
    losses = trainer.train(head, data, full, ttt_steps=3, epochs=25, batch_size=4, lr=3e-3)
    with torch.no_grad():
        after, _ = trainer.ttt_loss(head, *tensors, full, 3)
    agree_after = trainer.agreement(head, data, full)
    assert len(losses) == 50
    assert float(after) < 0.7 * float(before)
    assert agree_after[0] > agree_before[0] + 0.1

    write_checkpoint(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", target.config, target.get_input_embeddings())
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert trainer.agreement(loaded, data, full) == agree_after


def test_bfloat16_products_train_the_float32_weights(tiny_target, tiny_target_model):
    target = tiny_target_model
    data = generated(TierConfig(ModelConfig(tiny_target)), load_tokenizer(tiny_target), training_prompts(8), LAYERS,
                     max_new_tokens=16)
    d2t = draft_vocabulary(data, 128, target.config.vocab_size)
    head = trainer.new_head(target, 128, LAYERS, d2t)
    full = target.get_output_embeddings().weight
    tensors = trainer.batch(data)
    with torch.no_grad():
        before, _ = trainer.ttt_loss(head, *tensors, full, 3)
    fp32 = trainer.new_head(target, 128, LAYERS, d2t)
    trainer.train(fp32, data, full, ttt_steps=3, epochs=25, batch_size=4, lr=3e-3)
    trainer.train(head, data, full, ttt_steps=3, epochs=25, batch_size=4, lr=3e-3, autocast=torch.bfloat16)
    with torch.no_grad():
        after, _ = trainer.ttt_loss(head, *tensors, full, 3)
        fp32_after, _ = trainer.ttt_loss(fp32, *tensors, full, 3)
    assert all(p.dtype == torch.float32 for p in head.parameters())  # autocast: products only
    assert float(after) < 0.7 * float(before)
    assert abs(float(after) - float(fp32_after)) < 0.15 * float(fp32_after)  # the same training, to bfloat16's precision
    assert not torch.equal(head.fc.weight, fp32.fc.weight)  # (the products really were bfloat16)
    cpu = torch.device("cpu")
    assert trainer.autocast_dtype("float32", cpu) is None and trainer.autocast_dtype("bfloat16", cpu) == torch.bfloat16
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert trainer.autocast_dtype("auto", cpu) == (torch.bfloat16 if native else None)


def test_the_command_writes_a_checkpoint(tiny_target, tiny_target_model, tmp_path):
    out = tmp_path / "head"
    code = trainer.main(["--target", tiny_target, "--out", str(out), "--prompts", "4", "--max-new-tokens", "8",
                         "--draft-vocab", "64", "--layers", "0,1,1", "--epochs", "2", "--batch", "2",
                         "--data", str(tmp_path / "data.pt")])
    assert code == 0 and (tmp_path / "data.pt").exists()
    stored = load_file(str(out / "model.safetensors"))
    assert stored["lm_head.weight"].dtype == torch.bfloat16 and stored["lm_head.weight"].shape == (64, 64)
    head = load_head(out, tiny_target_model.config, tiny_target_model.get_input_embeddings())
    assert head.layer_ids(2) == [0, 1, 1] and head.draft_vocab_size == 64
    again = trainer.main(["--target", tiny_target, "--out", str(tmp_path / "again"), "--draft-vocab", "64",
                          "--layers", "0,1,1", "--epochs", "2", "--batch", "2", "--data", str(tmp_path / "data.pt")])
    assert again == 0  # the data cache is read back; the same seed trains the same head
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_training_prompts_are_not_the_benchmarks():
    from bench.prompts import PROMPTS

    from specdec.training.prompts import chat_prompts

    ours = training_prompts()
    assert len(ours) == len(set(ours)) == 4488
    bench = {p.content for p in PROMPTS}
    assert not bench & set(ours)
    assert training_prompts(20) == ours[:20] and ours[:632] == chat_prompts()  # the first list first, as it was
