"""One OpenMP team per tier process: the engine thread's.

A tier computes on its engine thread (specdec.engine.engine), but it loads and warms its model on the
thread that calls Engine.load, usually the process's main thread. Every thread that runs a parallel
torch op keeps an OpenMP thread pool of its own for the life of the thread, so after loading the process
holds two teams: the main thread's, idle, and the engine thread's. GNU OpenMP (libgomp, the runtime in
PyTorch's Linux wheels) counts every thread it manages, and once they outnumber the CPUs it stops
spin-waiting between parallel regions (GOMP_SPINCOUNT falls to a throttled ~100 spins): each of the
hundreds of small parallel regions in a decode step then wakes its workers through the kernel. Measured
on this project's 2-core machine, a forward run from a second thread took 1.7x the same forward run
from the thread that loaded the model (the default target's packed step 66.7 ms against 39.7 ms; the
draft's 4.9 ms against 2.7 ms), and no flag or environment variable lifts the throttle.

release_thread_pool() hands the calling thread's pool back (OpenMP 5.0's omp_pause_resource_all, soft
pause: libgomp frees that thread's pool and its managed-thread count drops), so the engine thread's team
is the process's only one and spins as it would on a single-threaded program. The engine calls it on
the loading thread once the model is warm. Any later parallel torch op on that thread would make a new
pool; the servicers only build small tensors there (below torch's parallel grain), which run inline.
With another OpenMP runtime (LLVM's libomp on macOS, Intel's) this is a no-op: their soft pause stops
every team's threads, not just the caller's.

How long the team spins: libgomp's workers spin GOMP_SPINCOUNT times after a parallel region before they
sleep, 300,000 by default (milliseconds: a pause instruction each), so after each step a tier's workers
held their cores through the whole round trip, where the coordinator and every process's gRPC threads need
them on a shared CPU. A tier sets SPIN_COUNT (a fraction of a millisecond: longer than the gaps between a
step's regions, shorter than a round's wait) unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set
(`spin_briefly`, at its entry point, before torch loads libgomp). Measured on the 2-core Xeon, the default
target at K = 0 through `run-local`, 8 interleaved pairs of 256-token runs: the coordinator's time per round
-11% (7 of 8 pairs lower), network + gRPC -6%, tokens/s +3% (docs/performance.md, Per-round overhead).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft
SPIN_COUNT = "10000"  # a tier's libgomp workers spin this many times (well under 1 ms) after a region, then sleep


def spin_briefly() -> None:
    """A tier's entry point, before torch loads: its OpenMP workers spin SPIN_COUNT times, not libgomp's
    300,000, unless the operator chose: GOMP_SPINCOUNT or OMP_WAIT_POLICY set (libgomp lets GOMP_SPINCOUNT
    override the policy, so setting it beside PASSIVE would undo the operator's choice)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (libgomp only); True if it was released. Call it on a
    thread that will run no more heavy torch work, after its last parallel op."""
    lib = _libgomp()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if rc != 0:
        log.warning("omp_pause_resource_all failed (%d) on thread %s", rc, threading.current_thread().name)
    return rc == 0
