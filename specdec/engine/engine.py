"""The tier engine: a model serving many sessions, one batched forward at a time.

Servicers submit works from the event loop and await them. One engine thread runs the step loop:

    wait     if the sessions of the last step usually send their next request within a few
             milliseconds (the target, between a session's rounds), wait that long for them, bounded
             by coalesce_ms, so they share one step instead of splitting into two half-full ones
    plan     the scheduler picks the running and waiting works that fit the step's budget
    forward  the runner runs ONE forward over all their new tokens (ragged, over the slot KV cache)
    finish   each kind of work consumes its logits for all its works at once (batched verification,
             batched draft sampling) and commits or rolls back each session: a length change

A failure that belongs to one work (a prefix mismatch, non-finite logits, a cancelled caller) settles
that work alone; the rest of its batch completes.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

import grpc
import torch

from specdec.engine.config import TierConfig
from specdec.engine.draft_vocab_head import vocabulary_head
from specdec.engine.cost_curve import measure as measure_cost_curve, measure_feed
from specdec.engine.engine_thread import INLINE_TOKENS, PUSH, Answer, EngineStatus, EngineThread, hand_back, inline_steps_on
from specdec.engine.grammar import GrammarCache
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import Feed, ModelRunner
from specdec.engine.scheduler import DROPPED, STARTED, WAIT, Planned, Scheduler
from specdec.engine.sessions import PrefixMismatch, SessionTable
from specdec.engine.step import resolve_mode
from specdec.engine.threads import release_thread_pool
from specdec.engine.tier_model import load_tier_model
from specdec.engine.work import Work, step_id_base
from specdec.models import TokenizerSource, eos_token_ids, max_context
from specdec.core.errors import RequestError

log = logging.getLogger(__name__)


StepObserver = Callable[[int, int, float], None]  # (sessions, tokens, seconds) of each step

class Engine(EngineThread):
    feature_draft = False  # a model's own engine (specdec.engine.head_engine.HeadEngine drafts from features)

    def __init__(self, config: TierConfig, model, tokenizer: TokenizerSource) -> None:
        config.batch.validate()
        super().__init__(config.batch.max_queue)
        need = config.max_draft_tokens + 1
        if config.batch.max_batch_tokens < need:
            raise ValueError(f"max_batch_tokens must be >= max_draft_tokens + 1 = {need}")
        self.config = config
        self.max_context = min(max_context(model), config.sessions.max_session_tokens)
        geometry = KVGeometry.of(model)
        slots = config.sessions.max_sessions
        if config.sessions.kv_memory_gib > 0:  # the pool sized from a memory budget instead
            slots = SlotKVCache.slots_for_budget(geometry, self.max_context, int(config.sessions.kv_memory_gib * 2**30))
        graphs = resolve_mode(config.step.mode, geometry.device) == "cuda-graphs"
        self.cache = SlotKVCache(geometry, slots, self.max_context, scratch=graphs)
        self.runner = ModelRunner(model, self.cache, config.step)
        self.device = self.cache.geometry.device
        self.vocab_size = self.runner.vocab_size
        head = vocabulary_head(model)
        self.draft_columns = head.columns if head is not None else None  # a draft vocabulary's N lowest ids
        # Feature taps (Feed.taps): layer ids below num_layers, hidden_size numbers per layer and position
        self.num_layers, self.hidden_size = int(model.config.num_hidden_layers), int(model.config.hidden_size)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.tokenizer_fingerprint = tokenizer.fingerprint
        self.grammars = GrammarCache(tokenizer.load, self.vocab_size, list(self.eos_token_ids))  # the draft's masked q
        self.sessions = SessionTable(config.sessions, self.cache)
        self.scheduler = Scheduler(config.batch)
        self.observers: list[StepObserver] = []
        self.steps = 0
        self.step_base = step_id_base()  # + self.steps: the last step's id (Work.step_id)
        self.chains = 0  # chains run (a draft's proposal, a lone session's run-on), each of several steps
        self.step_tokens = 0
        self.cost_curve: list[tuple[int, int, float]] = []  # (sessions, tokens, ms) timed at start (load())
        self.feed_cost: list[tuple[int, int, float]] = []  # (1, tokens, ms): prefills timed at start (load())
        # Answers settled in this pass of the step loop, handed to the event loop together (_hand_back):
        # one wake-up per step and event loop, not one per session. Engine thread only.
        self._answers: list[Answer] = []  # (work, result, error | PUSH)
        self._busy = False  # a thread holds a plan and runs its step: the engine thread, or a submitter inline
        self.inline = inline_steps_on(config.step.inline_steps, self.device)
        self.inline_steps = 0  # steps run on a submitter's thread
        # Step coalescing: the sessions whose work finished in the last step (and when), and how long
        # sessions take to send their next request (exponentially weighted, seconds; None = not seen yet).
        self._returning: dict[str, float] = {}
        self._return_gap_s: float | None = None
        self._last_step_end = 0.0

    @classmethod
    def load(cls, config: TierConfig) -> "Engine":
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        t0 = time.perf_counter()
        engine = cls(config, load_tier_model(config), TokenizerSource.at(config.model.path))
        engine.warm_up()
        b, t1 = config.batch, time.perf_counter()
        engine.cost_curve = measure_cost_curve(engine.runner, engine.cache, b.max_batch_sessions, b.max_batch_tokens,
                                               config.cost_curve_s)
        engine.feed_cost = measure_feed(engine.runner, engine.cache, b.max_batch_tokens) if engine.cost_curve else []
        log.info("step cost measured at %d batch sizes in %.1fs", len(engine.cost_curve), time.perf_counter() - t1)
        release_thread_pool()  # this thread is done computing: the engine thread's team is the only one
        _return_free_heap()
        engine.start()
        m, cache = config.model, engine.cache
        log.info("loaded %s in %.1fs on %s/%s, %s steps (compiling / capturing took %.1fs); KV pool: %d slots x %d "
                 "tokens, at most %.0f MiB, %.0f MiB resident now", m.path, time.perf_counter() - t0, m.device, m.dtype,
                 engine.runner.mode + "".join(f" ({what})" for what, on in (("skinny GEMM", engine.runner.program.skinny),
                                                                        ("row attention", engine.runner.row_attention)) if on),
                 engine.runner.compile_s, cache.num_slots, cache.slot_tokens,
                 cache.capacity_bytes / 2**20, cache.resident_bytes / 2**20)
        return engine

    def warm_up(self) -> None:
        """A prefill and a few decode-sized forwards, so the first request pays no lazy initialisation: this
        is where the step program compiles (both of its graphs) or captures its CUDA graphs."""
        slot = self.cache.allocate()
        try:
            self.runner.forward([Feed(slot, 0, [0] * 16, 1)])
            for n in (1, 5):
                self.runner.forward([Feed(slot, 16, [0] * n, n)])
            if self.runner.graphs is not None:
                self.runner.graphs.capture_at_start()
        finally:
            self.cache.release(slot)

    # --- the event loop's side ----------------------------------------------------------------------

    def _queued(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)

    def _submitted(self, work: Work) -> None:
        finished_at = self._returning.pop(work.session_id, None)  # how soon its session came back (coalescing)
        if finished_at is not None:
            gap = work.submitted_at - finished_at
            self._return_gap_s = gap if self._return_gap_s is None else 0.9 * self._return_gap_s + 0.1 * gap

    def end_session(self, session_id: str) -> bool:
        with self._lock:
            self._returning.pop(session_id, None)
            return self.sessions.remove(session_id)

    def status(self) -> EngineStatus:
        with self._lock:
            self.sessions.evict_idle()
            s = self.sessions
            return EngineStatus(
                num_sessions=len(s), cached_tokens=s.cached_tokens - s.retained_tokens, evictions=s.evictions,
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting) + len(self._inbox),
                kv_used_bytes=(s.cached_tokens - s.retained_tokens) * self.cache.geometry.bytes_per_token,
                kv_capacity_bytes=self.cache.capacity_bytes, kv_capacity_tokens=self.cache.capacity_tokens,
                kv_resident_bytes=self.cache.resident_bytes, step_mode=self.runner.mode, compile_s=self.runner.compile_s,
                steps=self.steps, step_tokens=self.step_tokens, prefix_cache_sessions=s.retained,
                prefix_cache_tokens=s.retained_tokens, prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
                inline_steps=self.inline_steps)

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and (self._paused or self._busy or not (self._inbox or len(self.scheduler))):
                    self._wake.wait()
                if self._stopping:
                    break
                self._coalesce()
                plan = self._plan()
            self._run_step(plan, idle=0.001)  # nothing to step: only works blocked on a busy session or a free slot
        with self._lock:
            for work in [*self._inbox, *self.scheduler.waiting, *self.scheduler.running]:
                self._fail(work, grpc.StatusCode.UNAVAILABLE, "the engine shut down")
        self._hand_back()

    def _plan(self) -> list[Planned]:
        """(Lock held) The next step, taken by the calling thread: the inbox queued, the plan made."""
        self.scheduler.waiting.extend(self._inbox)
        self._inbox.clear()
        self._drop_cancelled()
        self._busy = True
        return self.scheduler.plan(self._start)

    def _take_inline(self, work: Work) -> Callable[[], None] | None:
        """(Lock held) The step `work` may run on its submitter's thread, the event loop's: when the engine is
        idle, the work small and its session the engine's only one, and no step would wait for another session,
        two thread hand-offs (the work to the engine thread, its answer back: ~0.1 ms each on a small CPU) cost
        more than such a step. Under load every step stays the engine thread's, batched (docs/DESIGN.md, The
        split's cost)."""
        n = len(self.sessions)
        alone = n == 0 or (n == 1 and work.session_id in self.sessions)
        if (not (self.inline and work.inline and alone) or self._busy or self._paused or len(self._inbox) != 1
                or len(self.scheduler) or len(work.pending) > INLINE_TOKENS
                or (self._coalescing() or 0.0) > time.perf_counter()):
            return None
        self.inline_steps += 1
        plan = self._plan()
        return lambda: self._run_step(plan)  # one step: a work that needs more goes on in the engine thread

    def _run_step(self, plan: list[Planned], idle: float = 0.0) -> None:
        """Run a plan's step (or wait `idle` seconds if it has none), then free the engine for the next."""
        try:
            self._hand_back()  # works answered without a step (a speculation cache hit, a refused prefix)
            if plan:
                self._step(plan)
            elif idle:
                time.sleep(idle)
        finally:
            with self._wake:
                self._busy = False
                if self._inbox or len(self.scheduler):
                    self._wake.notify()

    def _coalescing(self) -> float | None:
        """(Lock held) Until when the next step would wait for the last step's sessions (None: it would not)."""
        limit = self.config.batch.coalesce_ms / 1e3
        gap = self._return_gap_s
        if not limit or gap is None or gap >= limit or not self._returning:
            return None
        return self._last_step_end + limit

    def _coalesce(self) -> None:
        """Hold the next step (lock held) while the last step's sessions are expected back soon."""
        deadline = self._coalescing()
        if deadline is None:
            return
        while self._returning and not self._stopping and not self._paused:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._wake.wait(left)
        self._returning.clear()  # those not back by now are not waited for again

    def _start(self, work: Work) -> str:
        if work.cancelled:
            return DROPPED
        try:
            # A fresh start may take a cached prefix of its tokens, leaving those it needs logits of (and
            # features of: a work with taps or wanting every row takes none).
            fresh = work.prefix_len == 0 and not (work.taps or work.all_rows)
            reusable = len(work.pending) - work.num_logits if fresh else 0
            session = self.sessions.acquire(work.session_id, work.prefix_len, work.prefix_hash, work.pending, reusable)
        except PrefixMismatch as e:
            self._settle(work, error=RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)))
            return DROPPED
        if session is None:
            return WAIT  # every slot is busy
        work.session = session
        if work.prefix_len == 0 and session.reused:
            work.reused = session.reused
            del work.pending[: session.reused]
        work.on_start(self)
        if work.done:  # answered from what the session already held, with no step
            self.sessions.release(session)
            self._settle(work, result=work.result)
            return DROPPED
        return STARTED

    def respond(self, work: Work, result) -> None:
        """Answer a work's caller now while the work runs on (the draft pre-drafting the next round after its
        proposal); its final result is then not sent again. Engine thread only."""
        self._settle(work, result=result)
        work.answered = True

    def push(self, work: Work, results: list) -> None:
        """Send a work's caller results it did not ask for (work.on_push), with the pass's answers. Engine thread."""
        if work.on_push is not None and results:
            self._answers.append((work, results, PUSH))

    def others_waiting(self) -> bool:
        """Whether any work waits for a step (lock held: engine thread only)."""
        return bool(self._inbox or self.scheduler.waiting)

    def queued(self, session_id: str) -> Work | None:
        """The first request of this session that waits for a step, if any (lock held: engine thread only)."""
        return next((w for w in [*self.scheduler.waiting, *self._inbox] if w.session_id == session_id), None)

    def _step(self, plan: list[Planned]) -> None:
        feeds = [Feed(p.work.session.slot, len(p.work.session), p.work.pending[: p.take], p.num_logits,
                      p.work.feed_tree() if p.complete else None, p.work.taps) for p in plan]
        tokens = sum(p.take for p in plan)
        t0 = time.perf_counter()
        try:
            logits, finite = self.runner.forward_checked(feeds)
        except Exception as e:  # the model itself failed: nothing of this step can be trusted
            log.exception("forward failed")
            with self._lock:
                for p in plan:
                    self._fail(p.work, grpc.StatusCode.INTERNAL, f"forward failed: {type(e).__name__}: {e}", drop=True)
            self._hand_back()
            return
        seconds = time.perf_counter() - t0
        with self._lock:
            self.steps += 1
            self.step_tokens += tokens
            completed: dict[type, list[tuple[Work, torch.Tensor]]] = {}
            chains: dict[type, list[Work]] = {}  # works to finish as draft chains, after the lock
            for p, feed, rows, ok in zip(plan, feeds, logits, finite):
                w = p.work
                if feed.features is not None:  # a prefill chunk's too: the work gathers them over its steps
                    w.fed_features.append(feed.features)
                self.sessions.append(w.session, w.pending[: p.take])
                del w.pending[: p.take]
                w.compute_s += seconds
                w.last_step = (len(plan), tokens, seconds)
                w.step_started, w.step_id = t0, self.step_base + self.steps
                w.first_step_at = w.first_step_at or t0
                if w.cancelled:
                    self._finish(w)
                elif p.num_logits and not ok:
                    self._fail(w, grpc.StatusCode.INTERNAL, "model produced non-finite logits; session dropped", drop=True)
                elif p.num_logits:
                    if w.all_rows:  # its rows before the feed's last num_logits (a prefill chunk's: all) scored now
                        try:
                            rows = w.score_fed(rows, p.complete)
                        except Exception as e:
                            log.exception("scoring the fed tokens failed")
                            self._fail(w, grpc.StatusCode.INTERNAL, f"scoring failed: {type(e).__name__}: {e}", drop=True)
                            continue
                    if p.complete:
                        completed.setdefault(type(w), []).append((w, rows))
            for kind, items in completed.items():
                works = [w for w, _ in items]
                try:
                    kind.finish_step(works, [rows for _, rows in items], self)
                except Exception as e:
                    log.exception("%s step failed", kind.kind)
                    for w in works:
                        self._fail(w, grpc.StatusCode.INTERNAL, f"{kind.kind} failed: {type(e).__name__}: {e}", drop=True)
                    continue
                for w in works:
                    if w.done:
                        self._done(w)
                chained = [w for w in works if w.chain_steps and not w.done]
                if chained:
                    chains[kind] = chained
            self._last_step_end = time.perf_counter()
        self._hand_back()
        for observe in self.observers:
            observe(len(plan), tokens, seconds)
        for kind, works in chains.items():
            self._chain(kind, works)

    def _done(self, work: Work) -> None:
        self._finish(work)
        self._settle(work, result=work.result)
        self._returning[work.session_id] = time.perf_counter()

    def _chain(self, kind: type, works: list[Work]) -> None:
        """The works' remaining steps as draft chains (Work.run_chain), one per number of steps left, outside
        the lock like any forward; each forward of a chain counts as a step."""
        groups: dict[int, list[Work]] = {}
        for w in works:
            groups.setdefault(w.chain_steps, []).append(w)
        for steps, group in groups.items():
            t0 = time.perf_counter()
            try:
                kind.run_chain(group, self)
            except Exception as e:
                log.exception("%s chain failed", kind.kind)
                with self._lock:
                    for w in group:
                        self._fail(w, grpc.StatusCode.INTERNAL, f"{kind.kind} failed: {type(e).__name__}: {e}", drop=True)
                self._hand_back()
                continue
            seconds = time.perf_counter() - t0
            with self._lock:
                self.steps += steps
                self.chains += 1
                self.step_tokens += steps * len(group)
                for w in group:
                    w.compute_s += seconds
                    w.last_step = (len(group), len(group), seconds / steps)  # its last step: the chain's last forward
                    w.step_started = t0 + seconds * (steps - 1) / steps
                    w.step_id = self.step_base + self.steps
                kind.finish_chain(group, self)
                for w in group:
                    self._done(w)
                self._last_step_end = time.perf_counter()
            self._hand_back()
            for observe in self.observers:  # one observation per forward, as for any step
                for _ in range(steps):
                    observe(len(group), len(group), seconds / steps)

    def _drop_cancelled(self) -> None:
        for w in [w for w in self.scheduler.waiting if w.cancelled]:
            self.scheduler.waiting.remove(w)

    def _finish(self, work: Work) -> None:
        """The work leaves the step loop; its session is free for the next request."""
        if work in self.scheduler.running:
            self.scheduler.finished(work)
        if work.session is not None:
            self.sessions.release(work.session)

    def _fail(self, work: Work, code: grpc.StatusCode, message: str, drop: bool = False) -> None:
        if drop and work.session is not None:
            self.sessions.drop(work.session)
            work.session = None
        self._finish(work)
        self._settle(work, error=RequestError(code, message))

    def _settle(self, work: Work, result=None, error: Exception | None = None) -> None:
        """Answer a work (engine thread): queued for the pass's _hand_back."""
        if work.answered:
            return
        work.settled_at = time.perf_counter()
        self._answers.append((work, result, error))

    def _hand_back(self) -> None:
        """Hand this pass's answers to their event loops: one wake-up per loop (none for an inline step's)."""
        if self._answers:
            answers, self._answers = self._answers, []
            hand_back(answers)


def _return_free_heap() -> bool:
    """Hand the memory that loading freed back to the system (glibc's malloc_trim): the load's and the warm-up's
    temporaries (a GGUF's raw blocks before packing, the cost curve's largest batches) leave their pages in the
    heap otherwise: the default target tier's resident memory 637 -> 560 MiB. False where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
