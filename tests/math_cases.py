"""Builders shared by the exact unit tests of specdec.math (tests/test_rejection.py, test_sampling.py,
test_seeds.py, test_tree.py, test_tree_verify.py): float rows, token ids, ragged counts, random trees."""

from __future__ import annotations

import torch


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def d(tokens) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def cu_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0] + sizes).cumsum(0)


def random_tree(g: torch.Generator, n: int, v: int, distinct: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """parents[i] uniform in [-1, i); tokens uniform, or distinct among siblings."""
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    tokens: list[int] = []
    for i in range(n):
        siblings = {tokens[j] for j in range(i) if parents[j] == parents[i]} if distinct else set()
        choices = [x for x in range(v) if x not in siblings]
        tokens.append(choices[int(torch.randint(0, len(choices), (1,), generator=g))])
    return d(parents), d(tokens)
