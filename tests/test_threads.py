"""The engine thread's OpenMP team is its process's only one (specdec.engine.threads).

A pool left on the loading thread makes libgomp throttle the engine's spin-waits (1.7x on a step,
measured). Each check runs in a fresh interpreter with 2 torch threads, where OS threads are counted
exactly: releasing a 2-thread pool ends its one worker thread.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specdec.engine.threads import SPIN_COUNT, _libgomp


# PyTorch's Linux wheels ship GNU OpenMP; elsewhere release_thread_pool is a no-op by design.
pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(sys.platform != "linux", reason="GNU OpenMP (libgomp) is what Linux torch wheels use")]


# A released pool's worker exits on its own time (libgomp does not join it): `settled` waits for the count to
# drop below `before`, up to `timeout` seconds, so a loaded machine reads the same as an idle one.
COUNT = """import os, time
def threads():
    return len(os.listdir('/proc/self/task'))
def settled(before, timeout):
    end = time.monotonic() + timeout
    while threads() >= before and time.monotonic() < end:
        time.sleep(0.01)
    return threads()
"""


def test_torch_here_runs_on_libgomp():
    assert _libgomp() is not None


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", COUNT + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_release_ends_the_calling_threads_pool():
    out = run("""
        import torch
        from specdec.engine.threads import release_thread_pool
        torch.set_num_threads(2)
        x = torch.randn(4_000_000)
        (x * 2).sum()  # a parallel region: this thread now keeps a pool of 2
        before = threads()
        released = release_thread_pool()
        after = settled(before, 30)
        (x * 2).sum()  # torch still works: a new pool
        print(released, before - after, threads() - after)
    """)
    assert out == "True 1 1"


def test_an_engine_leaves_no_pool_on_the_thread_that_loaded_it(tiny_target):
    """After Engine.load (which runs forwards on this thread) and a request on the engine thread, this
    thread has no pool left to release: the engine's team is the process's only one."""
    out = run(f"""
        import asyncio, torch
        from specdec.engine.config import TierConfig
        from specdec.engine.engine import Engine
        from specdec.engine.propose import ProposeWork
        from specdec.engine.threads import release_thread_pool
        from specdec.math.params import SamplingParams
        from specdec.models import ModelConfig
        torch.set_num_threads(2)
        engine = Engine.load(TierConfig(ModelConfig({tiny_target!r})))

        async def propose():
            work = ProposeWork.create("s", 0, 0, list(range(5, 300)), 3, SamplingParams(), seed=1, top_n=8)
            return await engine.submit(work)

        assert len(asyncio.run(propose()).tokens) == 3
        before = threads()
        release_thread_pool()  # a no-op unless Engine.load left a pool here
        print(before - settled(before, 2))
        engine.close()
    """)
    assert out == "0"


@pytest.mark.parametrize("tier", ["target_service", "draft_service"])
def test_a_tier_shortens_the_spin_before_torch_loads_and_an_operators_value_wins(tier):
    """A tier's entry point sets GOMP_SPINCOUNT (libgomp reads it once, when torch loads it) before anything
    imports torch; an operator's GOMP_SPINCOUNT is kept, and so is an OMP_WAIT_POLICY (which GOMP_SPINCOUNT
    would override)."""
    out = run(f"""
        import os, sys
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ.pop("OMP_WAIT_POLICY", None)
        seen = []

        class Watch:  # notes the setting at the moment torch is first imported
            def find_spec(self, name, path=None, target=None):
                if name == "torch" and not seen:
                    seen.append(os.environ.get("GOMP_SPINCOUNT"))
                return None

        sys.meta_path.insert(0, Watch())
        import {tier}.__main__
        print(seen, os.environ["GOMP_SPINCOUNT"])
    """)
    assert out == f"['{SPIN_COUNT}'] {SPIN_COUNT}"
    kept = run(f"""
        import os
        os.environ["GOMP_SPINCOUNT"] = "123"
        import {tier}.__main__
        print(os.environ["GOMP_SPINCOUNT"])
    """)
    assert kept == "123"
    passive = run(f"""
        import os
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        import {tier}.__main__
        print(os.environ.get("GOMP_SPINCOUNT"))
    """)
    assert passive == "None"
