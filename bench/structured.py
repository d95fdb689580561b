"""Structured output: a JSON-schema extraction workload on the default pair, and the grammar engines' mask cost.

- mask cost: per-token time to compute the allowed-token mask of a JSON schema with llguidance (the engine
  specdec uses) and, when it is installed, xgrammar, on the default pair's tokenizer (median and worst
  over a 58-token document), plus grammar compile time;
- extraction: chat prompts asking for a person record as JSON, answered with response_format json_schema
  through the three services as processes on loopback (greedy, one request at a time): the share of
  outputs that parse and satisfy the schema, and tokens/s constrained against the same requests without
  the constraint, and against the target alone (transformers' generate in-process, greedy, with the same
  grammar engine's mask as a logits processor).

    python -m bench.structured              # the month's log in docs/bench-logs/
    python -m bench.structured --prompts 2 --out /tmp/structured.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time

from bench.common import bench_log, log, machine_info, publish
from coordinator.constraint import grammar_text
from bench.pipeline import BenchPipeline
from specdec.client import Client
from specdec.client.local import LocalPipelineConfig
from specdec.models import default_draft, default_target
from specdec.proto import generate_pb2

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 40}, "skills": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                                             "maxItems": 4}},
    "required": ["name", "age", "city", "skills"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace, 36, lives in London and knows mathematics and poetry.",
          "Grace Hopper, 85, from New York City; skills: compilers, COBOL, teaching.",
          "Alan Turing was 41 and lived in Manchester. He worked on cryptanalysis and computing.",
          "Katherine Johnson, aged 101, of Hampton, Virginia: orbital mechanics, geometry.",
          "Linus Torvalds, 54, Portland. Kernels, git, C.",
          "Marie Curie, 66, Paris: physics, chemistry, radioactivity."]
DOC = {"name": "Ada Lovelace", "age": 36, "city": "London", "skills": ["mathematics", "poetry", "engines"]}


def valid(doc) -> bool:
    """Whether a parsed document satisfies SCHEMA (checked by hand: no extra dependency)."""
    if not isinstance(doc, dict) or set(doc) != set(SCHEMA["required"]):
        return False
    ok = isinstance(doc["name"], str) and isinstance(doc["city"], str) and isinstance(doc["skills"], list)
    ok = ok and isinstance(doc["age"], int) and 0 <= doc["age"] <= 130 and len(doc["skills"]) <= 4
    return ok and all(isinstance(s, str) and len(s) <= 24 for s in doc["skills"])


def messages(person: str) -> list[dict]:
    return [{"role": "system", "content": "Extract a JSON object with name, age, city and skills."},
            {"role": "user", "content": person}]


def mask_cost(tokenizer_path: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    out = {}
    import llguidance
    import llguidance.hf

    lt = llguidance.hf.from_tokenizer(tok)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lt, grammar_text(generate_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA))))
    compile_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        m.consume_token(t)
    out["llguidance"] = (compile_ms, statistics.median(times) * 1e6, max(times) * 1e6)
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed (pip install xgrammar to compare)"
        return out
    info = xgr.TokenizerInfo.from_huggingface(tok)
    t0 = time.perf_counter()
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - t0) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        matcher.accept_token(t)
    out["xgrammar"] = (compile_ms, statistics.median(times) * 1e6, max(times) * 1e6)
    return out


TREE_NODES = 8  # the constrained-with-trees row's num_speculative_nodes


def pipeline_run(target: str, draft: str, prompts: list[str], max_new: int) -> dict:
    """Each mode on a pipeline of its own, so that no mode finds another's outputs in the coordinator's
    shared suffix tree (the same prompts are asked in every mode)."""
    config = LocalPipelineConfig(target_model=target, draft_model=draft)
    fmt = {"json_schema": json.dumps(SCHEMA)}
    out = {}
    for name, extra in (("constrained", {"response_format": fmt}), ("unconstrained", {}),
                        ("constrained, trees", {"response_format": fmt, "num_speculative_nodes": TREE_NODES})):
        with BenchPipeline(config) as pipe, Client(pipe.address) as client:
            client.generate("warm up", max_new_tokens=4)
            log(f"pipeline: {name}")
            tokens, seconds, ok, outputs = 0, 0.0, 0, []
            for p in prompts:
                t0 = time.perf_counter()
                r = client.generate(messages=messages(p), max_new_tokens=max_new, **extra)
                seconds += time.perf_counter() - t0
                outputs.append([t for t in r.token_ids if r.finish_reason != "eos" or t != r.token_ids[-1]])
                tokens += len(r.token_ids)
                try:
                    ok += valid(json.loads(r.text))
                except ValueError:
                    pass
            out[name] = {"tok_s": tokens / seconds, "valid": ok, "tokens": tokens, "outputs": outputs}
    return out


def target_alone(target: str, prompts: list[str], max_new: int) -> dict:
    """transformers' generate, greedy, with llguidance's mask applied at every position; at its best of 2 and 1
    torch threads (with the machine's other work, one thread can be twice as fast as two)."""
    import torch

    best = None
    for threads in (2, 1):
        torch.set_num_threads(threads)
        r = _target_alone(target, prompts, max_new)
        r["threads"] = threads
        best = r if best is None or r["tok_s"] > best["tok_s"] else best
    return best


def _target_alone(target: str, prompts: list[str], max_new: int) -> dict:
    import llguidance
    import llguidance.hf
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from specdec.models import ModelConfig, load_model, load_tokenizer
    from specdec.serving import token_masks

    model, tok = load_model(ModelConfig(target)), load_tokenizer(target)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=eos[0])
    grammar = grammar_text(generate_pb2.ResponseFormat(json_schema=json.dumps(SCHEMA)))  # the coordinator's grammar

    class Grammar(LogitsProcessor):
        def __init__(self, start: int) -> None:
            self.matcher, self.seen = llguidance.LLMatcher(lt, grammar), start

        def __call__(self, input_ids, scores):
            new = input_ids[0, self.seen:].tolist()
            self.seen += len(new)
            if new and not self.matcher.is_stopped():
                self.matcher.consume_tokens(new)
            allowed = token_masks.decode([self.matcher.compute_bitmask()], 1, model.config.vocab_size)[0]
            return scores.masked_fill(~allowed, float("-inf"))

    tokens, seconds, ok, outputs = 0, 0.0, 0, []
    for p in prompts:
        ids = tok.apply_chat_template(messages(p), add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]  # BatchEncoding in newer transformers
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=2,
                                 logits_processor=LogitsProcessorList([Grammar(len(ids))]))
        seconds += time.perf_counter() - t0
        new = [t for t in out[0, len(ids):].tolist() if t not in eos]
        outputs.append(new)
        tokens += len(out[0, len(ids):])
        try:
            ok += valid(json.loads(tok.decode(new)))
        except ValueError:
            pass
    return {"tok_s": tokens / seconds, "valid": ok, "tokens": tokens, "outputs": outputs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=len(PEOPLE))
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    args = p.parse_args(argv)
    target, draft = default_target(), default_draft()
    prompts = PEOPLE[: args.prompts]
    masks = mask_cost(draft)  # the pair shares the tokenizer; the draft's directory holds it as tokenizer.json
    piped = pipeline_run(target, draft, prompts, args.max_new_tokens)
    alone = target_alone(target, prompts, args.max_new_tokens)
    cmd = "python -m bench.structured" + "".join(" " + a for a in (argv if argv is not None else sys.argv[1:]))
    info = machine_info()
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: structured output", "",
             f"Command: `{cmd}`. Machine: {info['cpu']}, {info['cores']} cores; git {info.get('git', '')}.", "",
             "Mask cost, a 5-field JSON schema over the default pair's tokenizer (49152 tokens), one 58-token document:", "",
             "| engine | compile | mask per token, median | worst |", "|---|---|---|---|"]
    for engine, r in masks.items():
        lines.append(f"| {engine} | {r[0]:.1f} ms | {r[1]:.1f} us | {r[2]:.0f} us |" if isinstance(r, tuple)
                     else f"| {engine} | {r} | | |")
    lines += ["", f"JSON-schema extraction, {len(prompts)} chat prompts, greedy, at most {args.max_new_tokens} tokens, "
              "one request at a time:", "", "| path | schema-valid | tokens | tokens/s |", "|---|---|---|---|"]
    for name, r in (("specdec, response_format json_schema", piped["constrained"]),
                    (f"specdec, json_schema, token trees (num_speculative_nodes {TREE_NODES})", piped["constrained, trees"]),
                    ("specdec, same prompts unconstrained", piped["unconstrained"]),
                    (f"target alone (HF generate + llguidance mask, {alone['threads']} torch threads)", alone)):
        lines.append(f"| {name} | {r['valid']}/{len(prompts)} | {r['tokens']} | {r['tok_s']:.1f} |")
    same = sum(a == b for a, b in zip(piped["constrained"]["outputs"], alone["outputs"]))
    same_trees = sum(a == b for a, b in zip(piped["constrained, trees"]["outputs"], alone["outputs"]))
    lines += ["", f"Constrained specdec output equal to the target alone's, token for token: {same}/{len(prompts)} "
              f"(with token trees: {same_trees}/{len(prompts)})."]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
