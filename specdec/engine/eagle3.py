"""The EAGLE-3 draft head: one decoder layer over the target's own low / middle / high hidden states.

Layout (as the EAGLE authors and SpecForge publish heads, and vLLM / SGLang load them): a directory with a
`config.json` whose `architectures` is ["LlamaForCausalLMEagle3"] (a Llama config with num_hidden_layers 1,
`draft_vocab_size`, and `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` holding

    fc.weight                       [H, 3 Ht]   the target's three layer states, concatenated, fused to H
    midlayer.input_layernorm.weight [H]         RMSNorm of the token's embedding
    midlayer.hidden_norm.weight     [H]         RMSNorm of the fused feature
    midlayer.self_attn.{q,k,v}_proj.weight      [heads D | kv D, 2 H]: attention over [embedding; feature]
    midlayer.self_attn.o_proj.weight            [H, heads D]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight   (a Llama MLP)
    norm.weight [H], lm_head.weight [Vd, H]     the draft vocabulary's logits
    d2t [Vd] int64, t2d [V] bool                the vocabulary maps (specdec.math.draft_vocab)
    embed_tokens.weight [V, H]                  optional: absent, the head shares the target's embedding

Layer ids name layer OUTPUTS (id i: the residual stream after decoder layer i, 0-based; SGLang and SpecForge
read them so); without them the default is low / middle / high = (1, L/2 - 1, L - 4) of the target's L.

One step at position t (EAGLE-3, Li et al. 2025), g the feature:
    e = input_layernorm(embed(x_{t+1}));  r = g;  a = attention([e; hidden_norm(g)])  (2 H wide, causal)
    h = r + o_proj(a);  out = h + mlp(post_attention_layernorm(h));  logits = lm_head(norm(out))
The first step's g is fc(target features at t); every later step's g is the head's own `out` at the
position before (training-time test). With `norm_before_residual` the residual is the normed feature.
Loading checks the checkpoint against the target (check_checkpoint) and refuses a bad one naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specdec.engine.eagle3_checks import ARCHITECTURE, CheckpointError, aux_layer_ids, check_checkpoint, default_aux_layers
from specdec.math.draft_vocab import full_vocab_probs, mapping_error, t2d_mask

WEIGHTS = "model.safetensors"


def head_config(target: LlamaConfig, draft_vocab_size: int, aux_layers: list[int] | None = None) -> dict:
    """config.json of a head for `target` in the published layout: the target's layer shapes, one layer."""
    rope = dict(getattr(target, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", getattr(target, "rope_theta", 10000.0))
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": target.hidden_act,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers or default_aux_layers(target.num_hidden_layers)),
                         "use_aux_hidden_state": True},
    }


def _llama_config(config: dict) -> LlamaConfig:
    keep = {k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "auto_map")}
    return LlamaConfig(**keep)


class Eagle3Attention(nn.Module):
    """The midlayer's attention: q, k, v over [embedding; feature] (2 H wide), out to H."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=bias)


class Eagle3Layer(nn.Module):
    """The one decoder layer (`midlayer`): its norms, attention and MLP, named as the checkpoints name them."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c)


@dataclass
class HeadCache:
    """One sequence's keys and values in the head's layer: [kv_heads, S, D] each, rolled back with the session."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def truncate(self, n: int) -> None:
        """Keep the first n positions (a rejected draft's entries go)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :n], self.v[:, :n]


class Eagle3Head(nn.Module):
    """The head: fc, midlayer, norm, lm_head, the vocabulary maps, and an embedding (its own or the target's)."""

    def __init__(self, config: dict, target_embedding: nn.Embedding | None = None, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = dict(config)
        c = self.llama = _llama_config(config)
        self.vocab_size = c.vocab_size
        self.draft_vocab_size = int(config.get("draft_vocab_size") or c.vocab_size)
        target_hidden = int(config.get("target_hidden_size") or c.hidden_size)
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        if own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self._shared = [target_embedding]  # the target's embedding, not a submodule: never saved with the head
        self.fc = nn.Linear(3 * target_hidden, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, self.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c)
        identity = torch.zeros(self.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", identity)
        self.register_buffer("t2d", t2d_mask(identity, c.vocab_size))

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (its norms' weights keep it when its linears are packed for a kernel)."""
        return self.norm.weight.dtype

    # --- the pieces of one step ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., H] the tokens' embeddings: the head's own, else the target's."""
        table = getattr(self, "embed_tokens", None)
        table = table if table is not None else self._shared[0]
        if table is None:
            raise CheckpointError("the checkpoint has no embed_tokens.weight and no target embedding was given")
        return table(ids).to(self.dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """fc: [..., 3 Ht] the target's concatenated layer states (any dtype) -> [..., H] the first step's g."""
        return self.fc(features.to(self.dtype))

    def qkv(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        """ids [B, T], g [B, T, H], positions [B, T] -> q [B, heads, T, D], k, v [B, kv, T, D] (rotated), the residual."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        e = layer.input_layernorm(self.embed(ids))
        if self.norm_before_residual:
            g = layer.hidden_norm(g)
            residual = g
        else:
            residual, g = g, layer.hidden_norm(g)
        x = torch.cat([e, g], dim=-1)  # [B, T, 2H]
        b, t, d = x.shape[0], x.shape[1], attn.head_dim
        q = attn.q_proj(x).view(b, t, attn.heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.kv_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.kv_heads, d).transpose(1, 2)
        cos, sin = self.rotary(v, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, residual

    def finish(self, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o [B, heads, T, D] (attention output), residual [B, T, H] -> out [B, T, H]: the next step's g."""
        b, _, t, _ = o.shape
        h = residual + self.midlayer.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] logits over the draft vocabulary."""
        return self.lm_head(self.norm(out))

    def q_full(self, out: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """[..., H] -> [..., V] q over the target's vocabulary (0 outside the draft vocabulary)."""
        q_draft = torch.softmax(self.logits(out).float() / temperature, dim=-1)
        return full_vocab_probs(q_draft, self.d2t, self.vocab_size)

    def layer_ids(self, target_layers: int) -> list[int]:
        """The target layer outputs this head reads (its config's, else the default for that depth)."""
        return aux_layer_ids(self.config, target_layers)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target ids they stand for."""
        return draft_ids + self.d2t[draft_ids]

    # --- inference over a per-sequence cache -----------------------------------------------------------
    def step(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """ids [T], g [T, H], positions [T] (following the cache's) -> out [T, H]; the cache grows by T."""
        q, k, v, residual = self.qkv(ids[None], g[None], positions[None])
        k, v = k[0], v[0]
        cache.k = k if cache.k is None else torch.cat([cache.k, k], dim=1)
        cache.v = v if cache.v is None else torch.cat([cache.v, v], dim=1)
        t, s = ids.shape[0], cache.length
        mask = torch.ones(t, s, dtype=torch.bool, device=ids.device).tril(s - t)  # [T, S] causal over the cache
        o = _attend(q, [(cache.k[None], cache.v[None], mask)])
        return self.finish(o, residual)[0]

    def step_rows(self, ids: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, caches: list[HeadCache],
                  rows: int = 0) -> torch.Tensor:
        """One token for each of B sequences: ids, positions [B], g [B, H], each over its own cache (which grows
        by one) -> out [B, H]. The products run over the B rows at once (padded to `rows` rows: one shape
        whatever B), the attention per sequence: row i is step()'s for sequence i alone wherever the products
        are batch-invariant (specdec's skinny GEMM; a library's at one fixed shape)."""
        b = ids.shape[0]
        ids, g, positions = pad_rows(ids, rows), pad_rows(g, rows), pad_rows(positions, rows)
        q, k, v, residual = self.qkv(ids[:, None], g[:, None], positions[:, None])  # q [B, heads, 1, D], k, v [B, kv, 1, D]
        attended = []
        for i, cache in enumerate(caches):
            cache.k = k[i] if cache.k is None else torch.cat([cache.k, k[i]], dim=1)
            cache.v = v[i] if cache.v is None else torch.cat([cache.v, v[i]], dim=1)
            mask = torch.ones(1, cache.length, dtype=torch.bool, device=ids.device)  # step()'s causal mask, one row
            attended.append(_attend(q[i : i + 1], [(cache.k[None], cache.v[None], mask)]))
        return self.finish(pad_rows(torch.cat(attended), rows), residual)[:b, 0]


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` rows (x itself where it has as many or more)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _attend(q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax attention of q [B, heads, T, D] over blocks of keys: (k, v [B, kv, S, D], mask [T, S] bool),
    or (k, v [B, kv, T, D], None) for a diagonal block (query t sees only key t). One softmax over all."""
    heads, scale = q.shape[1], q.shape[-1] ** -0.5
    scores, values = [], []
    for k, v, mask in blocks:
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            scores.append((q * k).sum(-1, keepdim=True) * scale)  # [B, heads, T, 1]
        else:
            scores.append((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")))
        values.append((v, mask is None))
    weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out, start = 0, 0
    for (v, diagonal), s in zip(values, scores):
        w = weights[..., start : start + s.shape[-1]]
        out = out + (w * v if diagonal else w @ v)
        start += s.shape[-1]
    return out


def ttt_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Training-time test's attention at draft step j (EAGLE-3): q [B, heads, T, D] at row t attends to step 0's
    keys at rows <= t (the target's features) and to steps 1..j's keys at row t only (its own earlier drafts),
    which is what the cache holds when the head drafts j + 1 tokens after position t."""
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    (k0, v0), rest = keys[0], keys[1:]
    return _attend(q, [(k0, v0, causal)] + [(k, v, None) for k, v in rest])


# --- the checkpoint ---------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the weights (model.safetensors, else pytorch_model.bin as the EAGLE authors ship)."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    config = json.loads(config_file.read_text())
    if (path / WEIGHTS).exists():
        return config, load_file(str(path / WEIGHTS))
    if (path / "pytorch_model.bin").exists():
        return config, torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{path}: no {WEIGHTS} or pytorch_model.bin")


def write_checkpoint(head: Eagle3Head, path: str | Path) -> None:
    """The head in the published layout: config.json and model.safetensors (its own tensors, bit for bit;
    the target's embedding is never written)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(head.config, draft_vocab_size=head.draft_vocab_size)
    config["torch_dtype"] = str(head.fc.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt"})


def load_head(path: str | Path, target_config: LlamaConfig, target_embedding: nn.Embedding | None = None,
              dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> Eagle3Head:
    """A checkpoint as a head for this target, checked first (check_checkpoint), in `dtype` (default: as stored)."""
    config, state = read_checkpoint(path)
    check_checkpoint(config, state, target_config, has_target_embedding=target_embedding is not None)
    # On the device before they are assigned (assign keeps a tensor where it lies: a checkpoint's are on the CPU),
    # checked against d2t: t2d is rebuilt from it below
    state = {k: v.to(device) for k, v in state.items() if k != "t2d"}
    if target_embedding is not None:  # (not a submodule: head.to() would leave it behind; the caller's stays where it is)
        # in the head's dtype: its rows are cast to it after the lookup anyway (the same bits; an 8B target's
        # table is 2.1 GB in float32)
        weight = target_embedding.weight.detach().to(device, dtype or target_embedding.weight.dtype)
        target_embedding = nn.Embedding.from_pretrained(weight, freeze=True)
    with torch.device("meta"):
        head = Eagle3Head(config, target_embedding, own_embedding="embed_tokens.weight" in state)
    head.to_empty(device=device)
    head.load_state_dict(state, strict=False, assign=True)  # every weight is there: check_checkpoint saw to it
    d2t = state.get("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.long, device=device))  # absent: a full vocabulary
    head.d2t = d2t.long()
    head.t2d = t2d_mask(head.d2t, head.vocab_size)
    if dtype is not None:
        head.to(dtype)  # floating tensors only: d2t stays int64, t2d bool
    # the rotary table after the cast: float32 as the target's (in bfloat16 a position's angle drifts by radians
    # within a few thousand tokens)
    head.rotary = LlamaRotaryEmbedding(head.llama).to(device)
    return head.eval()


def random_head(config: dict, target_embedding: nn.Embedding | None = None, seed: int = 0, std: float = 0.02,
                own_embedding: bool = False, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head with random weights N(0, std) (norms at 1, biases at 0, the identity vocabulary map), built in `dtype` without a
    float32 copy first: a start for training, or a stand-in at a large target's shapes."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        head = Eagle3Head(config, target_embedding, own_embedding=own_embedding)
    head.to_empty(device="cpu")
    head.to(dtype)
    head.rotary = LlamaRotaryEmbedding(head.llama)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std, generator=g)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)  # RMSNorm weights at 1, biases at 0
    identity = torch.zeros(head.draft_vocab_size, dtype=torch.long)
    head.d2t, head.t2d = identity, t2d_mask(identity, head.vocab_size)
    return head


def echo_head(target, seed: int = 3) -> Eagle3Head:
    """A stand-in for a trained head (tests, benchmarks of the pipeline's cost): full vocabulary; fc reads the target's
    last layer output, lm_head and norm are the target's, and its own layer is small (weights N(0, 0.01)), so its
    guess at entry i is near the target's own prediction at position i (the token after x_i, where the head is
    asked for the one after x_{i+1}): right where the target repeats itself, wrong elsewhere."""
    c = target.config
    hidden, layers = c.hidden_size, c.num_hidden_layers
    head = random_head(head_config(c, c.vocab_size, [0, layers - 1, layers - 1]), target.get_input_embeddings(),
                       seed=seed, std=0.01)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
        head.norm.weight.copy_(target.base_model.norm.weight)
    return head


def mapped_vocabulary(head: Eagle3Head, d2t: torch.Tensor) -> None:
    """Install a draft vocabulary map (d2t offsets, checked) and its t2d mask on a head."""
    error = mapping_error(d2t, head.vocab_size)
    if error or d2t.shape[0] != head.draft_vocab_size:
        raise CheckpointError(f"d2t: {error or f'{d2t.shape[0]} entries for draft_vocab_size {head.draft_vocab_size}'}")
    head.d2t = d2t.long().to(head.fc.weight.device)
    head.t2d = t2d_mask(head.d2t, head.vocab_size)


def greedy_chain(head: Eagle3Head, ids: torch.Tensor, features: torch.Tensor, k: int, cache: HeadCache | None = None,
                 start: int = 0) -> list[int]:
    """k greedy draft tokens (target ids) after a prefix: ids [T] the tokens x_1..x_T (the last one the target's
    latest), features [T - 1, 3 Ht] the target's features at positions start .. start + T - 2. Pairs token
    x_{i+1} with feature i, as the head was trained; the cache (fresh if None) is left holding the chain."""
    cache = cache if cache is not None else HeadCache()
    positions = torch.arange(start, start + features.shape[0], device=features.device)
    out = head.step(ids[1:], head.fuse(features), positions, cache)[-1:]
    tokens = []
    for j in range(k):
        token = head.target_ids(head.logits(out).argmax(-1))
        tokens.append(int(token))
        if j + 1 < k:
            out = head.step(token, out, positions[-1:] + j + 1, cache)
    return tokens


