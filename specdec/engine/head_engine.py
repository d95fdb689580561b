"""The draft tier's engine for an EAGLE-3 head: a feature draft, proposing chains from the target's own layer states.

A draft model guesses from the tokens alone; the head (specdec.engine.eagle3) reads the target's low / middle /
high layer outputs at each committed position, which the target returns with each verdict and the coordinator
forwards with the next proposal request (ProposeRequest.features). Per session the engine keeps:

    tokens      the committed sequence (and the last proposal's drafts, as a draft model's cache holds them)
    features    one row per committed position 0 .. F - 1 (bfloat16, the target's concatenated layer outputs)
    cache       the head layer's keys and values: entry i pairs token x_{i+1} with fc(features at i), the
                first `exact` of them computed from the target's features

A proposal of K tokens after the committed x_0 .. x_{T-1} (it needs F >= T - 1 rows):

    catch up    entries exact .. T - 2: tokens x_{exact+1} .. x_{T-1} with g = fc(f_exact .. f_{T-2})
    draft       the last entry's output -> logits over the draft vocabulary -> d_1; then each d_j is fed
                with g = the head's own output at the entry before (training-time test), for d_{j+1}
    roll back   the drafts' entries are dropped (exact = T - 1): an accepted draft's entry is recomputed
                from the target's features next round, as the head was trained

Rotary positions are the target's (entry i at position i), as vLLM and SGLang run a head. The head's logits
are scattered to the full vocabulary (-inf outside the draft vocabulary), and from there a proposal is drawn
exactly as the draft model's (specdec.engine.propose.ProposeWork.finish_step: penalties, the DraftSampler's
keyed draws, q truncated to top_n), so q is 0 outside the draft vocabulary and rejection sampling stays exact.
Each pass of the engine thread takes every queued request (one per session), and steps them in lockstep: the
layer's products and the LM head's run once for the step's sessions, the attention per session. A float32 head on
an AVX-512 or AVX2 CPU runs every product on specdec's skinny GEMM kernel (specdec.engine.skinny_gemm: fast at a few rows,
and batch-invariant); on CUDA the products run on blocks of a fixed number of rows (StepConfig.head_rows, the
batch padded: one shape, one kernel, each row reduced alone); elsewhere the head steps per session. Either way a
session's proposal is bitwise the same whichever sessions share its steps, so seeded sampling stays reproducible
under load.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from types import SimpleNamespace

import grpc
import torch

from specdec.core.errors import RequestError
from specdec.engine.config import TierConfig
from specdec.engine.eagle3 import Eagle3Head, HeadCache, load_head, pad_rows
from specdec.engine.engine_thread import INLINE_TOKENS, EngineStatus, EngineThread, hand_back, inline_steps_on
from specdec.engine.head_session import FEATURE_DTYPE, HeadSession
from specdec.engine.head_weights import pack_linears, target_embedding
from specdec.engine.propose import ProposeWork
from specdec.engine.propose_tree import ProposeTreeWork, tree_dists
from specdec.engine.tree_growth import Growth
from specdec.engine.work import step_id_base
from specdec.engine.threads import release_thread_pool

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SlotShape:
    """The KV pool's shape as metrics report it (specdec.serving.tier.cache_info): sessions of max_context tokens."""

    num_slots: int
    slot_tokens: int


class HeadEngine(EngineThread):
    """The engine a draft tier runs for an EAGLE-3 head: submit(ProposeWork) -> ProposeResult, as Engine's."""

    feature_draft = True  # it drafts from the target's features (Engine: False)

    def __init__(self, config: TierConfig, head: Eagle3Head, target_config, eos_token_ids: list[int],
                 tokenizer_fingerprint: str) -> None:
        """head: loaded and checked against target_config (the target's transformers config)."""
        super().__init__(config.batch.max_queue, name="head-engine")
        # The head's proposals are drawn step by step (finish_step feeds each draft back): no draft chain.
        self.config = replace(config, step=replace(config.step, draft_chain=False))
        self.head = head
        self.device = next(head.parameters()).device
        self.vocab_size = head.vocab_size
        self.draft_columns = None  # its rows are -inf outside d2t's ids, wherever they lie (the sampler reads all)
        self.feature_layers = head.layer_ids(target_config.num_hidden_layers)
        self.feature_width = head.fc.in_features
        # float32 on an AVX-512 or AVX2 CPU (unless --no-skinny-gemm): the batch-invariant kernel
        self.skinny = config.step.skinny_gemm and pack_linears(head, config.step.quantize)
        rows = config.step.head_rows if config.step.head_rows >= 0 else 64 if self.device.type == "cuda" else 0
        self.block_rows = 0 if self.skinny else rows  # elsewhere: products on blocks of this many rows (0: per session)
        self.max_context = min(int(getattr(target_config, "max_position_embeddings", 0) or 1 << 20),
                               config.sessions.max_session_tokens)
        self.eos_token_ids = eos_token_ids
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.cache = SlotShape(config.sessions.max_sessions, self.max_context)
        self.grammars = None  # a head proposes unconstrained (the coordinator checks its drafts against a grammar)
        self._draft_ids = head.target_ids(torch.arange(head.draft_vocab_size, device=self.device))  # [Vd]
        self.observers: list = []
        self.cost_curve: list[tuple[int, int, float]] = []
        self.feed_cost: list[tuple[int, int, float]] = []  # not measured: a head's catch-up is priced as nothing
        self.steps = self.step_tokens = self.evictions = 0
        self.step_base = step_id_base()  # + self.steps: the last step's id (Work.step_id)
        self._sessions: OrderedDict[str, HeadSession] = OrderedDict()
        self._running = 0  # works in the pass under way (the engine thread's, or a submitter's inline)
        self.inline = inline_steps_on(config.step.inline_steps, self.device)
        self.inline_steps = 0  # passes run on a submitter's thread

    @classmethod
    def load(cls, config: TierConfig, target_path: str) -> "HeadEngine":
        """The head at config.model.path, checked against the target at target_path (whose config, tokenizer and
        input embedding it reads: the head shares the target's embedding unless it carries its own)."""
        from specdec.models import TokenizerSource, eos_token_ids

        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        if config.step.draft_vocab.strip() not in ("0", "auto"):  # (auto: the draft tier's default)
            log.warning("--draft-vocab %s ignored: an EAGLE-3 head's vocabulary is its checkpoint's (d2t)",
                        config.step.draft_vocab)
        t0 = time.perf_counter()
        embedding, target_config = target_embedding(target_path)
        head = load_head(config.model.path, target_config, embedding, dtype=config.model.torch_dtype,
                         device=config.model.device)
        tokenizer = TokenizerSource.at(target_path)  # its facts only (the head proposes unconstrained)
        eos = eos_token_ids(SimpleNamespace(generation_config=target_config), tokenizer)
        engine = cls(config, head, target_config, eos, tokenizer.fingerprint)
        if config.cost_curve_s > 0:
            engine.cost_curve = engine.measure_cost_curve(config.cost_curve_s)
        release_thread_pool()  # this thread is done computing: the engine thread's team is the only one
        engine.start()
        log.info("loaded EAGLE-3 head %s for %s in %.1fs on %s/%s%s: reads target layers %s, draft vocabulary %d",
                 config.model.path, target_path, time.perf_counter() - t0, config.model.device, config.model.dtype,
                 f" (skinny GEMM, --quantize {config.step.quantize})" if engine.skinny else "", engine.feature_layers,
                 head.draft_vocab_size)
        return engine

    # --- the event loop's side ----------------------------------------------------------------------
    def end_session(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def status(self) -> EngineStatus:
        with self._lock:
            self._evict_idle()
            sessions = list(self._sessions.values())
            used = sum(s.cached_bytes for s in sessions)
            return EngineStatus(
                num_sessions=len(sessions), cached_tokens=sum(len(s) for s in sessions), evictions=self.evictions,
                num_running=self._running, num_waiting=len(self._inbox), kv_used_bytes=used, kv_capacity_bytes=0,
                kv_capacity_tokens=self.cache.num_slots * self.max_context, kv_resident_bytes=used,
                step_mode="eagle3-head", compile_s=0.0, steps=self.steps, step_tokens=self.step_tokens,
                inline_steps=self.inline_steps)

    # --- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and (self._paused or self._running or not self._inbox):  # (an inline pass runs)
                    self._wake.wait()
                if self._stopping:
                    break
                batch, later, seen = [], [], set()
                for w in self._inbox[: self.config.batch.max_batch_sessions]:  # one request per session per pass
                    (later if w.session_id in seen else batch).append(w)
                    seen.add(w.session_id)
                self._inbox = later + self._inbox[self.config.batch.max_batch_sessions:]
                self._running = len(batch)
            self._run_pass(batch)
        with self._lock:
            for w in self._inbox:
                _answer(w, error=RequestError(grpc.StatusCode.UNAVAILABLE, "the engine shut down"))

    def _take_inline(self, work: ProposeWork):
        """(Lock held) A lone session's pass, for its submitter's thread to run (as Engine's inline steps)."""
        others = len(self._sessions) - (work.session_id in self._sessions)
        if (not self.inline or not work.inline or self._running or self._paused or len(self._inbox) != 1 or others
                or len(work.pending) > INLINE_TOKENS):
            return None
        self._inbox.clear()
        self._running = 1
        self.inline_steps += 1
        return lambda: self._run_pass([work])

    def _run_pass(self, works: list[ProposeWork]) -> None:
        try:
            self._pass(works)
        finally:
            with self._wake:
                self._running = 0
                if self._inbox:
                    self._wake.notify()

    def _pass(self, works: list[ProposeWork]) -> None:
        started = []
        with self._lock:
            for w in works:
                if w.cancelled:
                    continue
                try:
                    self._start(w)
                    started.append(w)
                except RequestError as e:
                    _answer(w, error=e)
                except Exception as e:  # not the request's fault: it fails, its session is dropped, the engine goes on
                    log.exception("head session start failed")
                    self._sessions.pop(w.session_id, None)
                    _answer(w, error=RequestError(grpc.StatusCode.INTERNAL, f"head step failed: {type(e).__name__}: {e}"))
        out: dict[int, torch.Tensor] = {}  # id(work) -> the head's output at its last entry [1, H]
        fed: dict[int, int] = {}  # id(work) -> entries its step computed
        t0, lasts, works = time.perf_counter(), [], []
        for w in started:
            try:
                lasts.append(self._catch_up(w, out, fed))
                works.append(w)
            except Exception as e:  # the work's own failure: its session is dropped; the rest go on
                log.exception("head step failed")
                self._drop(w, f"head step failed: {type(e).__name__}: {e}")
        trees = [(w, last) for w, last in zip(works, lasts) if isinstance(w, ProposeTreeWork)]
        works, lasts = [w for w in works if not isinstance(w, ProposeTreeWork)], [
            last for w, last in zip(works, lasts) if not isinstance(w, ProposeTreeWork)]
        for w, last in trees:
            try:
                self._grow(w, last, t0, fed[id(w)])
            except Exception as e:
                log.exception("head tree failed")
                self._drop(w, f"head step failed: {type(e).__name__}: {e}")
        while works:
            try:
                rows = self._rows(lasts)
                self._finish_step(works, rows, t0, sum(fed.values()))
                works = [w for w in works if not w.done]
                t0, fed = time.perf_counter(), {id(w): 1 for w in works}
                lasts = self._draft_steps(works, out)
            except Exception as e:  # nothing of this step can be trusted: its unanswered works fail
                log.exception("head step failed")
                for w in works:
                    if not w.done:
                        self._drop(w, f"head step failed: {type(e).__name__}: {e}")
                break

    @torch.inference_mode()
    def _grow(self, w: ProposeTreeWork, last: torch.Tensor, t0: float, fed: int) -> None:
        """A token tree below the last committed token, grown level by level as the draft model's is
        (specdec.engine.tree_growth.Growth over the same distributions, specdec.engine.propose_tree.tree_dists): a
        node's entry pairs its token with its parent's output, at the position after its parent's, and attends to
        the committed entries and its ancestors' only. The nodes' entries are dropped after, like a chain's."""
        s, head = w.session, self.head
        base = len(s)
        g = Growth(w.shape, -1, base, w.dynamic)
        outs, kv = {-1: last}, {-1: None}  # node -> its output [1, H]; its entry's (k, v) [kv, 1, D]
        level = g.expand(-1, tree_dists(self._logits(last), [w])[0], w.seed, w.params.greedy)
        steps, tokens = 1, fed
        while True:
            nodes = g.to_expand(level)
            if not nodes or base + max(g.depth[n] for n in nodes) + 1 > self.max_context:
                break
            for n in nodes:
                path, a = [], n
                while a >= 0:
                    path.append(a)
                    a = g.parents[a]
                ancestors = [kv[a] for a in reversed(path[1:])]
                cache = HeadCache(*_joined(s.cache, ancestors))
                outs[n] = head.step(torch.tensor([g.tokens[n]], device=self.device), outs[g.parents[n]],
                                    torch.tensor([base - 1 + g.depth[n]], device=self.device), cache)
                kv[n] = (cache.k[:, -1:], cache.v[:, -1:])
            dists = tree_dists(self._logits(torch.cat([outs[n] for n in nodes])), [w] * len(nodes))
            level = [c for n, d in zip(nodes, dists) for c in g.expand(n, d, w.seed, w.params.greedy)]
            steps, tokens = steps + 1, tokens + len(nodes)
        seconds = time.perf_counter() - t0
        with self._lock:
            w.compute_s += seconds
            self.steps += steps
            w.last_step = (1, tokens, seconds / steps)
            w.step_started, w.step_id = t0, self.step_base + self.steps
            w.result = w._result(g, base, speculated=False)
            self.step_tokens += tokens
            s.cache.truncate(s.exact)
            s.last_used = time.monotonic()
            _answer(w, result=w.result)
        for observe in self.observers:
            observe(1, tokens, seconds)

    @torch.inference_mode()
    def _catch_up(self, w: ProposeWork, out: dict, fed: dict) -> torch.Tensor:
        """The session's entries from `exact` to its last committed token, from the target's features: the last
        entry's output [1, H], whose logits give the first proposal."""
        s, head = w.session, self.head
        t, start = len(s), min(s.exact, len(s) - 2)
        s.cache.truncate(start)
        ids = torch.tensor(s.tokens[start + 1 : t], device=self.device)
        g = head.fuse(s.features[start : t - 1].to(self.device))
        positions = torch.arange(start, t - 1, device=self.device)
        last = head.step(ids, g, positions, s.cache)[-1:]
        s.exact = t - 1
        out[id(w)] = last
        fed[id(w)] = t - 1 - start
        return last

    def _draft_steps(self, works: list[ProposeWork], out: dict) -> list[torch.Tensor]:
        """Feed each work's last draft with the head's own output at the entry before: the new entries' outputs
        [1, H] each. (A draft's entry follows its session's: it joins the session's tokens after this step.)"""
        lasts = self._steps([w.pending[-1] for w in works], [out[id(w)] for w in works],
                            [len(w.session) - 1 for w in works], [w.session.cache for w in works])
        for w, last in zip(works, lasts):
            out[id(w)] = last
        return lasts

    def _blocks(self, n: int) -> list[slice]:
        """How a step's n sessions share their products, batch-invariantly: blocks of block_rows rows (padded to
        it), all n at once on the skinny GEMM, else one session each."""
        size = self.block_rows or (max(n, 1) if self.skinny else 1)
        return [slice(i, i + size) for i in range(0, n, size)]

    @torch.inference_mode()
    def _steps(self, tokens: list[int], outs: list[torch.Tensor], positions: list[int],
               caches: list[HeadCache]) -> list[torch.Tensor]:
        """One head step of one token for each session (its output before [1, H], its position, its cache), the
        sessions' products shared as _blocks says, so a session's drafts never depend on its batch."""
        ids = torch.tensor(tokens, device=self.device)
        at = torch.tensor(positions, device=self.device)
        return [row for s in self._blocks(len(caches)) for row in self.head.step_rows(
            ids[s], torch.cat(outs[s]), at[s], caches[s], rows=self.block_rows).split(1)]

    def _rows(self, lasts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each session's logits [1, V], the LM-head products shared as _blocks says, so a session's logits never
        depend on its batch."""
        return [row for s in self._blocks(len(lasts)) for row in
                self._logits(pad_rows(torch.cat(lasts[s]), self.block_rows))[: len(lasts[s])].split(1)]

    @torch.inference_mode()
    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] float32: the draft vocabulary's logits in place, -inf elsewhere (q = 0 there)."""
        rows = torch.full((out.shape[0], self.vocab_size), float("-inf"), device=self.device)
        rows[:, self._draft_ids] = self.head.logits(out).float()
        return rows

    def _finish_step(self, works: list[ProposeWork], rows: list[torch.Tensor], t0: float, tokens: int) -> None:
        """Every work of the step draws its next token (ProposeWork's batched sampling); a finished one is answered.
        t0: when the step's head steps began; tokens: the entries they computed."""
        with self._lock:
            seconds = time.perf_counter() - t0
            self.steps += 1
            for w in works:
                if w.tokens:  # the draft just fed: the session holds it, as a draft model's cache would
                    w.session.append(w.pending[-1:])
                w.compute_s += seconds
                w.last_step = (len(works), tokens, seconds)
                w.step_started, w.step_id = t0, self.step_base + self.steps
            ProposeWork.finish_step(works, rows, self)
            self.step_tokens += tokens
            answers = []
            for w in works:
                if w.done:
                    s = w.session
                    s.cache.truncate(s.exact)  # the drafts' entries go; an accepted one is recomputed from features
                    s.last_used = time.monotonic()
                    answers.append((w, w.result, None))
            hand_back(answers)  # together: one wake-up per event loop, not one per session
        for observe in self.observers:
            observe(len(works), tokens, seconds)

    def _start(self, w: ProposeWork) -> None:
        """The work's session cropped to its prefix, its new tokens and feature rows in (lock held)."""
        self._evict_idle()
        s = self._sessions.get(w.session_id)
        if w.prefix_len == 0:
            s = HeadSession(w.session_id)
            self._sessions[w.session_id] = s
            self._evict_over()
        elif s is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"session {w.session_id!r} is not cached here; resend from the start")
        elif len(s) < w.prefix_len or s.hashes.at(w.prefix_len) != w.prefix_hash:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"session {w.session_id!r}: prefix differs at prefix_len={w.prefix_len}; resend from the start")
        s.crop(w.prefix_len)
        self._sessions.move_to_end(w.session_id)
        rows = w.features
        if rows is not None and rows.shape[0]:
            if w.features_start > s.num_features:
                self._sessions.pop(w.session_id, None)
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"features: rows start at position {w.features_start} but the replica holds rows "
                                   f"0..{s.num_features - 1} only; resend the session from the start")
            s.put_features(w.features_start, rows)
        s.append(w.pending)
        w.pending = []
        w.session = s
        needed = len(s) - 1
        if len(s) < 2 or s.num_features < needed:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"features: drafting after {len(s)} tokens needs the target's features of positions "
                               f"0..{needed - 1}; the replica holds {s.num_features} rows")

    def _drop(self, w: ProposeWork, message: str) -> None:
        with self._lock:
            self._sessions.pop(w.session_id, None)
        _answer(w, error=RequestError(grpc.StatusCode.INTERNAL, message))

    def _evict_idle(self) -> None:
        ttl = self.config.sessions.idle_ttl_s
        now = time.monotonic()
        for sid in [sid for sid, s in self._sessions.items() if s.last_used and now - s.last_used > ttl]:
            del self._sessions[sid]
            self.evictions += 1

    def _evict_over(self) -> None:
        while len(self._sessions) > self.config.sessions.max_sessions:
            self._sessions.popitem(last=False)  # least recently used (a pass's own sessions were moved to the end)
            self.evictions += 1

    # --- the cost curve -----------------------------------------------------------------------------
    @torch.inference_mode()
    def measure_cost_curve(self, budget_s: float, context: int = 32) -> list[tuple[int, int, float]]:
        """One draft step of b sessions over `context` cached entries, timed (best of 3) for b = 1, 2, 4, ... up
        to the batch limit, within budget_s: (sessions, tokens, ms), as a model tier reports its curve."""
        head, width = self.head, self.feature_width
        g = torch.Generator().manual_seed(0)
        features = torch.randn(context, width, generator=g).to(FEATURE_DTYPE)
        ids = torch.randint(0, self.vocab_size, (context,), generator=g).to(self.device)
        curve, deadline, b = [], time.perf_counter() + budget_s, 1
        while b <= self.config.batch.max_batch_sessions and time.perf_counter() < deadline:
            caches = [HeadCache() for _ in range(b)]
            outs = [head.step(ids, head.fuse(features.to(self.device)), torch.arange(context, device=self.device), c)[-1:]
                    for c in caches]
            best, first = float("inf"), int(ids[0])
            for _ in range(3):
                _sync(self.device)  # (on a GPU: each timing from idle to its own end, as a step's answer waits)
                t0 = time.perf_counter()
                self._rows(self._steps([first] * b, outs, [context] * b, caches))  # as a step runs
                _sync(self.device)
                for c in caches:
                    c.truncate(context)
                best = min(best, time.perf_counter() - t0)
            curve.append((b, b, best * 1e3))
            b *= 2
        return curve


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _joined(cache: HeadCache, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed cache's keys and values followed by a node's ancestors' entries."""
    if not entries:
        return cache.k, cache.v
    return (torch.cat([cache.k, *(k for k, _ in entries)], dim=1), torch.cat([cache.v, *(v for _, v in entries)], dim=1))


def _answer(work: ProposeWork, result=None, error: Exception | None = None) -> None:
    """Resolve a work's future on its event loop, as the model engine does (a caller that went away is skipped)."""
    hand_back([(work, result, error)])
