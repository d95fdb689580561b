"""bench.run's plots: tokens/s against K, and measured against analytical speed-up (matplotlib; none if it
is missing)."""

from __future__ import annotations

from pathlib import Path

from bench.report import best_row, find_row

def plot_speed_vs_k(rows, aggs, placements, workloads, path: Path, n_tokens: int, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    styles = {"shared": "-", "separate": "--"}
    colors = {("draft", 0.0): "tab:blue", ("draft", 0.7): "tab:orange", ("draft", 1.0): "tab:red",
              ("lookup", 0.0): "tab:green", ("hybrid", 0.0): "tab:purple", ("suffix", 0.0): "tab:brown"}
    markers = {"shared": dict(marker="o"), "separate": dict(marker="D", markerfacecolor="white")}
    star = {"shared": {}, "separate": dict(markerfacecolor="white")}
    fig, axes = plt.subplots(1, len(workloads), figsize=(7.5 * len(workloads), 8.0), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        max_k = 1
        for pl in placements:
            ls = styles.get(pl, ":")
            mk = markers.get(pl, dict(marker="o"))
            for (prop, temp), color in colors.items():
                pts = sorted((r["k"], aggs[r["key"]]["tps"]) for r in find_row(rows, aggs, placement=pl, workload=wl, method="specdec",
                                                                              proposer=prop, temperature=temp) if r["k"])
                if pts:
                    max_k = max(max_k, pts[-1][0])
                    label = f"specdec {prop} T={temp:g} ({pl})"
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, label=label, **mk)
                for r in find_row(rows, aggs, placement=pl, workload=wl, method="specdec", proposer=prop, temperature=temp, k=None):
                    a = aggs[r["key"]]
                    ax.plot([a.get("mean_k") or 0], [a["tps"]], marker="*", markersize=14, color=color, linestyle="none",
                            label=f"adaptive {prop} T={temp:g} ({pl})", **star.get(pl, {}))
            for r in find_row(rows, aggs, placement=pl, workload=wl, method="specdec", k=0):
                ax.plot([0], [aggs[r["key"]]["tps"]], marker="s", markersize=8, color="black", linestyle="none",
                        markerfacecolor="black" if pl == "shared" else "white", label=f"specdec K=0 ({pl})")
            hl = [("target", None, 0.0, "black", "target alone"), ("peer", None, 0.0, "gray", "HF assisted greedy"),
                  ("peer", None, 0.7, "silver", "HF assisted T=0.7")]
            for method, k, temp, color, label in hl:
                for r in find_row(rows, aggs, placement=pl, workload=wl, method=method, k=k, temperature=temp):
                    ax.axhline(aggs[r["key"]]["tps"], color=color, linestyle=ls, linewidth=1.2, label=f"{label} ({pl})")
            best_lk = best_row(find_row(rows, aggs, placement=pl, workload=wl, method="peer_lookup"), aggs)
            if best_lk:
                ax.axhline(aggs[best_lk["key"]]["tps"], color="olive", linestyle=ls, linewidth=1.2,
                           label=f"HF prompt lookup K={best_lk['k']} ({pl})")
        ax.set_title(f"{wl} workload")
        ax.set_xlabel("K (draft tokens per round)\n* = adaptive, at its mean K; square = K=0 through the services")
        ax.set_ylabel(f"tokens/s (median, {n_tokens} new tokens)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_xticks(range(0, max_k + 1))
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bound(bounds, placements, workloads, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not bounds:
        return False
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, len(workloads), figsize=(7 * len(workloads), 4.5), squeeze=False)
    styles = {"shared": "-", "separate": "--"}
    for ax, wl in zip(axes[0], workloads):
        for pl in placements:
            for prop, color in (("draft", "tab:blue"), ("lookup", "tab:green"), ("hybrid", "tab:purple"), ("suffix", "tab:brown")):
                pts = sorted((b["k"], b["measured"], b["bound"]) for b in bounds
                             if b["placement"] == pl and b["workload"] == wl and b["proposer"] == prop)
                if not pts:
                    continue
                ks = [p[0] for p in pts]
                ax.plot(ks, [p[1] for p in pts], styles.get(pl, ":"), marker="o", color=color, label=f"measured {prop} ({pl})")
                ax.plot(ks, [p[2] for p in pts], styles.get(pl, ":"), marker="x", color=color, alpha=0.45, label=f"bound {prop} ({pl})")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{wl}: greedy speed-up over K=0 through the services")
        ax.set_xlabel("K")
        ax.set_ylabel("speed-up (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
