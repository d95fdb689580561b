"""Aggregation, the analytical bound and the goal checks of bench.run (its markdown tables: bench.report_tables)."""

from __future__ import annotations

import statistics

# What starts a month's log that bench.run opens (after bench.common.log_header's lines).
HEADER = """Produced by `make bench` (`python -m bench.run`; `--long` for the full matrix, `--help` for the
options). Each run appends one section below; the newest is last. The plots (`docs/bench_*.png`)
show the newest run only.

**What is measured.** Every method generates exactly `N` new tokens (`ignore_eos`; the in-process
baselines use `min_new_tokens = max_new_tokens = N`) for the same fixed prompts
(`bench/prompts.py`, one user chat message each, rendered with the tokenizer's chat template):

- **target alone**: in-process `model.generate(do_sample=False)` with a KV cache: the baseline.
- **peer**: Hugging Face assisted generation in-process with the same draft model
  (`generate(assistant_model=draft)`), greedy and sampled, with the library's default schedule unless
  a K is given; and HF prompt lookup (`generate(prompt_lookup_num_tokens=K)`, greedy).
- **specdec**: coordinator, draft and target services as separate processes on loopback (gRPC),
  through `specdec.client.Client`. `K = 0` is target-only decoding through the services (the
  in-pipeline baseline); `adaptive` leaves K unset (the coordinator's default policy).

Two placements: **shared** (every process may use both cores, default torch threads and OpenMP's
default wait policy, the best for the baselines and for the tiers alike, except the draft tier's one
thread, which `LocalPipeline` sets on shared cores since 2026-11-25 13:40; until 2026-11-25 this
placement ran both with `OMP_WAIT_POLICY=PASSIVE`, which slowed transformers' `generate` alone 1.7x and
so inflated every "x target" of the shared placement before that date) and **separate** (target pinned to core 0 with 1 thread; draft and
coordinator pinned to core 1, draft with 1 thread; the in-process baselines pinned to core 0 with 1
thread).

**Columns.**

| column | meaning |
|---|---|
| tok/s | generated tokens / generation wall time, **median** over prompts x repeats (specdec: the coordinator's `elapsed_s`, request to last token; in-process: the `generate` call). Prompt prefill is included for every method. |
| min-max | spread of tok/s over the same samples |
| x target | median tok/s / median tok/s of *target alone* in the same placement and workload |
| accept | accepted draft tokens / proposed draft tokens (summed over samples) |
| tok/fwd | tokens committed per target forward pass, bonus/correction token included (`mean_tokens_per_forward`; peer: new tokens / target forward calls counted by a hook) |
| mean K | draft tokens actually proposed per round (K is clamped near the token budget) |
| draft, verify, tier, net, coord ms/rd | per round (summed ms / summed rounds): draft-model compute (forwards), target compute (forwards), the tiers' time outside their forwards (waiting for a step, verification and sampling math, engine bookkeeping: the tiers' `queue_ms`), gRPC time on the wire and in the stacks (rpc round trip minus the tiers' time), coordinator time between rpcs |
| n | samples (prompts x repeats) |
| notes | "disturbed": other processes used more than 10% of the CPU during some of the row's samples (such a generation is measured again once after waiting for quiet, within a retry budget; the last measurement is kept); anything the server did differently from what was asked |

**The bound.** For each greedy fixed-K specdec row: `a` solves `tok/fwd = (1 - a^(K+1)) / (1 - a)`;
`T0` = target compute per token in the K = 0 pipeline run (its verify ms / rounds); `c` = draft ms per
drafted token / `T0`; `v` = verify ms per round / `T0`; bound = `(1 - a^(K+1)) / ((1 - a)(K c + v))`,
where the `K` of the cost term is the mean K actually drafted (K is clamped near the token budget, and
prompt lookup proposes nothing when it finds no match); measured = tok/s / tok/s of the K = 0 row, both
*pooled* (total tokens / total time over the row's samples, so that they match the pooled `a`, `c`,
`v`; the tables' tok/s are medians). With `a` solved from the measured tok/fwd the bound equals
`tok/fwd / (K c + v)`: the speed-up if a round cost nothing but its model compute, so measured / bound
below 1 is time spent in gRPC, the coordinator and the client path (relative to the K = 0 run).

**Goals** (recorded, never asserted): (a) specdec greedy at its best K at least as fast as the peer
(greedy, default schedule); (b) measured speed-up >= 90% of the bound (at the best fixed K); (c) gRPC +
coordinator overhead (`network_ms + coordinator_ms` per round) below 1 ms, median over specdec
samples with K > 0 (the tiers' non-forward time, `tier_ms`, is reported beside it); (d) grounded workload: specdec with prompt lookup or hybrid proposer faster than target
alone and at least as fast as the peer's prompt lookup; (e) template workload: suffix or hybrid (adaptive)
at least 2x target alone; (f) grounded workload: suffix at least 1.2x prompt lookup (both adaptive, same run).

**Template workload.** The same JSON-extraction instruction over 20 inputs, in sequence. The suffix and
hybrid rows each run on a fresh coordinator, whose shared suffix tree of recent outputs starts empty and
fills with that row's own earlier answers; the open and grounded rows run with the shared tree off
(other rows and repeats ask the same prompts, and would find their answers there).
"""


# --- aggregation ----------------------------------------------------------------------------------

def _num(x, default=0.0) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return default


def aggregate(row: dict) -> dict:
    s = row.get("samples") or []
    agg = {"n": len(s), "error": row.get("error")}
    if not s:
        return agg
    tps = [x["tokens_per_s"] for x in s]
    agg["tps"] = statistics.median(tps)
    agg["tps_min"], agg["tps_max"] = min(tps), max(tps)
    if len(tps) >= 4:
        q = statistics.quantiles(tps, n=4)
        agg["tps_iqr"] = (q[0], q[2])
    agg["pooled_tps"] = sum(x["generated_tokens"] for x in s) / sum(x["seconds"] for x in s) if sum(x["seconds"] for x in s) > 0 else 0.0
    agg["client_tps"] = statistics.median([x["generated_tokens"] / x["client_seconds"] for x in s if x.get("client_seconds")] or [0.0])
    agg["tokens"] = statistics.median([x["generated_tokens"] for x in s])
    bg = [x.get("background_cpu", 0.0) for x in s]
    agg["bg_max"] = max(bg)
    agg["bg_disturbed"] = sum(b > 0.10 for b in bg)
    agg["prompt_tokens"] = statistics.mean([x["prompt_tokens"] for x in s])
    if row["method"] == "specdec":
        st = [x["stats"] for x in s]
        rounds = sum(_num(t.get("rounds")) for t in st)
        drafted = sum(_num(t.get("draft_tokens")) for t in st)
        agg["rounds"] = rounds
        agg["draft_tokens"] = drafted
        agg["accept"] = sum(_num(t.get("accepted_tokens")) for t in st) / drafted if drafted else None
        forwards = sum(_num(t.get("target_forwards", t.get("rounds"))) for t in st)  # (older logs: a forward a round)
        agg["tok_fwd"] = sum(_num(t.get("mean_tokens_per_forward")) * _num(t.get("target_forwards", t.get("rounds")))
                             for t in st) / forwards if forwards else None
        agg["mean_k"] = drafted / rounds if rounds else None
        for f in ("draft_ms", "verify_ms", "tier_ms", "network_ms", "coordinator_ms"):
            agg[f + "_sum"] = sum(_num(t.get(f)) for t in st)
            agg[f + "_rd"] = agg[f + "_sum"] / rounds if rounds else None
        per_round_overhead = [(_num(t.get("network_ms")) + _num(t.get("coordinator_ms"))) / _num(t.get("rounds"))
                              for t in st if _num(t.get("rounds")) > 0]
        agg["overhead_rd_median"] = statistics.median(per_round_overhead) if per_round_overhead else None
        agg["overhead_rd_samples"] = per_round_overhead
        agg["tier_rd_samples"] = [_num(t.get("tier_ms")) / _num(t.get("rounds")) for t in st if _num(t.get("rounds")) > 0]
        agg["overlapped_rounds"] = sum(_num(t.get("overlapped_rounds")) for t in st)
        agg["overlap_saved_ms"] = sum(_num(t.get("overlap_saved_ms")) for t in st)
        agg["reported_k"] = sorted({int(_num(t.get("num_speculative_tokens"), -99)) for t in st})
        agg["reported_mean_k"] = [_num(t.get("mean_num_speculative_tokens")) for t in st]
        agg["reported_proposer"] = sorted({str(t.get("proposer", "")) for t in st})
        agg["finish"] = sorted({x.get("finish_reason", "") for x in s})
    elif row["method"] in ("peer", "peer_lookup"):
        fwd = sum(x.get("target_forwards", 0) for x in s)
        agg["tok_fwd"] = sum(x["generated_tokens"] for x in s) / fwd if fwd else None
        dfwd = sum(x.get("draft_forwards", 0) for x in s)
        agg["draft_fwd_per_round"] = dfwd / fwd if fwd else None
    else:
        agg["tok_fwd"] = 1.0
    return agg


def row_notes(row: dict, agg: dict) -> list[str]:
    """Things the server did that differ from what was asked, stated plainly."""
    notes = []
    if agg.get("bg_disturbed"):
        notes.append(f"disturbed: other processes used up to {agg['bg_max']:.0%} of the CPU during "
                     f"{agg['bg_disturbed']}/{agg['n']} samples")
    if row["method"] != "specdec" or not agg.get("n"):
        return notes
    want = row["proposer"]
    got = [p for p in agg.get("reported_proposer", []) if p]
    aliases = {"draft": {"draft", "draft_model"}, "lookup": {"lookup", "prompt_lookup"}, "hybrid": {"hybrid"},
               "suffix": {"suffix"}}
    if not got:
        if want != "draft":
            notes.append("server did not report a proposer: the field may have been ignored (draft model used?)")
    elif any(g not in aliases.get(want, {want}) for g in got):
        notes.append(f"asked for {want}, server reports {', '.join(got)}")
    if row["k"] is None:
        ks = agg.get("reported_k", [])
        if ks and ks != [-1]:
            notes.append(f"K unset, server reports fixed K={','.join(map(str, ks))} (adaptive not in effect)")
    if agg.get("overlapped_rounds") and agg.get("rounds"):
        notes.append(f"{agg['overlapped_rounds'] / agg['rounds']:.0%} of rounds drafted while the target verified (the "
                     f"draft's speculation cache), saving ~{agg.get('overlap_saved_ms', 0) / agg['rounds']:.1f} ms per "
                     "round: draft time is partly hidden, so the sequential bound understates what is possible")
    finish = [f for f in agg.get("finish", []) if f != "length"]
    if finish:
        notes.append(f"finish reason {','.join(finish)} (expected length)")
    return notes


# --- the bound ------------------------------------------------------------------------------------

def solve_acceptance(tok_fwd: float, k: int) -> float:
    """a in [0, 1] with 1 + a + ... + a^K = tok_fwd (monotone in a), by bisection."""
    if tok_fwd <= 1.0:
        return 0.0
    if tok_fwd >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < tok_fwd:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def bound_speedup(a: float, k: int, c: float, v: float, k_cost: float | None = None) -> float:
    """(1 - a^(K+1)) / ((1 - a)(K c + v)); k_cost replaces the K of the cost term when given (the mean
    K actually drafted: K is clamped near the token budget, and lookup proposes nothing without a match)."""
    gain = (k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    cost = (k if k_cost is None else k_cost) * c + v
    return gain / cost if cost > 0 else float("nan")


def bound_rows(rows: list[dict], aggs: dict) -> list[dict]:
    """Bound vs measured for greedy fixed-K specdec rows, against the K = 0 row of the same cell."""
    out = []
    k0 = {}
    for r in rows:
        if r["method"] == "specdec" and r["k"] == 0 and aggs[r["key"]].get("n"):
            k0[(r["placement"], r["workload"])] = aggs[r["key"]]
    for r in rows:
        a_ = aggs[r["key"]]
        if r["method"] != "specdec" or r["temperature"] != 0 or not r["k"] or not a_.get("n") or r.get("variant"):
            continue  # (the bound is a chain's: not for trees or the speculation cache)
        base = k0.get((r["placement"], r["workload"]))
        if not base or not base.get("rounds") or not a_.get("rounds"):
            continue
        t0 = base["verify_ms_sum"] / base["rounds"]
        k = int(r["k"])
        mean_k = a_.get("mean_k") or 0.0
        acc = solve_acceptance(a_["tok_fwd"] or 1.0, k)
        c = (a_["draft_ms_sum"] / a_["draft_tokens"] / t0) if a_.get("draft_tokens") else 0.0
        v = a_["verify_ms_rd"] / t0
        b = bound_speedup(acc, k, c, v, k_cost=mean_k)
        measured = a_["pooled_tps"] / base["pooled_tps"] if base.get("pooled_tps") else float("nan")
        out.append({"key": r["key"], "placement": r["placement"], "workload": r["workload"], "proposer": r["proposer"],
                    "k": k, "mean_k": mean_k, "a": acc, "c": c, "v": v, "t0_ms": t0, "bound": b, "measured": measured,
                    "ratio": measured / b if b and b == b else float("nan")})
    return out


# --- summary / goals ------------------------------------------------------------------------------

def find_row(rows, aggs, **kw):
    out = []
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()) and aggs[r["key"]].get("n") and not aggs[r["key"]].get("error"):
            out.append(r)
    return out


def best_row(rows, aggs):
    return max(rows, key=lambda r: aggs[r["key"]]["tps"]) if rows else None


def summarise(rows: list[dict], aggs: dict, bounds: list[dict], placements, workloads) -> dict:
    cells = []
    goals = {"a": [], "b": [], "c": [], "d": [], "e": [], "f": []}
    for pl in placements:
        for wl in workloads:
            tgt = best_row(find_row(rows, aggs, placement=pl, workload=wl, method="target"), aggs)
            peer = find_row(rows, aggs, placement=pl, workload=wl, method="peer", temperature=0.0, k=None)
            peer = peer[0] if peer else None
            k0 = find_row(rows, aggs, placement=pl, workload=wl, method="specdec", k=0)
            k0 = k0[0] if k0 else None
            greedy = [r for r in find_row(rows, aggs, placement=pl, workload=wl, method="specdec", proposer="draft", temperature=0.0) if r["k"] != 0]
            best = best_row(greedy, aggs)
            fixed = [r for r in greedy if r["k"] is not None]
            best_fixed = best_row(fixed, aggs)
            adaptive = [r for r in greedy if r["k"] is None]
            tps = lambda r: aggs[r["key"]]["tps"] if r else None  # noqa: E731
            cell = {"placement": pl, "workload": wl, "target": tps(tgt), "peer": tps(peer), "k0": tps(k0),
                    "best": tps(best), "best_k": k_label(best["k"]) if best else None,
                    "best_fixed": tps(best_fixed), "best_fixed_k": best_fixed["k"] if best_fixed else None,
                    "adaptive": tps(adaptive[0]) if adaptive else None}
            if wl == "grounded":
                lk = [r for r in find_row(rows, aggs, placement=pl, workload=wl, method="specdec", temperature=0.0)
                      if r["proposer"] in ("lookup", "hybrid") and r["k"] != 0]
                best_lk = best_row(lk, aggs)
                peer_lk = best_row(find_row(rows, aggs, placement=pl, workload=wl, method="peer_lookup"), aggs)
                cell.update(lookup=tps(best_lk), lookup_label=f"{best_lk['proposer']} K={k_label(best_lk['k'])}" if best_lk else None,
                            peer_lookup=tps(peer_lk), peer_lookup_k=peer_lk["k"] if peer_lk else None)
                if best_lk and tgt and peer_lk:
                    r1, r2 = cell["lookup"] / cell["target"], cell["lookup"] / cell["peer_lookup"]
                    ok = r1 > 1.0 and r2 >= 1.0
                    goals["d"].append((pl, wl, ok, f"{cell['lookup_label']}: {r1:.2f}x target alone, {r2:.2f}x peer prompt lookup (K={cell['peer_lookup_k']})"))
                else:
                    goals["d"].append((pl, wl, None, "not measured (no successful lookup/hybrid or peer-lookup row)"))
                sfx = find_row(rows, aggs, placement=pl, workload=wl, method="specdec", proposer="suffix", temperature=0.0, k=None)
                lku = find_row(rows, aggs, placement=pl, workload=wl, method="specdec", proposer="lookup", temperature=0.0, k=None)
                if sfx and lku:
                    r = tps(sfx[0]) / tps(lku[0])
                    goals["f"].append((pl, wl, r >= 1.2, f"suffix {tps(sfx[0]):.2f} / lookup {tps(lku[0]):.2f} tok/s = {r:.2f}x"))
                else:
                    goals["f"].append((pl, wl, None, "not measured"))
            if wl == "template":
                adaptive = {p: find_row(rows, aggs, placement=pl, workload=wl, method="specdec", proposer=p, temperature=0.0, k=None)
                            for p in ("suffix", "hybrid")}
                best_t = best_row([r for v in adaptive.values() for r in v], aggs)
                if best_t and tgt:
                    r = tps(best_t) / tps(tgt)
                    goals["e"].append((pl, wl, r >= 2.0, f"{best_t['proposer']} {tps(best_t):.2f} / target alone {tps(tgt):.2f} tok/s = {r:.2f}x"))
                else:
                    goals["e"].append((pl, wl, None, "not measured"))
                cells.append(cell)
                continue  # no draft-model rows here: goals (a) and (b) are about those
            cells.append(cell)
            if best and peer:
                ratio = cell["best"] / cell["peer"]
                text = f"best specdec greedy (K={cell['best_k']}) / peer greedy = {ratio:.2f}"
                if best_fixed and best_fixed is not best:
                    text += f"; at the best fixed K (K={cell['best_fixed_k']}): {cell['best_fixed'] / cell['peer']:.2f}"
                goals["a"].append((pl, wl, ratio >= 1.0, text))
            else:
                goals["a"].append((pl, wl, None, "not measured"))
            if best_fixed:
                b = next((x for x in bounds if x["key"] == best_fixed["key"]), None)
                if b:
                    goals["b"].append((pl, wl, b["ratio"] >= 0.9, f"K={b['k']}: measured {b['measured']:.2f}x vs bound {b['bound']:.2f}x = {b['ratio']:.0%} of the bound"))
                    continue
            goals["b"].append((pl, wl, None, "not measured"))
    for pl in placements:
        samples, tier = [], []
        for r in find_row(rows, aggs, placement=pl, method="specdec"):
            if r["k"] != 0:
                samples.extend(aggs[r["key"]].get("overhead_rd_samples") or [])
                tier.extend(aggs[r["key"]].get("tier_rd_samples") or [])
        if samples:
            med = statistics.median(samples)
            goals["c"].append((pl, "all", med < 1.0, f"median network + coordinator = {med:.2f} ms/round over {len(samples)} "
                               f"specdec samples (the tiers' time outside their forwards, median: {statistics.median(tier):.2f} ms/round)"))
        else:
            goals["c"].append((pl, "all", None, "not measured"))
    return {"cells": cells, "goals": goals}


def k_label(k) -> str:
    return "adaptive" if k is None else str(k)
