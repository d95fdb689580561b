"""A GGUF served as it ships: its quantised matrices kept in their blocks (specdec.engine.quant_gemm), no float32 copy.

specdec.models loads a GGUF the reference way: transformers dequantises every tensor to float32 (gguf-py's
numpy), once, into a cached copy. For the packed step on an AVX-512 or AVX2 CPU in float32 this module builds the
same model without that copy: transformers' own config and tensor-name map for the file, its own tensor
processor for the row order (llama.cpp permutes q and k; transformers undoes it, here applied to the block
rows, which are whole rows), the norms and any float tensors exactly as transformers loads them, and every
Q4_0 / Q4_1 / Q8_0 / Q2_K ... Q6_K matrix as a QuantLinear over its blocks (a tied embedding and LM head share
one; a K-quant file, Q4_K_M or Q3_K_M or any, is all of them). The values each block dequantises to are the reference's,
bitwise. Matrices in block formats the kernel does not compute (Q5_0, Q5_1, the IQ quants, ...) are dequantised once by
gguf-py, the reference's values, and run on the float32 skinny GEMM: served exactly, at float32's bytes (a
warning names them).

The default target (SmolLM2-135M-Instruct Q4_1: 210 Q4_1 matrices, a Q8_0 tied embedding) then holds 98 MB
of weights instead of 513 MiB, loads without the conversion, and each step streams the quantised bytes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from specdec.engine import llama_weights, skinny_gemm
from specdec.engine.quant_gemm import FORMATS, QuantEmbedding, QuantLinear, pack
from specdec.model_cache import cache_dir, files_key, publish_dir
from specdec.models import ModelConfig, load_model as load_reference, local_source

log = logging.getLogger(__name__)


def gguf_file(path: str) -> Path | None:
    """The .gguf file a model path names (a file, or a directory holding exactly one and no config.json)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(p.glob("*.gguf"))
        return found[0] if len(found) == 1 else None
    return None


def unavailable(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot be served from its blocks, or None if it can."""
    if gguf_file(cfg.path) is None:
        return "not a GGUF file"
    if torch.device(cfg.device).type != "cpu" or cfg.dtype != "float32":
        return f"{cfg.dtype} on {cfg.device} (the block kernel is float32 on a CPU)"
    return skinny_gemm.unavailable()


def load_model(cfg: ModelConfig, blocks: bool = True, light: bool = False):
    """The causal LM for cfg: from its GGUF blocks where `blocks` and they can be served (unavailable()),
    else specdec.models' float32 load (the same values, dequantised once). light: the step runs the model by
    LlamaDecoder alone (the packed mode, float32 on a CPU), so a Llama directory loads into specdec's own
    container (specdec.engine.llama_weights: the same parameters, no transformers modeling code)."""
    reason = unavailable(cfg) if blocks else "turned off (--no-gguf-blocks)"
    if reason is None:
        return load_blocks(gguf_file(cfg.path))
    if gguf_file(cfg.path) is not None:
        log.info("GGUF %s dequantised to %s once: %s", cfg.path, cfg.dtype, reason)
    if light and torch.device(cfg.device).type == "cpu" and cfg.dtype == "float32":
        source = Path(local_source(cfg))
        if llama_weights.read_config(source) is not None and any(source.glob("*.safetensors")):  # (not .bin)
            return llama_weights.load(source)
    return load_reference(cfg)


def set_module(model, dotted: str, module: torch.nn.Module) -> None:
    """model's submodule at `dotted` replaced by `module`."""
    parent, _, name = dotted.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def _row_order(processor, name: str, rows: int, names: dict, parsed: dict) -> np.ndarray | None:
    """The row permutation transformers' tensor processor applies to tensor `name` (run on the row
    indices), or None if it changes more than the order of whole rows (then the blocks cannot follow)."""
    index = np.arange(rows, dtype=np.int64)[:, None]
    out = processor.process(weights=index, name=name, tensor_key_mapping=names, parsed_parameters=parsed)
    order = np.asarray(out.weights).reshape(-1)
    if out.name != name or order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return order


# A tensor's row order in the index: the rows as they are, or transformers' processor does more than reorder
# whole rows (then it runs at load, as transformers loads that tensor).
SAME_ROWS, PROCESSED = "same", "processed"
INDEX_VERSION = 2  # 2: each tensor's row order cached (no transformers import at load)


def _orders(processor, tensors, names: dict, parsed: dict) -> dict[str, object]:
    """{GGUF tensor name: SAME_ROWS, PROCESSED or the row order (a list)} for the mapped tensors: what
    transformers' tensor processor does to each, found once (at indexing) on the row indices."""
    out: dict[str, object] = {}
    for name, _, shape, _, _ in tensors:
        if name not in names:
            continue
        rows = shape[-1] if len(shape) == 2 else shape[0] if len(shape) == 1 else 0
        order = _row_order(processor, name, rows, names, parsed) if rows else None
        out[name] = PROCESSED if order is None else SAME_ROWS if np.array_equal(order, np.arange(rows)) \
            else [int(i) for i in order]
    return out


def _index(path: Path):
    """(transformers' config, its parsed GGUF config dict, [(name, type, shape, offset, bytes)] of the tensors,
    {GGUF tensor name: model parameter name}, {GGUF tensor name: its row order (_orders)}) of GGUF `path`.
    Reading a GGUF's metadata with gguf-py takes ~5 s per pass for the default target (its tokenizer arrays)
    and transformers' name map ~5 s more, so the first load keeps them in the cache directory (a few kB) and
    later loads read that, with no transformers import (~20 MiB of a tier's memory)."""
    where = cache_dir() / f"gguf-blocks-{path.stem}-{files_key([path], f'v{INDEX_VERSION}')}"
    if not (where / "index.json").exists():
        from gguf import GGUFReader
        from transformers import CONFIG_MAPPING
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map, load_gguf_checkpoint)

        tensors = [(t.name, t.tensor_type.name, [int(n) for n in t.shape], int(t.data_offset), int(t.n_bytes))
                   for t in GGUFReader(str(path)).tensors]
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        config = CONFIG_MAPPING[parsed["model_type"]].from_dict(dict(parsed))  # as AutoConfig reads a GGUF
        processor = TENSOR_PROCESSORS.get(parsed.get("model_type"), TensorProcessor)(config=parsed)
        names = get_gguf_hf_weights_map(_skeleton(config), processor)
        orders = _orders(processor, tensors, names, {"config": parsed})

        def write(tmp: Path) -> None:
            config.save_pretrained(tmp)
            (tmp / "index.json").write_text(json.dumps({"config": parsed, "tensors": tensors, "names": names,
                                                        "orders": orders}, default=str))

        publish_dir(where, write, [path])  # (another process may have indexed it meanwhile)
    index = json.loads((where / "index.json").read_text())
    config = llama_weights.read_config(where)  # ours: transformers' configuration classes not imported
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(where))
    return config, index["config"], index["tensors"], index["names"], index["orders"]


def _skeleton(config):
    """The model of `config` on the meta device: specdec's Llama container where it holds it (no transformers
    modeling code imported: specdec.engine.llama_weights), else transformers' own class."""
    if llama_weights.unsupported(config) is None:
        return llama_weights.build(config, "meta")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_blocks(path: Path):
    """The model of GGUF `path` with its quantised matrices in their blocks, eval mode, on the CPU."""
    config, parsed_config, tensors, names, orders = _index(path)
    parsed = {"config": parsed_config}
    model = _skeleton(config)
    modules = {module: name for name, module in model.named_modules()}
    embed_name = modules[model.get_input_embeddings()] + ".weight"
    head_name = modules[model.get_output_embeddings()] + ".weight"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    loaded, floats = set(), []
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, type_name, shape, offset, nbytes in tensors:
        hf_name = names.get(name)
        if hf_name is None:
            continue
        fmt, order = FORMATS.get(type_name), orders[name]
        rows = shape[-1] if len(shape) == 2 else 0
        block = data[offset:offset + nbytes]
        if fmt is None or not rows or order == PROCESSED:  # a float tensor, or blocks the kernel does not compute: the reference's values
            if type_name not in ("F32", "F16", "BF16"):
                floats.append(f"{name} ({type_name})")
            values = _dequantize(block, type_name, shape)  # [rows, ...]
            if order == PROCESSED:  # transformers' processor, as it loads this tensor
                from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

                processor = TENSOR_PROCESSORS.get(parsed_config.get("model_type"), TensorProcessor)(config=parsed_config)
                values = processor.process(weights=values, name=name, tensor_key_mapping=names,
                                           parsed_parameters=parsed).weights
            elif order != SAME_ROWS:
                values = values[np.asarray(order)]
            _set_parameter(model, hf_name, torch.from_numpy(np.array(values, dtype=np.float32)))
            loaded.add(hf_name)
            continue
        raw = torch.from_numpy(np.array(block).reshape(rows, -1))  # [rows, blocks' bytes]
        if order != SAME_ROWS:
            raw = raw[torch.from_numpy(np.asarray(order))]
        linear = QuantLinear(pack(raw, fmt), fmt, rows, shape[0])
        module = hf_name.rpartition(".")[0]
        if hf_name == embed_name:
            set_module(model, module, QuantEmbedding(linear, model.get_input_embeddings().padding_idx))
            if tied:
                set_module(model, head_name.rpartition(".")[0], linear)
                loaded.add(head_name)
        else:
            set_module(model, module, linear)
        loaded.add(hf_name)
    del data
    if tied and head_name not in loaded and embed_name in loaded:  # a float embedding tied to the head
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        loaded.add(head_name)
    _materialise_buffers(model, config)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path.name}: no tensor for {missing[:5]} (transformers' map of this architecture)")
    if floats:
        log.warning("%s: %d matrices in block formats the kernel does not compute are held in float32 "
                    "(exact, at float32's bytes): %s", path.name, len(floats), ", ".join(floats[:4]))
    return model.eval()


def _dequantize(block: np.ndarray, type_name: str, shape: list[int]) -> np.ndarray:
    """A tensor's bytes -> float32 [*reversed(shape)], read and dequantised as transformers does (gguf-py)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[type_name]
    dims = list(reversed(shape))
    if type_name in ("F32", "F16"):
        return dequantize(block.view(np.float32 if type_name == "F32" else np.float16).reshape(dims), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return dequantize(block.reshape(*dims[:-1], dims[-1] // block_size * type_size), qtype)


def _set_parameter(model, hf_name: str, value: torch.Tensor) -> None:
    module_name, _, attr = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(value.reshape(getattr(module, attr).shape), requires_grad=False))


def _materialise_buffers(model, config) -> None:
    """Buffers computed at init (the rotary frequencies) were made on the meta device: make them again."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device("cpu"):
                fresh = type(module)(config=config)
            set_module(model, name, fresh)
