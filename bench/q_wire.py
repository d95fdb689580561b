"""q's trip on the wire, in one process: the draft's encode (specdec.serving.draft_probs), the coordinator's copy of
the rows into a VerifyRequest, serialising and parsing, and the target's decode with its checks. Random rows of
top_n distinct ids each; microseconds per round, best of five repeats (compare runs made in one sitting).

    python -m bench.q_wire                      # K = 2, 4, 8 at --draft-top-n 64 (the default), and K = 8 at 256
    python -m bench.q_wire --shapes 4x64,8x256
"""

from __future__ import annotations

import argparse
import timeit

import torch

from specdec.engine.draft_probs import DraftProbs
from specdec.proto import target_pb2
from specdec.serving import draft_probs

VOCAB = 49152  # SmolLM2's


def one_round(q: DraftProbs, k: int) -> DraftProbs | None:
    rows = draft_probs.encode(q)  # the draft tier
    request = target_pb2.VerifyRequest(draft_tokens=list(range(k)), q=rows)  # the coordinator forwards the rows
    got = target_pb2.VerifyRequest.FromString(request.SerializeToString())  # the wire
    return draft_probs.decode(got.q, k, VOCAB)  # the target tier


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.q_wire", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="2x64,4x64,8x64,8x256", help="comma list of KxTOP_N")
    p.add_argument("--number", type=int, default=300, help="rounds per repeat")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        k, top_n = (int(x) for x in shape.split("x"))
        rows = []
        for _ in range(k):
            probs = torch.rand(top_n, generator=g)
            rows.append((torch.randperm(VOCAB, generator=g)[:top_n], probs / probs.sum()))
        q = DraftProbs.from_rows(rows)
        best = min(timeit.repeat(lambda: one_round(q, k), number=args.number, repeat=5)) / args.number
        print(f"K = {k}, top_n = {top_n}: {best * 1e6:.1f} us per round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
