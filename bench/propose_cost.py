"""The draft tier's Propose, in-process: ms per Propose of K greedy tokens for B sessions at once, step by step
against the draft chain (specdec.engine.draft_chain), with the draft's weights as the tier serves them by
default. bench.step_cost reports it beside the draft's step curve.
"""

from __future__ import annotations

import statistics
import time


def propose_cost(path: str, device: str, dtype: str, mode: str, ks: tuple[int, ...], batches: tuple[int, ...],
                 repeats: int, prefix: int) -> dict:
    """ms per Propose of K tokens (B sessions at once, greedy, a `prefix`-token context) through the draft
    engine in-process, with the draft chain on and off (specdec.engine.draft_chain); its weights as the draft tier
    serves them by default (--quantize auto)."""
    import asyncio

    from specdec.core.prefix import PrefixHashes
    from specdec.engine.config import StepConfig, TierConfig
    from specdec.engine.engine import Engine
    from specdec.engine.propose import ProposeWork
    from specdec.math.params import SamplingParams
    from specdec.models import ModelConfig

    prompt = list(range(1000, 1000 + prefix))
    head = PrefixHashes(prompt).at(prefix - 1)
    out = {}
    for chain in (False, True):
        engine = Engine.load(TierConfig(ModelConfig(path, device=device, dtype=dtype),
                                        step=StepConfig(mode=mode, draft_chain=chain, quantize="auto")))  # as served

        async def propose(b: int, k: int, fresh: bool):
            works = [ProposeWork.create(f"s{i}", 0 if fresh else prefix - 1, 0 if fresh else head,
                                        prompt if fresh else prompt[-1:], k, SamplingParams(), seed=i, top_n=16)
                     for i in range(b)]
            with engine.paused():  # one batch
                tasks = [asyncio.ensure_future(engine.submit(w)) for w in works]
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)

        try:
            asyncio.run(propose(max(batches), 1, True))  # every session holds the prompt
            for b in batches:
                for k in ks:
                    asyncio.run(propose(b, k, False))  # warm
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        asyncio.run(propose(b, k, False))
                        times.append((time.perf_counter() - t0) * 1e3)
                    out[(chain, b, k)] = statistics.median(times)
        finally:
            engine.close()
    return out
