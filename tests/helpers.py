"""Test helpers: tiny random-init models saved like real ones, and an in-process cluster of the three
real gRPC servers (bound to port 0) running on a background event loop.

The tiers' torch device and dtype come from SPECDEC_TEST_DEVICE (default cpu) and SPECDEC_TEST_DTYPE
(default float32), so the engine tests run unchanged on a GPU:
    SPECDEC_TEST_DEVICE=cuda python -m pytest -q tests/test_runner.py tests/test_batching.py ...
CI never sets them. Reference models (transformers' own generate / forward) run on the same device.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch

from coordinator.config import CoordinatorConfig
from coordinator.service import build as build_coordinator
from draft_service.service import SERVICE_NAME as DRAFT_SERVICE
from draft_service.service import DraftConfig
from draft_service.service import build as build_draft
from specdec.models import ModelConfig, default_draft
from specdec.proto import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.serving.server import ServerConfig, set_serving
from specdec.engine.sessions import SessionStoreConfig
from specdec.engine.config import BatchConfig, StepConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.engine.head_engine import HeadEngine
from specdec.engine.head_weights import is_head
from target_service.service import SERVICE_NAME as TARGET_SERVICE
from target_service.service import TargetConfig
from target_service.service import build as build_target

TOKENIZER_DIR = default_draft()  # the real SmolLM2 tokenizer (shared by the real pair)
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")  # torch device of the tiers and reference models
TEST_DTYPE = os.environ.get("SPECDEC_TEST_DTYPE", "float32")  # their dtype (exactness tests assume float32)
# The in-process tiers' start-up cost curve budget (specdec.engine.cost_curve): its minimum points only (a decode
# step and a verify of K = 3, alone and in a batch of 16, as a busy machine's budget gives), not the 3 s per tier a
# service spends by default: no test depends on the curve's detail (speed is never asserted), and a cluster starts
# ~5 s sooner. tests/test_cost_curve.py measures the whole grid.
TEST_COST_CURVE_S = 0.01


def needs_cpu_kernels(what: str) -> pytest.MarkDecorator:
    """Skip a test of specdec's CPU kernels where they do not apply: another test device, or a CPU with neither
    AVX-512 nor AVX2 (specdec.engine.cpu_kernels.isa). Where they apply, a build that fails fails the test."""
    from specdec.engine import cpu_kernels

    return pytest.mark.skipif(TEST_DEVICE != "cpu" or cpu_kernels.isa() is None,
                              reason=f"{what} runs on CPUs with AVX-512 or AVX2")


def child_env() -> dict[str, str]:
    """The environment for a service started as a process: this repository first on PYTHONPATH, the caller's path
    after it (a machine with packages installed with `pip install --target DIR`, as a GPU check sets them up)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


def device_model(path: str, dtype: str | None = None) -> ModelConfig:
    """A ModelConfig on the test device (SPECDEC_TEST_DEVICE) in the test dtype unless one is named."""
    return ModelConfig(path, device=TEST_DEVICE, dtype=dtype or TEST_DTYPE)


def tier_device_args() -> list[str]:
    """The same, as flags of a tier process (python -m target_service / draft_service)."""
    return ["--device", TEST_DEVICE, "--dtype", TEST_DTYPE]


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int] | None) -> list[int]:
    """The target's own greedy output via transformers' generate()."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids], device=model.device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_ids, pad_token_id=2,
        )
    ids = out[0, len(prompt_ids):].tolist()
    if eos_token_ids:
        for i, t in enumerate(ids):
            if t in eos_token_ids:
                return ids[: i + 1]
    return ids


class Cluster:
    """Target + (optional) draft + coordinator servers on loopback port 0, in a background loop."""

    def __init__(self, target_model: str, draft_model: str | None, *, coordinator_overrides: dict | None = None,
                 sessions: SessionStoreConfig | None = None, max_draft_tokens: int = 16, draft_top_n: int = 64,
                 tier_server: ServerConfig | None = None, batch: BatchConfig | None = None,
                 draft_dtype: str | None = None, step: StepConfig | None = None, draft_quantize: str = "none",
                 draft_vocab: str = "0", direct: bool | dict = False) -> None:
        """tier_server: the tiers' ServerConfig (e.g. TLS); default plaintext on 127.0.0.1:0. Both tiers run
        on the test device in the test dtype (draft_dtype overrides the draft's), in step mode `step`
        (default: auto); the draft's matrices quantised as `draft_quantize` asks (StepConfig.quantize), its LM
        head over `draft_vocab` (StepConfig.draft_vocab).
        direct: the draft is given the target's address (--direct-target), so the coordinator's fixed-K
        draft-model sessions run as direct rounds (tests/test_direct_rounds.py); a dict: that too, with these
        DraftConfig fields (its TLS to the target); off, every test of the coordinator's own rounds keeps them."""
        self.tier_server = tier_server or ServerConfig()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        sessions = sessions or SessionStoreConfig()
        batch = batch or BatchConfig()
        step = step or StepConfig()
        self.target_tier = Engine.load(TierConfig(device_model(target_model), sessions, max_draft_tokens, batch,
                                                  step=step, cost_curve_s=TEST_COST_CURVE_S))
        draft_config = TierConfig(device_model(draft_model, draft_dtype), sessions, max_draft_tokens, batch,
                                  step=replace(step, quantize=draft_quantize, draft_vocab=draft_vocab), cost_curve_s=TEST_COST_CURVE_S)
        # An EAGLE-3 head's directory as the draft: a feature draft for this target
        self.draft_tier = (None if not draft_model else HeadEngine.load(draft_config, target_model)
                           if is_head(draft_model) else Engine.load(draft_config))
        self._servers = []
        self.pipeline = None
        self.coordinator = None  # coordinator.service.Coordinator
        self.http = None  # the OpenAI-compatible API (coordinator.api.http_server.HttpServer)
        self.metrics_server = None  # the coordinator's /metrics endpoint
        self.tier_registries = {}  # TargetConfig / DraftConfig -> that tier's metrics registry
        self.direct = direct
        try:
            self._start(target_model, draft_model, coordinator_overrides, draft_top_n)
        except BaseException:
            self.close()
            raise

    def _start(self, target_model, draft_model, coordinator_overrides, draft_top_n) -> None:
        self.target_port = self._call(self._start_tier(
            build_target, TargetConfig(self.target_tier.config, server=self.tier_server), self.target_tier))
        self.draft_port = None
        if self.draft_tier is not None:
            self.draft_port = self._call(self._start_tier(
                build_draft, DraftConfig(self.draft_tier.config, server=self.tier_server, draft_top_n=draft_top_n,
                                         direct_target=f"127.0.0.1:{self.target_port}" if self.direct else "",
                                         **(self.direct if isinstance(self.direct, dict) else {})),
                self.draft_tier))
        config = CoordinatorConfig(
            target_address=f"127.0.0.1:{self.target_port}",
            draft_address=f"127.0.0.1:{self.draft_port}" if self.draft_port else None,
            tokenizer=target_model, connect_timeout_s=30, **(coordinator_overrides or {}),
        )
        self.port = self._call(self._start_coordinator(config))
        self.address = f"127.0.0.1:{self.port}"

    def _call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_tier(self, build, config, tier) -> int:
        built = build(config, tier)
        server, port = built.server, built.port
        self.tier_registries[config.__class__.__name__] = built.registry
        await server.start()
        # SERVING, as serve() reports it: the coordinator's channels health-check each replica.
        await set_serving(built.health, [DRAFT_SERVICE if build is build_draft else TARGET_SERVICE], True)
        self._servers.append(server)
        if build is build_draft:
            self.draft_server, self.draft_servicer = server, built.servicer
        else:
            self.target_server, self.target_servicer = server, built.servicer
        return port

    def stop_draft(self) -> None:
        """Take the draft tier down (its port stops answering)."""
        self._call(self.draft_server.stop(0))

    def stop_target(self) -> None:
        """Take the target tier down (its port stops answering)."""
        self._call(self.target_server.stop(0))

    async def _start_coordinator(self, config) -> int:
        c = await build_coordinator(config)
        await c.server.start()
        self._servers.insert(0, c.server)
        self.coordinator, self.pipeline = c, c.pipeline
        self.http = await c.start_http("127.0.0.1:0")
        self.metrics_server = c.serve_metrics("127.0.0.1:0")
        return c.port

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API, e.g. for openai.OpenAI(base_url=cluster.http_url + "/v1")."""
        return self.http.url

    @property
    def metrics_url(self) -> str:
        return self.metrics_server.url

    def status(self, tier: str) -> common_pb2.StatusResponse:
        port = self.target_port if tier == "target" else self.draft_port
        stub_cls = target_pb2_grpc.TargetServiceStub if tier == "target" else draft_pb2_grpc.DraftServiceStub
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return stub_cls(ch).GetStatus(common_pb2.StatusRequest(), timeout=10)

    def wait_no_sessions(self, timeout_s: float = 10.0):
        """Poll both tiers until they hold no session and no cached token (clean-up after a stream,
        a cancellation or a generation is asynchronous); fail the test on timeout. Returns the final
        (target, draft) statuses."""
        deadline = time.monotonic() + timeout_s
        while True:
            target, draft = self.status("target"), self.status("draft")
            if target.num_sessions == draft.num_sessions == target.cached_tokens == draft.cached_tokens == 0:
                return target, draft
            if time.monotonic() > deadline:
                pytest.fail(f"sessions left: target {target.num_sessions} ({target.cached_tokens} tokens), "
                            f"draft {draft.num_sessions} ({draft.cached_tokens} tokens)")
            time.sleep(0.05)

    def close(self) -> None:
        async def stop():
            if self.http is not None:
                await self.http.stop()
            if self.metrics_server is not None:
                self.metrics_server.close()
            for s in self._servers:
                await s.stop(0)
            if self.pipeline is not None:
                await self.pipeline.close()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        for tier in (self.target_tier, self.draft_tier):
            if tier is not None:
                tier.close()
