"""Model and tokenizer loading for every tier.

A model source is one of:
  * a local Hugging Face directory (config.json + weights),
  * a GGUF file, or a directory holding exactly one .gguf file and no config.json
    (transformers dequantises it; we keep a converted copy in the cache directory, because
    converting takes ~15 s and loading the copy well under 1 s),
  * a hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct" (needs network access or a warm hub cache).

Shared by the coordinator (tokenizer only) and the tier engines (weights); torch is imported only where
weights are loaded, so the coordinator and clients run without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdec.core.settings import setting
from specdec.model_cache import cache_dir, files_key, publish_dir, publish_json

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARGET_SUBDIR = "smollm2-135m-instruct"
DEFAULT_DRAFT_SUBDIR = "smollm2-135m-draft"

DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes a model may run in


def models_dir() -> Path:
    """$SPECDEC_MODELS_DIR, default ../shared/models beside the repository."""
    return Path(os.environ.get("SPECDEC_MODELS_DIR", REPO_ROOT.parent / "shared" / "models"))


def default_target() -> str:
    return str(models_dir() / DEFAULT_TARGET_SUBDIR)


def default_draft() -> str:
    return str(models_dir() / DEFAULT_DRAFT_SUBDIR)


def served_model_name(path: str) -> str:
    """The name a model is served under (the OpenAI API's model id, the metrics' model_name label) when no
    --served-model-name is given: a hub id as it is ("HuggingFaceTB/SmolLM2-135M-Instruct", as vLLM does);
    a local path by its last part, a .gguf file without the suffix ("/models/smollm2-135m-instruct" ->
    "smollm2-135m-instruct", "m/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.Q4_1").
    Decided from the string alone, so the coordinator and the tier name a model alike without sharing files
    (a relative "dir/model" reads as a hub id: write "./dir/model", or pass the flag)."""
    stripped = path.rstrip("/") or path
    name = Path(stripped).name
    if _looks_like_hub_id(stripped):
        return stripped
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or stripped


def _looks_like_hub_id(path: str) -> bool:
    """"org/name": one "/", not leading with "." or "~", not a .gguf file."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and not path.endswith(".gguf")


@dataclass(frozen=True)
class ModelConfig:
    """The model."""

    path: str = setting(flag="model")  # model: HF directory, .gguf file (or a directory holding one), or hub id
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...
    dtype: str = setting("float32", choices=DTYPES)  # the weights' and activations' dtype; float32 is what exactness tests use

    @property
    def torch_dtype(self):
        import torch

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class _Source:
    location: str  # directory or hub id handed to from_pretrained
    gguf_file: str | None  # file name inside `location`, for GGUF sources


def _resolve(path: str) -> _Source:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _Source(str(p.parent), p.name)
    if p.is_dir():
        if (p / "config.json").exists():
            return _Source(str(p), None)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _Source(str(p), ggufs[0].name)
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}")
        raise ValueError(f"{path} has neither config.json nor a .gguf file")
    if p.exists() or path.startswith((".", "/")):
        raise ValueError(f"model path {path!r} is not a model directory or .gguf file")
    return _Source(path, None)  # hub id


def _converted_dir(src: _Source) -> Path:
    f = Path(src.location) / src.gguf_file
    return cache_dir() / f"gguf-{f.stem}-{files_key([f])}"


def _ensure_converted(src: _Source) -> Path:
    """Dequantise a GGUF once into a plain float32 HF directory (model + tokenizer) and reuse it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _converted_dir(src)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    log.info("converting %s/%s once into %s", src.location, src.gguf_file, out)
    model = AutoModelForCausalLM.from_pretrained(src.location, gguf_file=src.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
    # The dequantised weights are plain float32; drop the GGUF quantizer so save_pretrained accepts it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    publish_dir(out, write, [Path(src.location) / src.gguf_file])  # (another process may have converted it meanwhile)
    return out


def local_source(cfg: ModelConfig) -> str:
    """What from_pretrained loads for cfg: its directory, a GGUF's float32 copy (converted once), or a hub id."""
    src = _resolve(cfg.path)
    return str(_ensure_converted(src)) if src.gguf_file else src.location


# tokenizer classes that are tokenizer.json and nothing else: read without AutoTokenizer, which imports
# transformers' configuration and modeling stack (~2 s and ~130 MiB a tier process)
PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_pretrained(directory):
    """AutoTokenizer's tokenizer for a local directory, through PreTrainedTokenizerFast where its class is plain."""
    config = Path(directory) / "tokenizer_config.json"
    if config.exists() and (Path(directory) / "tokenizer.json").exists() \
            and json.loads(config.read_text()).get("tokenizer_class") in PLAIN_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def load_tokenizer(path: str):
    """The tokenizer alone. For a GGUF source this reuses the converted copy if one exists, and
    otherwise caches just the tokenizer (the coordinator needs no weights)."""
    src = _resolve(path)
    if src.gguf_file is None:
        return _from_pretrained(src.location)  # a directory, or a hub id (AutoTokenizer)
    converted = _converted_dir(src)
    if (converted / "tokenizer_config.json").exists():
        return _from_pretrained(converted)
    tok_dir = converted.with_name(converted.name + "-tokenizer")
    if not (tok_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(src.location, gguf_file=src.gguf_file)
        publish_dir(tok_dir, tokenizer.save_pretrained, [Path(src.location) / src.gguf_file])
    return _from_pretrained(tok_dir)


def load_model(cfg: ModelConfig):
    """The causal LM in eval mode on cfg.device / cfg.dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local_source(cfg), dtype=cfg.torch_dtype)
    return model.to(cfg.device).eval()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (with added tokens) and special tokens: equal iff two tokenizers map
    text to the same ids for our purposes."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items()),
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


# Files of a local model directory that make its tokenizer (their paths, sizes and times key the cached facts).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


@dataclass(frozen=True)
class TokenizerSource:
    """What a tier needs of its model's tokenizer: the fingerprint its requests are checked against, its EOS id,
    and a way to load it (a grammar's llguidance tokenizer is built from it). A tier holds these, not the
    tokenizer (~45 MiB, and transformers imported for it)."""

    fingerprint: str
    eos_token_id: int | None
    load: Callable[[], object]

    @classmethod
    def of(cls, tokenizer) -> "TokenizerSource":
        """A tokenizer already loaded (kept for load())."""
        return cls(tokenizer_fingerprint(tokenizer), tokenizer.eos_token_id, lambda: tokenizer)

    @classmethod
    def at(cls, path: str) -> "TokenizerSource":
        """The tokenizer of the model at `path`: for a local model its facts come from the cache directory
        after the first load (keyed by the tokenizer files' paths, sizes and times), so later loads read
        none of it; a hub id is loaded each time."""
        load = functools.partial(load_tokenizer, path)
        src = _resolve(path)
        if not Path(src.location).is_dir():
            return cls.of(load())
        files = [Path(src.location) / src.gguf_file] if src.gguf_file else \
            [Path(src.location) / name for name in TOKENIZER_FILES if (Path(src.location) / name).exists()]
        where = cache_dir() / f"tokenizer-facts-{files_key(files, str(Path(src.location).resolve()))}.json"
        if where.exists():
            facts = json.loads(where.read_text())
            return cls(facts["fingerprint"], facts["eos_token_id"], load)
        tokenizer = load()
        facts = cls(tokenizer_fingerprint(tokenizer), tokenizer.eos_token_id, load)
        try:  # best effort: a read-only cache directory costs the next start a tokenizer load, nothing else
            publish_json(where, {"fingerprint": facts.fingerprint, "eos_token_id": facts.eos_token_id}, files)
        except OSError as e:
            log.info("tokenizer facts not cached in %s: %s", where.parent, e)
        return facts


def eos_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids: its generation config's and the tokenizer's (a TokenizerSource will do)."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)


def make_tiny_model(out_dir: Path | str, seed: int, eos_token_ids: list[int] | None = None, tokenizer=None, *,
                    hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                    num_kv_heads: int = 2) -> str:
    """A random-init Llama (by default 2 layers of width 64) with the SmolLM2 tokenizer (the default draft's),
    saved as a HF directory: the tests' and the wiring benchmarks' tiny models."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = tokenizer or AutoTokenizer.from_pretrained(default_draft())
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=eos_token_ids or [2], pad_token_id=2,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_ids or [2]
    model.generation_config.pad_token_id = 2
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)
