"""The cache directory keeps what no key can find again for no longer than the next entry written
(specdec.model_cache): exact cases over files in a temporary directory, then a GGUF's float32 copy as a tier makes it."""

from __future__ import annotations

import json
import os
import time

import pytest

from specdec import model_cache
from specdec.model_cache import SOURCES, files_key, prune, publish_dir, publish_json


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entry(cache, model, name: str = "gguf-m") -> str:
    """Publish the entry derived from file `model`, as the loaders do; its name."""
    where = cache / f"{name}-{files_key([model])}"
    publish_dir(where, lambda tmp: (tmp.mkdir(parents=True), (tmp / "model.safetensors").write_bytes(b"w" * 64)),
                [model])
    return where.name


def test_an_entry_records_its_sources_and_is_found_again_while_they_stand(cache, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"blocks")
    name = entry(cache, model)
    assert json.loads((cache / name / SOURCES).read_text()) == [[str(model.resolve()), 6, int(model.stat().st_mtime)]]
    assert entry(cache, model) == name and (cache / name / "model.safetensors").exists()
    assert prune(cache) == []


def test_an_entry_whose_model_file_was_rewritten_goes_when_the_next_is_written(cache, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"blocks")
    old = entry(cache, model)
    os.utime(model, (1, 1))  # re-installed: the same bytes, another time, so another key
    new = entry(cache, model)
    assert new != old
    assert sorted(p.name for p in cache.iterdir()) == [new]


def test_an_entry_whose_model_file_went_goes_and_others_stay(cache, tmp_path):
    kept, gone = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    kept.write_bytes(b"a")
    gone.write_bytes(b"b")
    names = entry(cache, kept, "gguf-kept"), entry(cache, gone, "gguf-gone")
    publish_json(cache / f"tokenizer-facts-{files_key([gone])}.json", {"eos_token_id": 2}, [gone])
    gone.unlink()  # a test's temporary model, cleaned up
    third = tmp_path / "third.gguf"
    third.write_bytes(b"c")
    name = entry(cache, third, "gguf-third")
    assert sorted(p.name for p in cache.iterdir()) == sorted([names[0], name])


def test_what_it_did_not_write_is_left_alone(cache, tmp_path):
    for d in ("kernels", "eagle3", "gguf-legacy-0123456789abcdef"):  # compiled kernels, heads, an entry with no record
        (cache / d).mkdir(parents=True)
    (cache / "tokenizer-facts-0123456789abcdef.json").write_text(json.dumps({"eos_token_id": 2}))
    (cache / "notes.txt").write_text("mine")
    before = sorted(p.name for p in cache.iterdir())
    assert prune(cache) == []
    assert sorted(p.name for p in cache.iterdir()) == before


def test_a_crashed_writers_half_entry_goes_once_it_is_old(cache):
    old, fresh = cache / "gguf-m-0123456789abcdef.tmp4242", cache / "gguf-m-fedcba9876543210.tmp4343"
    old.mkdir(parents=True)
    fresh.mkdir()
    past = time.time() - 2 * model_cache.STALE_TMP_S
    os.utime(old, (past, past))
    assert prune(cache) == [old]
    assert fresh.exists()


def test_a_gguf_copied_afresh_leaves_one_float32_copy(cache, tmp_path):
    """What had filled developers' caches: each fresh copy of a GGUF (a new modification time) was converted into a
    float32 copy of its own and the last one was never removed."""
    from bench.gguf_models import tokenizer_fields, write_tiny_gguf
    from specdec.models import ModelConfig, local_source

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", tokenizer_fields(256))
    first = local_source(ModelConfig(gguf))
    os.utime(gguf, (1, 1))
    second = local_source(ModelConfig(gguf))
    assert first != second and (tmp_path / "cache").exists()
    copies = [p.name for p in cache.iterdir() if p.name.startswith("gguf-tiny-") and not p.name.endswith("-tokenizer")]
    assert copies == [os.path.basename(second)]
