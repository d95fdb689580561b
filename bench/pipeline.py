"""specdec measurements: the three services as real processes on loopback, driven by the Python client."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc

from specdec.client import Client
from specdec.client.local import LocalPipeline, LocalPipelineConfig


class BenchPipeline(LocalPipeline):
    """LocalPipeline that can pin each tier process to a CPU set right after it is spawned."""

    def __init__(self, config: LocalPipelineConfig, affinity: dict[str, set[int]] | None = None) -> None:
        super().__init__(config)
        self.affinity = affinity or {}

    def _spawn(self, name: str, *args, **kwargs) -> None:  # whatever LocalPipeline._spawn takes after the name
        super()._spawn(name, *args, **kwargs)
        cpus = self.affinity.get(name)
        proc = self.procs.get(name)
        if cpus and proc is not None:
            try:
                os.sched_setaffinity(proc.pid, cpus)  # before the interpreter has started any thread
            except OSError:
                pass

    def restart_coordinator(self, extra_args: list[str]) -> None:
        """A fresh coordinator process (an empty shared suffix tree) over the same tiers, with
        extra_args after the configured coordinator args."""
        proc = self.procs.get("coordinator")
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        (self.dir / "coordinator.port").unlink(missing_ok=True)
        draft = f"127.0.0.1:{self.ports['draft']}" if "draft" in self.ports else ""
        self._spawn("coordinator", "coordinator", [
            "--target", f"127.0.0.1:{self.ports['target']}", "--draft", draft, "--tokenizer", self.config.target_model,
            *self.config.coordinator_args, *extra_args])
        self._wait_port("coordinator", time.monotonic() + self.config.start_timeout_s)

    def pin_all_threads(self) -> dict[str, str]:
        """Pin every thread of every tier (threads started before _spawn's pin are caught here);
        returns each process's allowed-CPU list as the kernel reports it."""
        seen = {}
        for name, proc in self.procs.items():
            cpus = self.affinity.get(name)
            task_dir = Path(f"/proc/{proc.pid}/task")
            if cpus:
                for tid in _listdir(task_dir):
                    try:
                        os.sched_setaffinity(int(tid), cpus)
                    except (OSError, ValueError):
                        pass
            allowed = set()
            for tid in _listdir(task_dir):
                v = _status_field(task_dir / tid / "status", "Cpus_allowed_list")
                if v:
                    allowed.add(v)
            seen[name] = " | ".join(sorted(allowed)) or "?"
        return seen

    def environ(self, var: str) -> dict[str, str | None]:
        """The value of an environment variable as each tier process actually got it."""
        out = {}
        for name, proc in self.procs.items():
            try:
                env = dict(x.split("=", 1) for x in Path(f"/proc/{proc.pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in x)
                out[name] = env.get(var)
            except OSError:
                out[name] = "?"
        return out

    def memory(self) -> dict[str, dict]:
        """Peak (VmHWM) and current (VmRSS) resident memory of each tier process, KiB."""
        out = {}
        for name, proc in self.procs.items():
            path = Path(f"/proc/{proc.pid}/status")
            out[name] = {"peak_rss_kib": _kib(_status_field(path, "VmHWM")), "rss_kib": _kib(_status_field(path, "VmRSS")),
                         "threads": int(_status_field(path, "Threads") or 0)}
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """user + system CPU seconds of each tier process so far."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                out[name] = float("nan")
                continue
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                out[name] = float("nan")
        return out


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _status_field(path: Path, field: str) -> str | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _kib(value: str | None) -> int:
    try:
        return int(value.split()[0]) if value else 0
    except ValueError:
        return 0


def _error_text(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        try:
            return f"{e.code().name}: {e.details()}"
        except Exception:
            pass
    return f"{type(e).__name__}: {e}"


# Proposers the request enum cannot name yet: the row's coordinator is started with it as its default.
DEFAULT_ONLY_PROPOSERS = {"suffix"}


def run_specdec_row(client: Client, row: dict, prompts: list, max_new_tokens: int, repeats: int,
                    warmup_tokens: int, log, warmed: set | None = None, meter=None, retry=None,
                    warmup_prompt=None) -> dict:
    """Measure one specdec configuration over prompts x repeats. Errors end the row, not the run.
    One warm-up generation per method (proposer, greedy/sampled): `warmed` remembers which ran;
    it uses warmup_prompt if given, else the first prompt."""
    res = {**row, "samples": [], "error": None}
    proposer = None if row["proposer"] in DEFAULT_ONLY_PROPOSERS else row["proposer"]

    def call(prompt, n: int, seed: int):
        kw = dict(messages=prompt.messages, max_new_tokens=n, ignore_eos=True,
                  temperature=float(row["temperature"]), seed=seed, proposer=proposer)
        if row["k"] is not None:  # None: leave K unset = the coordinator's default policy (adaptive)
            kw["num_speculative_tokens"] = int(row["k"])
        if meter is not None:
            meter.reset()
        t = time.perf_counter()
        out = client.generate(**kw)
        return out, time.perf_counter() - t, meter.fraction() if meter is not None else 0.0

    try:
        group = (row["proposer"], row["k"] == 0, row["temperature"] > 0)
        if warmup_tokens and (warmed is None or group not in warmed):
            call(warmup_prompt or prompts[0], min(warmup_tokens, max_new_tokens), seed=0)
            if warmed is not None:
                warmed.add(group)
        for rep in range(repeats):
            for i, p in enumerate(prompts):
                seed = 1000 * i + rep
                retried = 0
                while True:
                    out, wall, bg = call(p, max_new_tokens, seed)
                    if retry is None or not retry.again(bg, retried):
                        break
                    retried += 1
                    log(f"{row['key']}: {p.id}: other processes used {bg:.0%} of the CPU; measuring again")
                st = out.stats
                res["samples"].append({
                    "prompt_id": p.id, "repeat": rep, "seed": seed, "generated_tokens": len(out.token_ids),
                    "prompt_tokens": int(st.get("prompt_tokens", 0)), "seconds": float(st.get("elapsed_s", 0.0)),
                    "tokens_per_s": float(st.get("tokens_per_s", 0.0)), "client_seconds": wall,
                    "finish_reason": out.finish_reason, "stats": st, "background_cpu": bg, "retried": retried, "token_ids": list(out.token_ids)})
                rounds = max(1, int(st.get("rounds", 0) or 0))
                log(f"{row['key']}: {p.id} rep {rep}: {len(out.token_ids)} tokens, {float(st.get('tokens_per_s', 0)):.2f} tok/s, "
                    f"{float(st.get('mean_tokens_per_forward', 0)):.2f} tok/fwd, accept {float(st.get('acceptance_rate', 0)):.2f}, "
                    f"verify {float(st.get('verify_ms', 0)) / rounds:.1f} ms/round"
                    + (f" (other processes used {bg:.0%} of the CPU)" if bg > 0.05 else ""))
    except Exception as e:
        res["error"] = _error_text(e)
        log(f"{row['key']}: ERROR {res['error']}")
    return res
