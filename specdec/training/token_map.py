"""A draft vocabulary measured on the target's own answers: `python -m specdec.training.token_map --out FILE`.

The draft tier's `--draft-vocab N` keeps a BPE tokenizer's N lowest ids, its first merges, which serve the
language its merges were learnt from. Where that is not what users write (a multilingual vocabulary serving a
script it merged late, code in a chat model's tokenizer), a map of the tokens the target actually emits does
better: the target answers prompts (the training prompts, or a file of your own, one a line) greedily on
specdec's step, and the `--size` tokens most frequent in its answers (and prompts, counted once against the
answers' twice: the EAGLE-3 trainer's rule, specdec.training.eagle3_data.draft_vocabulary) are written as a
torch tensor (`.pt`, the form SGLang's `--speculative-token-map` loads) or as text (any other suffix), for
`--draft-vocab FILE`. Prints the share of the answers' tokens the map covers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    from specdec.models import default_target

    p = argparse.ArgumentParser(prog="python -m specdec.training.token_map", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=default_target(), help="the target model (directory, .gguf or hub id)")
    p.add_argument("--out", required=True, help="the map: a .pt tensor of token ids, or text (one id a line)")
    p.add_argument("--size", type=int, default=16384, help="tokens in the map")
    p.add_argument("--prompts", default="", help="a file of prompts, one a line (default: the training prompts)")
    p.add_argument("--limit", type=int, default=0, help="prompts to answer (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the target's answer length per prompt")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from specdec.engine.config import TierConfig
    from specdec.math.draft_vocab import target_ids
    from specdec.models import ModelConfig, load_tokenizer
    from specdec.training.eagle3_data import coverage, draft_vocabulary, generated
    from specdec.training.prompts import training_prompts

    args = parse_args(argv)
    if args.prompts:
        prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = training_prompts()
    prompts = prompts[: args.limit or None]
    if not prompts:
        raise SystemExit(f"specdec.training.token_map: no prompts in {args.prompts}")
    tokenizer = load_tokenizer(args.target)
    data = generated(TierConfig(ModelConfig(args.target)), tokenizer, prompts, [], max_new_tokens=args.max_new_tokens)
    vocab_size = len(tokenizer)  # (a map filled up with unseen ids takes only ids the tokenizer has)
    d2t = draft_vocabulary(data, min(args.size, vocab_size), vocab_size)
    ids = target_ids(d2t)
    out = Path(args.out)
    if out.suffix in (".pt", ".pth"):
        torch.save(ids, out)
    else:
        out.write_text("\n".join(str(t) for t in ids.tolist()) + "\n")
    answer_tokens = sum(ex.ids.numel() - ex.prompt_len for ex in data)
    print(f"wrote {ids.numel()} token ids to {out}: {coverage(data, d2t):.3f} of the {answer_tokens} answer tokens "
          f"of {len(data)} prompts (--draft-vocab {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
