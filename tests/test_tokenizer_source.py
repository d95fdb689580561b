"""specdec.models.TokenizerSource: what a tier keeps of its model's tokenizer (the fingerprint, the EOS id, a
way to load it) instead of the tokenizer. Exact cases: the cached facts are the loaded tokenizer's; a second
tier reads them without loading it; a changed tokenizer file is read afresh; a tier's grammar cache loads the
tokenizer at its first grammar, once, and a tier that sees no grammar never does."""

from __future__ import annotations

import os
import shutil

import llguidance
import pytest

import specdec.models as models
from specdec.engine.config import TierConfig
from specdec.engine.engine import Engine
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import device_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def no_load(path):
    raise AssertionError(f"the tokenizer at {path} was loaded")


@pytest.mark.real_pair
def test_the_facts_are_the_tokenizers_and_a_second_tier_reads_them_without_it(tiny_target, real_pair, cache, monkeypatch):
    for path in (tiny_target, real_pair[0]):  # a checkpoint directory; the GGUF's own tokenizer
        loaded = TokenizerSource.of(load_tokenizer(path))
        first = TokenizerSource.at(path)
        assert (first.fingerprint, first.eos_token_id) == (loaded.fingerprint, loaded.eos_token_id)
        with monkeypatch.context() as m:
            m.setattr(models, "load_tokenizer", no_load)
            again = TokenizerSource.at(path)  # from the cache: nothing loaded
        assert (again.fingerprint, again.eos_token_id) == (loaded.fingerprint, loaded.eos_token_id)
        assert first.load().get_vocab() == load_tokenizer(path).get_vocab()  # loads on demand
    assert len(list(cache.glob("tokenizer-facts-*.json"))) == 2


def test_a_changed_tokenizer_is_read_afresh(tiny_target, tmp_path, cache, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    before = TokenizerSource.at(str(model))
    config = model / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token": "<|im_end|>"', '"eos_token": "<|endoftext|>"'))
    os.utime(config, (1, 1))  # another time as well as another size
    after = TokenizerSource.at(str(model))
    assert after.eos_token_id != before.eos_token_id
    assert after.eos_token_id == load_tokenizer(str(model)).eos_token_id
    # the old facts, which no key can find again, went when the new ones were written
    assert len(list(cache.glob("tokenizer-facts-*.json"))) == 1


def test_a_tier_loads_the_tokenizer_only_for_its_first_grammar(tiny_target):
    loads = []
    tokenizer = load_tokenizer(tiny_target)
    source = TokenizerSource.of(tokenizer)
    counted = TokenizerSource(source.fingerprint, source.eos_token_id, lambda: loads.append(1) or tokenizer)
    engine = Engine(TierConfig(ModelConfig("tiny")), load_model(device_model(tiny_target)), counted)  # not started
    assert engine.tokenizer_fingerprint == source.fingerprint and loads == []
    assert engine.grammars.check(llguidance.LLMatcher.grammar_from_regex("yes|no")) == "" and loads == [1]
    assert engine.grammars.check(llguidance.LLMatcher.grammar_from_regex("[0-9]+")) == "" and loads == [1]  # llguidance's own, kept
    assert engine.grammars.matcher(llguidance.LLMatcher.grammar_from_regex("yes|no"), []) is not None


def test_an_unwritable_cache_costs_a_load_not_the_start(tiny_target, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be: mkdir fails
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocked / "cache"))
    source = TokenizerSource.at(tiny_target)
    assert source.fingerprint == TokenizerSource.of(load_tokenizer(tiny_target)).fingerprint
