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
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft


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
