"""Configuration of a tier engine: the model, its KV memory and sessions, and batching."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.engine.sessions import SessionStoreConfig
from specdec.models import ModelConfig


@dataclass(frozen=True)
class BatchConfig:
    max_batch_sessions: int = 64  # sessions in one forward
    max_batch_tokens: int = 512  # tokens in one forward (decoding sessions first, then prefill chunks)
    prefill_chunk_tokens: int = 128  # a long prompt is fed this many tokens per step, so decoding never stalls
    max_queue: int = 1024  # waiting requests beyond this are refused with RESOURCE_EXHAUSTED
    coalesce_ms: float = 5.0  # wait up to this long before a step for the last step's sessions to come back,
    #                           when they usually do within it (0 = never wait)

    def validate(self) -> None:
        for name in ("max_batch_sessions", "max_batch_tokens", "prefill_chunk_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.coalesce_ms <= 1000:
            raise ValueError(f"coalesce_ms must be in [0, 1000], got {self.coalesce_ms}")


@dataclass(frozen=True)
class StepConfig:
    """How the tier runs its forward (specdec.engine.step). Every mode computes the same function."""

    mode: str = "auto"  # auto | eager | packed | compile | cuda-graphs (specdec.engine.step); auto: the CPU's
    #                     measured best (step.AUTO_CPU), cuda-graphs on CUDA
    capture_sessions: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # CUDA graphs: batch sizes (sessions) captured
    capture_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # ...and query tokens per session (K + 1 fits one)
    max_graphs: int = 128  # CUDA graphs kept (least recently used dropped); steps beyond the buckets run eager
    max_capture_tokens: int = 512  # buckets captured at start: at most this many (padded) tokens
    fused_ops: bool = True  # CUDA graphs capture the decoder with fused ops (norms, rotary, SiLU on Triton
    #                         kernels; q/k/v and gate/up as one product each): specdec.engine.step.graph_decoder
    draft_chain: bool = True  # the draft's K - 1 steps after d_1 as one chain on the device (specdec.engine.draft_chain)
    skinny_gemm: bool = True  # packed mode, float32: linears on specdec's batch-invariant CPU kernel (specdec.engine.skinny_gemm)
    row_attention: bool = True  # packed / compile mode, float32 CPU: few-token feeds' attention on specdec's row kernel
    gguf_blocks: bool = True  # packed mode on the skinny GEMM: a GGUF's Q4_0 / Q4_1 / Q8_0 matrices stay in their
    #                           blocks, dequantised inside the kernel (specdec.engine.gguf_weights); False: float32 copy


@dataclass(frozen=True)
class TierConfig:
    model: ModelConfig
    sessions: SessionStoreConfig = field(default_factory=SessionStoreConfig)
    max_draft_tokens: int = 16  # cap on K per request
    batch: BatchConfig = field(default_factory=BatchConfig)
    torch_threads: int = 0  # intra-op threads for this process; 0 leaves torch's default
    step: StepConfig = field(default_factory=StepConfig)
    # At start, time forwards at the batch sizes it will see for at most this long (specdec.engine.cost_curve),
    # reported in its status for the coordinator's policy; 0 = skip (the coordinator then learns from steps).
    cost_curve_s: float = 3.0
