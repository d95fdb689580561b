"""Configuration of a tier engine: the model, its KV memory and sessions, and batching. Each field is a
flag of the tiers too (specdec.core.settings: the comment beside it is its help)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.core.settings import setting
from specdec.engine.quantize import QUANTIZE
from specdec.engine.sessions import SessionStoreConfig
from specdec.models import ModelConfig

STEP_MODES = ("auto", "eager", "packed", "compile", "cuda-graphs")  # specdec.engine.step


@dataclass(frozen=True)
class BatchConfig:
    """Batching: what one forward holds."""

    max_batch_sessions: int = 64  # sessions in one forward
    max_batch_tokens: int = 512  # tokens in one forward (decoding sessions first, then prefill chunks)
    prefill_chunk_tokens: int = setting(128, flag="prefill-chunk")  # a long prompt is fed this many tokens per step, so decoding never stalls
    max_queue: int = 1024  # queued requests beyond this are refused with RESOURCE_EXHAUSTED
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

    # How each step runs: auto (packed on a CPU, cuda-graphs on CUDA), eager (transformers' modules as they
    # are: for debugging), packed (the plain Llama decoder over weights packed once), compile (torch.compile:
    # minutes at start on a small CPU), cuda-graphs (steps replayed from CUDA graphs per shape bucket)
    mode: str = setting("auto", flag="step-mode", choices=STEP_MODES)
    capture_sessions: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # CUDA graphs: batch sizes (sessions per step) captured
    capture_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # CUDA graphs: query tokens per session captured (a verify of K drafts needs K + 1)
    max_graphs: int = 128  # CUDA graphs kept (least recently used dropped); steps beyond the buckets run eager
    # Buckets captured at start: at most this many (padded) tokens (the tiers set it to --max-batch-tokens)
    max_capture_tokens: int = setting(512, cli=False)
    fused_ops: bool = True  # CUDA graphs capture the decoder with fused ops: norms, rotary and SiLU on Triton
    #                         kernels, q/k/v and gate/up as one product each (off: PyTorch's operators, one
    #                         product per linear; specdec.engine.step.graph_decoder)
    draft_chain: bool = True  # draft tier: a proposal's steps after the first run as one chain on the device, one
    #                           host round trip (off: one engine step each; specdec.engine.draft_chain)
    # A lone session's small step runs on the event loop's thread when the engine is idle, not handed to the engine
    # thread and back (two thread wake-ups: ~0.2 ms a round on a small CPU): on | off | auto (on a CPU tier that
    # computes on one torch thread; with more, a second thread's OpenMP team would slow every step)
    inline_steps: str = setting("auto", choices=("auto", "on", "off"))
    run_on_chain: bool = True  # target tier: a greedy session stepping alone runs its run-on tokens as one such
    #                            chain (off, or under load: one engine step each, batched with every session)
    skinny_gemm: bool = True  # packed steps in float32 on an AVX-512 or AVX2 CPU: every linear on specdec's batch-invariant
    #                           kernel, built once with the host's C++ compiler (off: oneDNN's and the library's
    #                           products; specdec.engine.skinny_gemm)
    row_attention: bool = True  # packed and compile steps in float32 on an AVX-512 or AVX2 CPU: each token (decode, verify,
    #                             prefill) attends to its own session's cache on specdec's batch-invariant kernel,
    #                             with no padding, so neither batching nor how a prompt is split changes a bit
    #                             (off: PyTorch's attention over padded groups and prefill chunks)
    gguf_blocks: bool = True  # packed steps on the skinny GEMM: a GGUF's Q4_0 / Q4_1 / Q8_0 matrices stay in their
    #                           blocks, dequantised exactly inside the kernel (off: a float32 copy, the reference's
    #                           values; specdec.engine.gguf_weights)
    # Packed float32 steps on the skinny GEMM: quantise the checkpoint's float32 matrices into these blocks at load
    # (a draft only: its q is reported as drawn, so the output stays exact; the target takes only none;
    # specdec.engine.quantize). auto, the draft service's default: q8_0 where the step runs on the block kernel
    quantize: str = setting("none", choices=QUANTIZE)
    # A draft only: its LM head scores just these tokens, every other one gets q = 0 (never proposed; the output stays
    # exact; specdec.engine.draft_vocab_head): N, the N lowest token ids (a BPE tokenizer's most frequent) and the
    # end-of-sequence ones; auto, the draft service's default: the lowest third of a vocabulary over 32,768 tokens;
    # or a file of token ids (text, or a .pt tensor as SGLang's --speculative-token-map); 0 = the whole vocabulary
    # (the target takes only 0)
    draft_vocab: str = "0"
    # An EAGLE-3 head off the skinny GEMM: its batched products (the layer's and the LM head's) run on blocks of
    # exactly this many rows, the batch padded, so a row's result never depends on its batch (0: one step per
    # session; -1: 64 on CUDA, where padding costs no time, 0 elsewhere)
    head_rows: int = -1


@dataclass(frozen=True)
class TierConfig:
    """A tier's engine."""

    model: ModelConfig
    sessions: SessionStoreConfig = field(default_factory=SessionStoreConfig)
    max_draft_tokens: int = 16  # largest K a request may ask for
    batch: BatchConfig = field(default_factory=BatchConfig)
    torch_threads: int = setting(0, flag="threads")  # torch intra-op threads of this process (0 = torch's default)
    step: StepConfig = field(default_factory=StepConfig)
    # At start, time forwards at the batch sizes it will see for at most this long (specdec.engine.cost_curve),
    # reported in its status for the coordinator's policy; 0 = skip (the coordinator then learns from steps).
    cost_curve_s: float = 3.0
