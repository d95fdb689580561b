"""bench.run's markdown section: the run's command, machine, models and placements, the summary and goals,
one results table per placement and workload, memory, the exactness checks, and the plots."""

from __future__ import annotations

import os
from pathlib import Path

from bench import report, report_tables
from bench.common import DISTURBED
from bench.plots import plot_bound, plot_speed_vs_k
from bench.run_plan import describe_plan
from bench.run_rows import PLACEMENTS


def build_section(*, plan: dict, models: dict, prompts: dict, info: dict, started, command: str, elapsed: float,
                  waited: float, other: float, all_rows: list[dict], aggs: dict, bounds: list[dict], summary: dict,
                  per_placement: dict, baseline_meta: dict, out_path: Path, plot_dir: Path) -> str:
    """The run's section (markdown), drawing its plots into plot_dir."""
    meta = next((m for m in baseline_meta.values() if m.get("models")), {})
    eos = set(meta.get("eos_token_ids") or [])
    prefix = "bench_gpu_" if plan["device"] != "cpu" else "bench_"  # GPU runs keep the CPU plots
    speed_png, bound_png = plot_dir / f"{prefix}speed_vs_k.png", plot_dir / f"{prefix}bound.png"
    title = (f"{started:%Y-%m-%d %H:%M} UTC, {plan['mode']}, "
             + (f"{info['gpu']}, {plan['dtype']}" if info.get("gpu") else f"{info['cpu']} x{info['cores']}")
             + f", N={plan['max_new_tokens']}")
    made_speed = plot_speed_vs_k(all_rows, aggs, plan["placements"], plan["workloads"], speed_png,
                                        plan["max_new_tokens"], f"specdec tokens/s vs K: {title}")
    made_bound = plot_bound(bounds, plan["placements"], plan["workloads"], bound_png,
                                   f"measured vs analytical speed-up: {title}")

    L = [f"## {started:%Y-%m-%d %H:%M} UTC: {plan['mode']} run (git {info['git']})", ""]
    L.append(f"Command: `{command}` (wall time {elapsed / 60:.1f} min"
             + (f", of which {waited / 60:.1f} min waiting for other processes to go quiet" if waited > 5 else "") + ")")
    L.append("")
    gpu_used = f"GPU **{info['gpu']}** (`--device {plan['device']}`)" if info.get("gpu") else "no GPU used"
    L.append(f"- Machine: {info['cpu']}, {info['cores']} cores ({info['cpus_allowed']} allowed), {info['memory']} RAM, {gpu_used}; "
             f"Python {info['python']}, torch {info.get('torch')}, transformers {info.get('transformers')}, grpcio {info.get('grpc')}")
    tm, dm = meta.get("models", {}).get("target", {}), meta.get("models", {}).get("draft", {})
    L.append(f"- Models: target `{models['target']}` ({tm.get('arch', '?')}, {tm.get('params', 0) / 1e6:.1f}M params, {tm.get('layers', '?')} layers, {plan['dtype']}); "
             f"draft `{models['draft']}` ({dm.get('arch', '?')}, {dm.get('params', 0) / 1e6:.1f}M params, {dm.get('layers', '?')} layers, {plan['draft_dtype']})"
             + (" (the target's own weights in a lower precision: the self-draft)" if models["draft"] == models["target"] else ""))
    for line in describe_plan(plan):
        L.append(f"- {line[0].upper() + line[1:]}")
    sched = meta.get("peer_default_schedule") or {}
    if sched:
        L.append(f"- Peer default schedule (transformers {meta.get('transformers_version')}): num_assistant_tokens={sched.get('num_assistant_tokens')}, "
                 f"schedule `{sched.get('num_assistant_tokens_schedule')}`, assistant_confidence_threshold={sched.get('assistant_confidence_threshold')} "
                 f"(the draft stops a round early when its top probability falls below it; "
                 + ("adapted per round since scikit-learn is installed)" if sched.get("threshold_adapts") else "fixed: it only adapts when scikit-learn is installed, which it is not)"))
    for pl in plan["placements"]:
        spec, bm = per_placement[pl], baseline_meta.get(pl, {})
        c = PLACEMENTS[pl]
        omp = spec.get("omp_wait_policy") or {}
        omp_txt = ", ".join(f"{k} {v or '(unset)'}" for k, v in omp.items()) or "?"
        desc = (f"- Placement **{pl}**: bench sets tier env {c['env'] or '{}'} (OMP_WAIT_POLICY as the tier processes got it: {omp_txt}), "
                f"target args {c['target_args'] or '[]'}, draft args {c['draft_args'] or '[]'}; "
                f"CPUs allowed per process: {spec.get('cpus') or '?'}; services started in {_fmt_s(spec.get('start_s'))}; "
                f"baselines ran with {bm.get('torch_threads', '?')} torch thread(s) on CPUs {bm.get('cpus', '?')}"
                f"{' and OMP_WAIT_POLICY=' + bm['omp_wait_policy'] if bm.get('omp_wait_policy') else ''}")
        retries = (spec.get("retries") or 0) + (bm.get("retries") or 0)
        if retries:
            desc += f"; {retries} disturbed generation(s) measured again ({(spec.get('retry_spent_s') or 0) + (bm.get('retry_spent_s') or 0):.0f}s spent)"
        if spec.get("error"):
            desc += f"; **pipeline error**: {spec['error']}"
        if bm.get("error"):
            desc += f"; **baseline error**: {bm['error']}"
        L.append(desc)
    samples = [x for r in all_rows for x in r.get("samples", [])]
    disturbed = [x for x in samples if x.get("background_cpu", 0) > DISTURBED]
    L.append(f"- Other processes used {other:.0%} of the machine's CPU during this run; "
             f"{len(disturbed)} of {len(samples)} timed generations ran while other processes used more than {DISTURBED:.0%} of it"
             + (" (**timings disturbed**: such rows are marked in the notes; rerun on an idle machine)" if disturbed or other > 0.05 else ""))
    L.append("")

    L.append("### Summary")
    L.append("")
    L.append("| placement | workload | target alone tok/s | peer greedy tok/s | specdec K=0 tok/s | best specdec greedy tok/s (K) | vs target | vs peer | best fixed K tok/s (K) | grounded: best lookup/hybrid tok/s (vs target, vs peer lookup) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for cell in summary["cells"]:
        vs_t = _ratio(cell["best"], cell["target"])
        vs_p = _ratio(cell["best"], cell["peer"])
        lk = "–"
        if cell.get("lookup"):
            lk = f"{cell['lookup']:.2f} ({cell['lookup_label']}; {_ratio(cell['lookup'], cell['target'])}, {_ratio(cell['lookup'], cell.get('peer_lookup'))})"
        L.append(f"| {cell['placement']} | {cell['workload']} | {_fmt(cell['target'])} | {_fmt(cell['peer'])} | {_fmt(cell['k0'])} | "
                 f"{_fmt(cell['best'])} ({cell['best_k'] or '–'}) | {vs_t} | {vs_p} | {_fmt(cell['best_fixed'])} ({cell['best_fixed_k'] or '–'}) | {lk} |")
    L.append("")
    if "template" in plan["workloads"]:
        L.append("Template workload (tok/s, median over the requests; x target alone):")
        L.append("")
        L.extend(report_tables.template_table(all_rows, aggs, plan["placements"]))
        L.append("")
    trees = report_tables.tree_table(all_rows, aggs, plan["placements"], plan["workloads"])
    if len(trees) > 2:
        L.append("The draft model's chains, token trees and speculation cache (overlap) (x target alone; rounds ready: "
                 "drafts the speculation cache had pre-drafted; saved: the draft call's usual time less theirs):")
        L.append("")
        L.extend(trees)
        L.append("")
    L.append("Goals:")
    L.append("")
    L.extend(report_tables.goal_lines(summary["goals"]))
    L.append("")
    L.extend(reading(all_rows, aggs, bounds))
    L.append("")

    for pl in plan["placements"]:
        for wl in plan["workloads"]:
            rows = [r for r in all_rows if r["placement"] == pl and r["workload"] == wl]
            if not rows:
                continue
            tgt = max((aggs[r["key"]].get("tps") or 0.0 for r in rows if r["method"] == "target"), default=None)  # its best settings
            ptoks = [aggs[r["key"]].get("prompt_tokens") for r in rows if aggs[r["key"]].get("prompt_tokens")]
            L.append(f"### {pl} / {wl}")
            L.append("")
            L.append(f"Prompts: {', '.join(p.id for p in prompts[wl])} (mean {sum(ptoks) / len(ptoks) if ptoks else 0:.0f} prompt tokens).")
            L.append("")
            L.extend(report_tables.results_table(rows, aggs, tgt))
            L.append("")
            b = [x for x in bounds if x["placement"] == pl and x["workload"] == wl]
            if b:
                L.append(f"Bound vs measured ({pl} / {wl}, greedy, speed-up over specdec K=0):")
                L.append("")
                L.extend(report_tables.bound_table(b))
                L.append("")

    L.append("### Memory")
    L.append("")
    L.append("| placement | process | peak RSS (VmHWM) MiB | resident after the rows (VmRSS) MiB | threads |")
    L.append("|---|---|---|---|---|")
    for pl in plan["placements"]:
        for name, mem in (per_placement[pl].get("memory") or {}).items():
            now = f"{mem['rss_kib'] / 1024:.0f}" if mem.get("rss_kib") else "–"
            L.append(f"| {pl} | {name} | {mem['peak_rss_kib'] / 1024:.0f} | {now} | {mem.get('threads', '?')} |")
        bm = baseline_meta.get(pl, {})
        if bm.get("peak_rss_kib"):
            L.append(f"| {pl} | in-process baselines (target + draft + HF generate) | {bm['peak_rss_kib'] / 1024:.0f} | – | – |")
    L.append("")
    if meta.get("models"):
        mean_prompt = {}
        for wl in plan["workloads"]:
            vals = [aggs[r["key"]].get("prompt_tokens") for r in all_rows if r["workload"] == wl and r["method"] == "target" and aggs[r["key"]].get("prompt_tokens")]
            if vals:
                mean_prompt[wl] = vals[0]
        hdr = " | ".join(f"KV per session, {wl} (~{mean_prompt[wl]:.0f} + {plan['max_new_tokens']} tokens)" for wl in mean_prompt)
        L.append(f"| model | layers | KV heads | head dim | bytes/elt | KV bytes/token | {hdr} |")
        L.append("|---|---|---|---|---|---|" + "---|" * len(mean_prompt))
        for name in ("target", "draft"):
            m = meta["models"][name]
            per = " | ".join(f"{m['bytes_per_token'] * (mean_prompt[wl] + plan['max_new_tokens']) / 2**20:.2f} MiB" for wl in mean_prompt)
            L.append(f"| {name} | {m['layers']} | {m['kv_heads']} | {m['head_dim']} | {m['dtype_bytes']} | {m['bytes_per_token']:,} | {per} |")
        L.append("")
        L.append("KV bytes/token = 2 (K and V) x layers x KV heads x head dim x bytes per element; a session holds it "
                 "for prompt + generated tokens on each tier (the target also briefly for K rejected drafts).")
        L.append("")

    L.append("### Checks and notes")
    L.append("")
    L.extend(exactness_checks(all_rows, eos))
    for r in all_rows:
        notes = [n for n in report.row_notes(r, aggs[r["key"]]) if not n.startswith("disturbed")]  # those are in the tables
        if r.get("error"):
            notes.append(f"error: {r['error'][:300]}")
        if notes:
            L.append(f"- `{r['key']}`: " + "; ".join(notes))
    L.append("- tok/s for specdec uses the coordinator's elapsed time (request validated to last token); "
             "measured at the client (adds the client-to-coordinator hop and prompt tokenization) the median is: "
             + ", ".join(f"{r['key'].split('/', 2)[2]} ({r['placement']}/{r['workload']}) {aggs[r['key']]['client_tps']:.2f}"
                         for r in all_rows if r["method"] == "specdec" and r["k"] == 0 and aggs[r["key"]].get("n")))
    if made_speed:
        L.append("")
        L.append(f"![tokens/s vs K]({os.path.relpath(speed_png, out_path.parent)})")
    if made_bound:
        L.append("")
        L.append(f"![measured vs bound]({os.path.relpath(bound_png, out_path.parent)})")
    L.append("")
    section = "\n".join(L) + "\n"
    return section


def exactness_checks(rows: list[dict], eos_ids: set[int]) -> list[str]:
    """Greedy outputs must agree: specdec at any K with K=0 (token for token, both ignore EOS), and
    K=0 with target alone up to the first EOS (HF's min_new_tokens masks EOS, the services do not)."""
    by_key = {}
    for r in rows:
        for s in r.get("samples", []):
            by_key[(r["key"], s["prompt_id"], s["repeat"])] = s["token_ids"]
    lines = []
    cells = sorted({(r["placement"], r["workload"]) for r in rows})
    for pl, wl in cells:
        cell = [r for r in rows if r["placement"] == pl and r["workload"] == wl and r.get("samples")]
        k0 = next((r for r in cell if r["method"] == "specdec" and r["k"] == 0), None)
        tgt = next((r for r in cell if r["method"] == "target" and not r.get("variant")), None)  # eager: the reference
        parts = []
        if k0:
            eq, tot, bad = 0, 0, []
            for r in cell:
                if r["method"] != "specdec" or r["temperature"] != 0 or r["k"] == 0:
                    continue
                for s in r["samples"]:
                    ref = by_key.get((k0["key"], s["prompt_id"], s["repeat"]))
                    if ref is None:
                        continue
                    tot += 1
                    if s["token_ids"] == ref:
                        eq += 1
                    else:
                        n = next((i for i, (x, y) in enumerate(zip(s["token_ids"], ref)) if x != y), min(len(ref), len(s["token_ids"])))
                        bad.append(f"{r['proposer']} K={_k(r['k'])} {s['prompt_id']} (first difference at token {n})")
            if tot:
                parts.append(f"greedy specdec K>0 = K=0 output token for token: {eq}/{tot}" + (f" (differ: {'; '.join(bad[:6])})" if bad else ""))
        if k0 and tgt:
            eq, tot = 0, 0
            for s in k0["samples"]:
                ref = by_key.get((tgt["key"], s["prompt_id"], s["repeat"]))
                if ref is None:
                    continue
                cut = next((i for i, t in enumerate(s["token_ids"]) if t in eos_ids), len(s["token_ids"]))
                tot += 1
                eq += s["token_ids"][:cut] == ref[:cut]
            if tot:
                parts.append(f"K=0 via services = target alone up to the first EOS: {eq}/{tot}")
        if tgt:
            eq, tot = 0, 0
            for r in cell:
                if r["method"] in ("peer", "peer_lookup") and r["temperature"] == 0:
                    for s in r["samples"]:
                        ref = by_key.get((tgt["key"], s["prompt_id"], s["repeat"]))
                        if ref is not None:
                            tot += 1
                            eq += s["token_ids"] == ref
            if tot:
                parts.append(f"HF greedy assisted / prompt lookup = target alone: {eq}/{tot}")
        if parts:
            lines.append(f"- {pl} / {wl}: " + "; ".join(parts))
    return lines


def reading(rows: list[dict], aggs: dict, bounds: list[dict]) -> list[str]:
    """A few data-driven sentences on what the numbers say about the draft model on this machine."""
    out = []
    draft_b = [b for b in bounds if b["proposer"] == "draft"]
    if draft_b:
        best = max(draft_b, key=lambda b: b["bound"])
        a_rng = (min(b["a"] for b in draft_b), max(b["a"] for b in draft_b))
        v_rng = (min(b["v"] for b in draft_b), max(b["v"] for b in draft_b))
        c_rng = (min(b["c"] for b in draft_b), max(b["c"] for b in draft_b))
        verdict = ("so the draft model cannot speed up decoding here even with zero overhead"
                   if best["bound"] < 1.0 else "so a speed-up is possible in principle")
        out.append(f"Reading: with the draft model, greedy per-token acceptance is a = {a_rng[0]:.2f}-{a_rng[1]:.2f}, a draft token "
                   f"costs c = {c_rng[0]:.2f}-{c_rng[1]:.2f} of a target step and one verify v = {v_rng[0]:.2f}-{v_rng[1]:.2f} target steps; "
                   f"the best analytical bound over the fixed K measured is {best['bound']:.2f}x ({best['placement']}/{best['workload']}, "
                   f"K={best['k']}), {verdict}.")
    adaptive = [(r, aggs[r["key"]]) for r in rows if r["method"] == "specdec" and r["proposer"] == "draft"
                and r["k"] is None and r["temperature"] == 0 and aggs[r["key"]].get("n")]
    if adaptive:
        mk = [a.get("mean_k") or 0.0 for _, a in adaptive]
        out.append(f"Adaptive K (draft proposer, greedy) drafted {min(mk):.2f}-{max(mk):.2f} tokens per round on average, "
                   "i.e. it mostly falls back to target-only rounds where drafting does not pay.")
    lk = [b for b in bounds if b["proposer"] in ("lookup", "hybrid")]
    if lk:
        best = max(lk, key=lambda b: b["measured"])
        out.append(f"Prompt lookup needs no model: on the grounded prompts its best fixed-K row reaches {best['measured']:.2f}x "
                   f"the K=0 pipeline ({best['proposer']} K={best['k']}, {best['placement']}).")
    return [" ".join(out)] if out else []


def _k(k) -> str:
    return "adaptive" if k is None else str(k)


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _fmt_s(x) -> str:
    return "?" if x is None else f"{x:.1f}s"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


