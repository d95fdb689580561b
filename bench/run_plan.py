"""bench.run's plan: the modes (quick, long, smoke) and the rows a run measures, per placement and
workload, from its flags."""

from __future__ import annotations

import shlex

from bench.run_rows import PLACEMENTS

MODES = {
    # quick: sized to finish in about 15 minutes on an idle 2-core CPU (8 without the template workload).
    "quick": dict(max_new_tokens=32, prompts=3, template_prompts=20, template_placements=("shared", "gpu"), repeats=1,
                  warmup_tokens=8, greedy_ks=[1, 2, 4], sampled_temps=[0.7, 1.0], sampled_ks=[2],
                  lookup_ks=[2, 4], peer_sampled_temps=[0.7], peer_fixed_ks=[], peer_lookup_ks=[2, 4],
                  sampled_cells=[("shared", "open"), ("gpu", "open")]),
    "long": dict(max_new_tokens=128, prompts=0, template_prompts=20, template_placements=None, repeats=2, warmup_tokens=16,
                 greedy_ks=list(range(1, 9)), sampled_temps=[0.7, 1.0], sampled_ks=list(range(1, 9)),
                 lookup_ks=[2, 4, 8], peer_sampled_temps=[0.7, 1.0], peer_fixed_ks=[1, 2, 4], peer_lookup_ks=[2, 4, 8],
                 sampled_cells=None),
    "smoke": dict(max_new_tokens=16, prompts=1, template_prompts=4, template_placements=None, repeats=1, warmup_tokens=4,
                  greedy_ks=[1, 2], sampled_temps=[0.7], sampled_ks=[2],
                  lookup_ks=[2], peer_sampled_temps=[0.7], peer_fixed_ks=[], peer_lookup_ks=[2],
                  sampled_cells=None),
}
SPEC_MAX_NEW_TOKENS = 128
TEMPLATE_PROPOSERS = ("lookup", "suffix", "hybrid")  # adaptive K each, beside target alone and K = 0


def build_plan(args) -> dict:
    mode = "long" if args.long else "smoke" if args.smoke else "quick"
    m = dict(MODES[mode])
    for key, value in (("max_new_tokens", args.max_new_tokens), ("repeats", args.repeats), ("prompts", args.prompts),
                       ("template_prompts", args.template_prompts),
                       ("greedy_ks", args.ks), ("sampled_ks", args.sampled_ks), ("lookup_ks", args.lookup_ks),
                       ("warmup_tokens", args.warmup_tokens), ("sampled_temps", args.temperatures)):
        if value is not None:
            m[key] = value
    if args.temperatures is not None:
        m["peer_sampled_temps"] = args.temperatures[:1] if mode != "long" else args.temperatures
    if args.no_sampled:
        m["sampled_temps"], m["peer_sampled_temps"] = [], []
    on_gpu = args.device != "cpu"
    placements = [x for x in (args.placements or ("gpu" if on_gpu else "shared,separate")).split(",") if x]
    workloads = [x for x in args.workloads.split(",") if x]
    for pl in placements:
        if pl not in PLACEMENTS:
            raise SystemExit(f"unknown placement {pl!r}")
        if (pl == "gpu") != on_gpu:
            raise SystemExit(f"placement {pl!r} does not fit --device {args.device} (gpu goes with a GPU device, "
                             "shared and separate with cpu)")
    proposers = [x for x in args.proposers.split(",") if x]
    m.update(draft_trees=getattr(args, "draft_trees", 0), speculate=getattr(args, "speculate", 0),
             tree_ks=list(getattr(args, "tree_ks", None) or [2]))
    m.update(mode=mode, placements=placements, workloads=workloads, proposers=proposers, peer=not args.no_peer,
             target_compiled=not getattr(args, "no_target_compiled", False),
             device=args.device, dtype=args.dtype, draft_dtype=args.draft_dtype or args.dtype,
             retry=dict(max_retries=args.retry_disturbed, wait_s=15.0, budget_s=args.retry_budget),
             extra_args={"target": shlex.split(args.target_args), "draft": shlex.split(args.draft_args),
                         "coordinator": shlex.split(args.coordinator_args)
                         + ([f"--tree-nodes={args.tree_nodes}"] if getattr(args, "tree_nodes", 0) else [])})
    if args.sampled_everywhere:
        m["sampled_cells"] = None
    rows = []
    for pl in placements:
        for wl in workloads:
            sampled_here = m["sampled_cells"] is None or (pl, wl) in m["sampled_cells"]

            def add(method, **kw):
                r = dict(placement=pl, workload=wl, method=method, proposer=kw.get("proposer"), k=kw.get("k"),
                         temperature=float(kw.get("temperature", 0.0)), variant=kw.get("variant", ""))
                t = f"T{r['temperature']:g}"
                k = "Kdefault" if r["k"] is None else f"K{r['k']}"
                r["key"] = "/".join(x for x in (pl, wl, method, r["proposer"] or "", t, k, r["variant"]) if x)
                rows.append(r)
            if wl == "template":  # 20 requests per row: target alone, K = 0 and the model-free proposers
                if m["template_placements"] is not None and pl not in m["template_placements"]:
                    continue  # quick mode: the shared placement only
                add("target")
                if m["target_compiled"]:
                    add("target", variant="compiled")
                add("specdec", proposer="draft", k=0)
                for prop in TEMPLATE_PROPOSERS:
                    add("specdec", proposer=prop, k=None)
                for variant in tree_variants(m):
                    add("specdec", proposer="hybrid", k=None, variant=variant)
                continue
            add("target")
            if m["target_compiled"]:  # the target alone at its best settings: static cache + torch.compile
                add("target", variant="compiled")
            if m["peer"]:
                add("peer")
                for temp in (m["peer_sampled_temps"] if sampled_here else []):
                    add("peer", temperature=temp)
                for k in m["peer_fixed_ks"]:
                    add("peer", k=k)
                if wl == "grounded":
                    for k in m["peer_lookup_ks"]:
                        add("peer_lookup", k=k)
            add("specdec", proposer="draft", k=0)
            for k in [*m["greedy_ks"], None]:
                add("specdec", proposer="draft", k=k)
            for variant in tree_variants(m):  # the draft's trees and speculation cache beside its chains
                for k in ([*m["tree_ks"], None] if variant == "tree" else [2]):
                    add("specdec", proposer="draft", k=k, variant=variant)
            for temp in (m["sampled_temps"] if sampled_here else []):
                for k in [*m["sampled_ks"], None]:
                    add("specdec", proposer="draft", k=k, temperature=temp)
                if "tree" in tree_variants(m):
                    add("specdec", proposer="draft", k=2, temperature=temp, variant="tree")
            if wl == "open":  # the default request: hybrid proposer, adaptive K; and with the draft's trees on
                add("specdec", proposer="hybrid", k=None)
                if "tree" in tree_variants(m):
                    add("specdec", proposer="hybrid", k=None, variant="tree")
            if wl == "grounded":
                for prop in proposers:
                    for k in [*m["lookup_ks"], None]:
                        add("specdec", proposer=prop, k=k)
    m["rows"] = rows
    return m


def tree_variants(m: dict) -> list[str]:
    """The draft-model variants measured beside its chains: token trees, the speculation cache (overlap) on
    chains, and both."""
    out = []
    if m.get("draft_trees"):
        out.append("tree")
    if m.get("speculate"):
        out.append("overlap")
    if m.get("draft_trees") and m.get("speculate"):
        out.append("tree+overlap")
    return out


def describe_plan(plan: dict) -> list[str]:
    n = plan["max_new_tokens"]
    lines = [f"mode **{plan['mode']}**: {n} new tokens per generation"
             + (f" (the spec's {SPEC_MAX_NEW_TOKENS} is used by `--long`; fewer here to fit the time)" if n < SPEC_MAX_NEW_TOKENS else ""),
             f"prompts per workload: {plan['prompts'] or 'all'}, repeats: {plan['repeats']}, "
             f"one warm-up generation of {plan['warmup_tokens']} tokens per method (proposer, greedy/sampled) and placement before timing",
             f"specdec draft greedy K: {plan['greedy_ks']} + adaptive + K=0; sampled T {plan['sampled_temps']} at K {plan['sampled_ks']} + adaptive"
             + (f" (sampled rows, specdec and peer, only in {', '.join(f'{p}/{w}' for p, w in plan['sampled_cells'])}; "
                f"`--sampled-everywhere` for all)" if plan["sampled_cells"] else ""),
             f"grounded workload: proposers {plan['proposers']} at K {plan['lookup_ks']} + adaptive; "
             f"peer prompt lookup K {plan['peer_lookup_ks']}"]
    if "template" in plan["workloads"]:
        where = "" if plan["template_placements"] is None else f" ({', '.join(plan['template_placements'])} placement only)"
        lines.append(f"template workload{where}: {plan['template_prompts']} requests in sequence, once (a repeat would find its own "
                     f"earlier outputs); target alone, K=0 and {', '.join(TEMPLATE_PROPOSERS)} at adaptive K; suffix and "
                     "hybrid rows each get a fresh coordinator, so their shared suffix tree starts empty and learns "
                     "only from the row's own earlier requests (open and grounded rows run with the shared tree off: "
                     "other rows and repeats ask the same prompts)")
    if tree_variants(plan):
        lines.append(f"draft-model variants beside its chains: {', '.join(tree_variants(plan))} (tree: node budget "
                     f"{plan['draft_trees']}, K = depth; overlap: the draft's speculation cache, {plan['speculate']} outcomes)")
    extra = {k: v for k, v in plan["extra_args"].items() if v}
    if extra:
        lines.append("extra service flags: " + "; ".join(f"{k} `{shlex.join(v)}`" for k, v in extra.items()))
    if plan["peer_fixed_ks"]:
        lines.append(f"peer assisted generation also at fixed K {plan['peer_fixed_ks']} (confidence early-stop off)")
    return lines


# --- machine / environment ------------------------------------------------------------------------

# --- one placement --------------------------------------------------------------------------------

