"""What every bench shares: the repository's paths, a progress log, the machine a run measured on (CPU,
memory, GPU, versions, git commit), how busy the rest of the machine was, markdown tables, free ports, and
appending a run's section to this month's log, docs/bench-logs/YYYY-MM.md (docs/BENCHMARKS.md: the current
figures, one per thing measured, each citing its section)."""

from __future__ import annotations

import datetime as dt
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from specdec.serving.ports import free_port  # noqa: F401 (the one definition; benches import it from here)

REPO = Path(__file__).resolve().parent.parent
BENCH_LOGS = REPO / "docs" / "bench-logs"  # the dated run logs, one file per month
T_START = time.time()
DISTURBED = 0.10  # a timed generation during which other processes used more CPU than this is "disturbed"


def log(msg: str) -> None:
    """Progress on stderr, stamped with the seconds since the bench started."""
    print(f"[{time.time() - T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, the separator, one line per row (cells as str())."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def bench_log(when: float | None = None) -> Path:
    """The month's run log (UTC) where every bench appends its section: docs/bench-logs/YYYY-MM.md."""
    return BENCH_LOGS / (time.strftime("%Y-%m", time.gmtime(when)) + ".md")


def log_header(path: Path) -> str:
    """The first lines of a new month's log."""
    return (f"# Benchmark runs, {path.stem}\n\nEvery run `make bench` made this month, as it appended them (newest "
            "last): each section names its command, machine and commit. The current figures, one per thing measured, "
            "are on [BENCHMARKS.md](../BENCHMARKS.md).\n")


def plot_dir(out: str | Path) -> Path:
    """Where a bench draws its plots: docs/ for a log under docs/ (the README and BENCHMARKS.md show them
    there), else beside the file written."""
    out = Path(out).resolve()
    docs = REPO / "docs"
    return docs if out.is_relative_to(docs) else out.parent


def append_section(section: str, path: str | Path | None = None, header: str | None = None) -> None:
    """Append a run's section (markdown) to path (default: this month's log), starting the file with `header`
    (default: log_header's) if it is empty or new."""
    path = Path(path) if path else bench_log()
    header = header if header is not None else log_header(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else ""
    if not existing.strip():
        existing = header
    path.write_text(existing.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")


def section_head(title: str, module: str, argv: Sequence[str] | None, setup: str) -> list[str]:
    """A run's section heading and first paragraph: the UTC time and title, the command as run (argv: the bench's
    arguments, None: this process's), the machine's CPU and cores and the commit, then `setup`."""
    m = machine_info()
    command = f"python -m {module} " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    return [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: {title}", "",
            f"Command: `{command.strip()}`. Machine: {m['cpu']}, {m['cores']} cores; git {git_commit()}; {setup}", ""]


def publish(section: str, out: str | None) -> None:
    """Print a run's section and append it to `out` (None: this month's log; "": nowhere)."""
    print(section)
    if out != "":
        append_section(section, out)


def machine_info() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)), "memory": mem,
            "python": platform.python_version(), "os": platform.platform(), "git": git_commit()}
    try:
        import torch
        import transformers
        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        info["torch_threads_default"] = torch.get_num_threads()
        info["cpu"] = f"{cpu} ({torch.backends.cpu.get_cpu_capability()})"  # the vector ISA the kernels are built for
    except ImportError:
        pass
    try:
        import grpc
        info["grpc"] = grpc.__version__
    except ImportError:
        pass
    return info


def gpu_name(device: str = "cuda") -> str:
    """The GPU's name, memory and driver as nvidia-smi reports them (no CUDA context in this process),
    else as torch does; "?" if neither can tell."""
    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            name, memory, driver = [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]
            return f"{name} ({memory}, driver {driver})"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except Exception:
        return "?"


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        commit = rev.stdout.strip() or "unknown"
        st = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                            capture_output=True, text=True, timeout=10)
        if st.returncode == 0 and st.stdout.strip():
            commit += " (+ uncommitted changes)"
        return commit if commit != "unknown" else os.environ.get("SPECDEC_GIT_COMMIT", commit)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SPECDEC_GIT_COMMIT", "unknown")  # a copy without .git (e.g. on a lent GPU machine)


class CpuMeter:
    """How much CPU other processes used while we ran: /proc/stat busy time minus our own (and our
    children's, once waited for) user + system time."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.busy0 = self._busy()
        self.ours0 = self._ours()

    @staticmethod
    def _busy() -> float:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
            return (f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")

    @staticmethod
    def _ours() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def other_fraction(self) -> float:
        wall = time.time() - self.t0
        other = (self._busy() - self.busy0) - (self._ours() - self.ours0)
        return max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else float("nan")


def background_load(seconds: float = 1.0) -> float:
    m = CpuMeter()
    time.sleep(seconds)
    return m.other_fraction()


def wait_idle(max_s: float, what: str) -> float:
    """Wait (up to max_s) until other processes use < 10% of the CPU over 2 s; returns the last reading."""
    deadline = time.time() + max_s
    load = background_load(2.0)
    if load > DISTURBED and max_s > 0:
        log(f"{what}: other processes use {load:.0%} of the CPU; waiting up to {max_s:.0f}s for quiet")
        while load > DISTURBED and time.time() < deadline:
            load = background_load(2.0)
        log(f"{what}: " + ("quiet now" if load <= DISTURBED else f"still {load:.0%} busy; going on anyway"))
    return load
