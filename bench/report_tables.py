"""bench.run's markdown tables: its results per row, trees, the template workload, the bound and the goals
(the figures they print come from bench.report)."""

from __future__ import annotations

import math
import statistics

from bench.report import best_row, find_row, k_label, row_notes


# --- formatting -----------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def method_label(r: dict) -> str:
    m = r["method"]
    if m == "target":
        return "target alone (HF generate" + (", static cache + torch.compile)" if r.get("variant") == "compiled" else ")")
    if m == "peer":
        return "peer: HF assisted" + (" (default schedule)" if r["k"] is None else f" (K={r['k']} fixed)")
    if m == "peer_lookup":
        return "peer: HF prompt lookup"
    return f"specdec {r['proposer']}" + (f" ({r['variant']})" if r.get("variant") else "")


def k_cell(r: dict) -> str:
    if r["method"] == "target":
        return "–"
    if r["method"] == "peer":
        return "default" if r["k"] is None else str(r["k"])
    if r["method"] == "specdec" and r["k"] == 0:
        return "0 (target only)"
    return k_label(r["k"])


def tree_table(rows: list[dict], aggs: dict, placements, workloads) -> list[str]:
    """The draft model's chains beside its token trees and its speculation cache (overlap), per cell: tokens per
    target forward, speed-up over the target alone, and the share of rounds the cache had ready."""
    lines = ["| placement / workload | proposer | variant | T | K | tok/s | x target | tok/fwd | rounds ready | saved ms/rd |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pl in placements:
        for wl in workloads:
            tgt = best_row(find_row(rows, aggs, placement=pl, workload=wl, method="target"), aggs)
            variants = {(r["proposer"], r["temperature"]) for r in rows
                        if r["placement"] == pl and r["workload"] == wl and r.get("variant")}
            for r in rows:
                if (r["placement"], r["workload"], r["method"]) != (pl, wl, "specdec"):
                    continue
                if (r["proposer"], r["temperature"]) not in variants or (r["k"] == 0 and not r.get("variant")):
                    continue
                a = aggs[r["key"]]
                if not a.get("n"):
                    continue
                rounds = a.get("rounds") or 0
                x = a["tps"] / aggs[tgt["key"]]["tps"] if tgt and a.get("tps") else float("nan")
                lines.append(f"| {pl} / {wl} | {r['proposer']} | {r.get('variant') or 'chain'} | {r['temperature']:g} | "
                             f"{k_label(r['k'])} | {_f(a.get('tps'))} | {_f(x)} | {_f(a.get('tok_fwd'))} | "
                             f"{_f(a.get('overlapped_rounds', 0) / rounds if rounds else None, '{:.0%}')} | "
                             f"{_f(a.get('overlap_saved_ms', 0) / rounds if rounds else None, '{:.1f}')} |")
    return lines


def results_table(rows: list[dict], aggs: dict, target_tps: float | None) -> list[str]:
    lines = ["| method | T | K | tok/s | min-max | x target | accept | tok/fwd | mean K | draft ms/rd | verify ms/rd | tier ms/rd | net ms/rd | coord ms/rd | n | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = aggs[r["key"]]
        t = _f(r.get("temperature") or 0.0, "{:g}")
        if not a.get("n"):
            err = (a.get("error") or "no samples").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {method_label(r)} | {t} | {k_cell(r)} | n/a (error: {err}) | | | | | | | | | | | 0 | |")
            continue
        notes = row_notes(r, a)
        if a.get("error"):
            notes.append(f"stopped early: {a['error'][:120]}")
        if r["method"] == "peer" and a.get("draft_fwd_per_round") is not None:
            notes.append(f"{a['draft_fwd_per_round']:.1f} draft forwards per target forward")
        lines.append("| " + " | ".join([
            method_label(r), t, k_cell(r), _f(a["tps"]), f"{a['tps_min']:.2f}-{a['tps_max']:.2f}",
            _f(a["tps"] / target_tps if target_tps else None, "{:.2f}x"),
            _f(a.get("accept")), _f(a.get("tok_fwd")), _f(a.get("mean_k")),
            _f(a.get("draft_ms_rd"), "{:.1f}"), _f(a.get("verify_ms_rd"), "{:.1f}"),
            _f(a.get("tier_ms_rd"), "{:.2f}"), _f(a.get("network_ms_rd"), "{:.2f}"), _f(a.get("coordinator_ms_rd"), "{:.2f}"),
            str(a["n"]), "; ".join(notes).replace("|", "/")]) + " |")
    return lines


def template_table(rows: list[dict], aggs: dict, placements) -> list[str]:
    """The template workload per placement: median tok/s of each row, x target alone, and how the
    shared tree warms up (median tok/s of the first and the last five requests, in order)."""
    lines = ["| placement | target alone | specdec K=0 | lookup | suffix | hybrid | suffix: first 5 -> last 5 requests | hybrid: first 5 -> last 5 |",
             "|---|---|---|---|---|---|---|---|"]
    for pl in placements:
        found = {}
        for name, kw in (("target", dict(method="target")), ("k0", dict(method="specdec", k=0)),
                         ("lookup", dict(method="specdec", proposer="lookup", k=None)),
                         ("suffix", dict(method="specdec", proposer="suffix", k=None)),
                         ("hybrid", dict(method="specdec", proposer="hybrid", k=None))):
            r = find_row(rows, aggs, placement=pl, workload="template", temperature=0.0, **kw)
            found[name] = best_row(r, aggs) if name == "target" else r[0] if r else None  # target: its best settings
        if not any(found.values()):
            continue
        tgt = aggs[found["target"]["key"]]["tps"] if found["target"] else None

        def cell(name):
            r = found[name]
            if r is None:
                return "–"
            t = aggs[r["key"]]["tps"]
            return f"{t:.2f}" + (f" ({t / tgt:.2f}x)" if tgt and name != "target" else "")

        def warming(name):
            r = found[name]
            s = [x["tokens_per_s"] for x in (r or {}).get("samples", [])]
            if len(s) < 10:
                return "–"
            return f"{statistics.median(s[:5]):.2f} -> {statistics.median(s[-5:]):.2f}"

        lines.append(f"| {pl} | {cell('target')} | {cell('k0')} | {cell('lookup')} | {cell('suffix')} | {cell('hybrid')} | "
                     f"{warming('suffix')} | {warming('hybrid')} |")
    return lines


def bound_table(bounds: list[dict]) -> list[str]:
    lines = ["| proposer | K | mean K | a (solved) | c | v | T0 ms | bound | measured | measured / bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b in bounds:
        lines.append(f"| {b['proposer']} | {b['k']} | {b['mean_k']:.2f} | {b['a']:.3f} | {b['c']:.3f} | {b['v']:.2f} | {b['t0_ms']:.1f} | "
                     f"{b['bound']:.2f}x | {b['measured']:.2f}x | {_f(b['ratio'], '{:.0%}')} |")
    return lines


def goal_lines(goals: dict) -> list[str]:
    names = {"a": "(a) specdec greedy at best K >= peer (ratio >= 1.0)",
             "b": "(b) measured speed-up >= 90% of the analytical bound",
             "c": "(c) gRPC + coordinator overhead < 1 ms per round (median)",
             "d": "(d) grounded: specdec lookup/hybrid > target alone and >= peer prompt lookup",
             "e": "(e) template: specdec suffix/hybrid (adaptive) >= 2x target alone",
             "f": "(f) grounded: specdec suffix >= 1.2x prompt lookup (both adaptive)"}
    out = []
    for g, title in names.items():
        out.append(f"- **{title}**")
        for pl, wl, ok, text in goals[g]:
            verdict = "not measured" if ok is None else ("met" if ok else "missed")
            where = pl if wl == "all" else f"{pl} / {wl}"
            out.append(f"  - {where}: **{verdict}**" + (f" ({text})" if ok is not None else ""))
    return out


# --- plots ----------------------------------------------------------------------------------------
