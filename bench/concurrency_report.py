"""bench.concurrency's write-up: the sweep's plot and its log section (the table by row and level, the default
request against K = 0, who drafted for it, the steady load's table, one client against many)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from bench.common import md_table


def proposer_shares(r: dict) -> str:
    """Who drafted in a burst: each proposer's share of its rounds, with the drafts it had verified and the share
    accepted; the rest of the rounds were target-only."""
    rounds, parts = r.get("rounds", 0), r.get("by_proposer") or {}
    if not rounds:
        return ""
    said = [f"{name} {100 * n / rounds:.0f}% of the rounds ({d} drafts, {a / d if d else 0:.2f} accepted)"
            for name, (n, d, a) in sorted(parts.items(), key=lambda kv: -kv[1][0])]
    alone = rounds - sum(n for n, _, _ in parts.values())
    return ", ".join(said + [f"target-only {100 * alone / rounds:.0f}%"])


def plot(results: dict, levels: list[int], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("specdec", "specdec (hybrid, adaptive K)"), ("k0", "specdec K=0"),
              ("peer:continuous", "HF generate_batch"), ("peer:padded", "HF padded generate")]
    for key, label in series:
        data = results.get(key) or {}
        xs = [c for c in levels if isinstance(data.get(c), dict) and "aggregate_tok_s" in data[c]]
        if xs:
            ax.plot(xs, [data[c]["aggregate_tok_s"] for c in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(results: dict, levels: list[int], command: str, info: str, max_new: int, plot_name: str | None,
             temperature: float = 0.0) -> list[str]:
    L = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: concurrency sweep", "",
         f"Command: `{command}`", "", f"- {info}",
         f"- Each client its own chat prompt, {f'temperature {temperature:g} (seeded per client)' if temperature else 'greedy'}, {max_new} new tokens (EOS ignored), all starting together; "
         "TPOT = (end - first token) / (tokens - 1); the peer's per-client figures are its batch's wall time. "
         "specdec's rows: the median of the repeated bursts by aggregate tok/s (the range in brackets), the rows "
         "alternating at each level; acceptance is the burst's accepted drafts over its drafts (sessions pooled).", ""]
    table = []
    names = {"specdec": "specdec hybrid, adaptive K", "k0": "specdec K=0", "peer:continuous": "HF generate_batch",
             "peer:padded": "HF padded generate"}
    for key, name in names.items():
        data = results.get(key) or {}
        if "error" in data:
            table.append([name, "–", f"error: {data['error']}", "", "", "", "", ""])
            continue
        for c in levels:
            r = data.get(c)
            if not r:
                continue
            ttft = f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}" if "ttft_p50_s" in r else "–"
            tpot = f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f}" if "tpot_p50_ms" in r else "–"
            k = f"{r['mean_k']:.2f}" if "mean_k" in r else "–"
            acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "–"
            agg = f"{r['aggregate_tok_s']:.1f}"
            if "range_tok_s" in r and r.get("repeats", 1) > 1:
                agg += f" ({r['range_tok_s'][0]:.0f}-{r['range_tok_s'][1]:.0f})"
            table.append([name, c, agg, f"{r['per_client_tok_s']:.2f}", ttft, tpot, k, acc])
    L += md_table(["row", "clients", "aggregate tok/s (range)", "per-client tok/s", "TTFT p50 / p99 (s)",
                   "TPOT p50 / p99 (ms)", "mean K", "acceptance"], table)
    L.append("")
    spec = results.get("specdec") or {}
    k0 = results.get("k0") or {}
    ratios = [f"{c}: {spec[c]['aggregate_tok_s'] / k0[c]['aggregate_tok_s']:.2f}x" for c in levels
              if c in spec and c in k0 and "aggregate_tok_s" in spec[c] and "aggregate_tok_s" in k0[c]]
    if ratios:
        L.append(f"- The default request against K = 0 (medians), by clients: {', '.join(ratios)}.")
    shares = [f"{c} client{'s' if c != 1 else ''}: {proposer_shares(spec[c])}" for c in levels if proposer_shares(spec.get(c, {}))]
    if shares:
        L.append(f"- Who drafted for the default request (its median burst): {'; '.join(shares)}.")
    per_request = [f"{c}: {spec[c]['mean_client_tok_s'] / k0[c]['mean_client_tok_s']:.2f}x" for c in levels
                   if c in spec and c in k0 and "mean_client_tok_s" in spec[c] and "mean_client_tok_s" in k0[c]]
    if per_request:
        L.append("- Each request's own speed (its tokens over its latency, the mean over every client of every "
                 f"burst), the default against K = 0, by clients: {', '.join(per_request)}. The aggregate is the "
                 "burst's tokens over its makespan, which its slowest client sets.")
    def load_cell(r: dict) -> str:
        lo, hi = r["range"]
        return f"{r['steady_tok_s']:.1f}" + (f" ({lo:.0f}-{hi:.0f})" if r["windows"] > 1 else "")

    def gap_cell(r: dict) -> str:
        return f"{r['gap_p99_ms']:.0f} / {r['gap_max_ms']:.0f}" if "gap_p99_ms" in r else "-"

    steady_rows = [[c, load_cell(spec[c]["steady"]), load_cell(k0[c]["steady"]),
                    f"{spec[c]['steady']['steady_tok_s'] / k0[c]['steady']['steady_tok_s']:.2f}x",
                    gap_cell(spec[c]["steady"]), gap_cell(k0[c]["steady"])]
                   for c in levels if "steady" in spec.get(c, {}) and "steady" in k0.get(c, {})]
    if steady_rows:
        first = spec[levels[0]]["steady"]
        L += ["", f"Steady load (C closed-loop clients, each sending its next request when the last ends; tokens "
                  f"streamed in a {first['window_s']:.0f} s window after the first requests, over the window; the "
                  f"mean of {first['windows']} windows per row, the rows alternating, range in brackets; a chunk gap is "
                  f"the time between a request's consecutive chunks, every window's pooled):", ""]
        L += md_table(["clients", "specdec tok/s", "K = 0 tok/s", "default / K = 0",
                       "specdec chunk gap p99 / max (ms)", "K = 0 chunk gap p99 / max (ms)"], steady_rows)
        L.append("")
    for c in sorted({lv for lv in levels if lv >= 16} | {levels[-1]}):
        if 1 not in spec or c not in spec or c == 1:
            continue
        one, top = spec[1], spec[c]
        peers = {name: results.get(key, {}).get(c, {}).get("aggregate_tok_s")
                 for key, name in (("peer:continuous", "generate_batch"), ("peer:padded", "padded generate"))}
        vs = ", ".join(f"{top['aggregate_tok_s'] / v:.2f}x {n}" for n, v in peers.items() if v)
        L.append(f"- specdec at {c} clients: aggregate {top['aggregate_tok_s'] / one['aggregate_tok_s']:.1f}x one "
                 f"client's, per-client {100 * top['per_client_tok_s'] / one['per_client_tok_s']:.0f}% of one client's"
                 + (f"; vs the peer: {vs}" if vs else "") + ".")
    if plot_name:
        L += ["", f"![aggregate throughput vs concurrency]({plot_name})"]
    L.append("")
    return L
