"""The wire form of a token tree (target.proto: VerifyRequest.draft_parents + tree_scheme) checked and
converted for the engine: parents through specdec.math.tree.validate_tree, each failure an
INVALID_ARGUMENT naming the request's field, before any work is queued."""

from __future__ import annotations

import torch

from specdec.core.errors import invalid_argument
from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT
from specdec.math.tree import validate_tree
from specdec.proto import target_pb2

SCHEMES = {target_pb2.TREE_SCHEME_CANDIDATES: CANDIDATES, target_pb2.TREE_SCHEME_IID: IID,
           target_pb2.TREE_SCHEME_WITHOUT_REPLACEMENT: WITHOUT_REPLACEMENT}
FIELDS = {"parents": "draft_parents", "tokens": "draft_tokens"}  # validate_tree's field names -> the request's


def tree_of(request: target_pb2.VerifyRequest, has_q: bool, walks: bool, engine) -> tuple[list[int] | None, str]:
    """The request's token tree as (parents, scheme), or (None, "") for a chain; INVALID_ARGUMENT naming the
    field for a malformed tree (specdec.math.tree.validate_tree) or a scheme its q does not fit. walks: the verdict
    walks the target's own tokens (greedy, or the keyed race), whatever the scheme: no check of q against it."""
    if not request.draft_parents:
        return None, ""
    k = len(request.draft_tokens)
    if len(request.draft_parents) != k:
        raise invalid_argument(f"draft_parents has {len(request.draft_parents)} entries but draft_tokens has {k}; "
                               "send one parent per draft token or none (a chain)")
    scheme = SCHEMES.get(request.tree_scheme, IID if has_q else CANDIDATES)
    if request.tree_scheme not in SCHEMES and request.tree_scheme != target_pb2.TREE_SCHEME_UNSPECIFIED:
        raise invalid_argument(f"tree_scheme {request.tree_scheme} is not a TreeScheme")
    if not walks and (scheme == CANDIDATES) == has_q:
        raise invalid_argument(f"tree_scheme {target_pb2.TreeScheme.Name(request.tree_scheme)}: "
                               + ("candidates take no q" if has_q else "sampled draft trees need q (one row per node)"))
    parents = list(request.draft_parents)
    try:
        validate_tree(torch.tensor(parents, dtype=torch.long), torch.tensor(list(request.draft_tokens), dtype=torch.long),
                      torch.tensor([0, k], dtype=torch.long), vocab_size=engine.vocab_size,
                      max_nodes=engine.config.max_draft_tokens, distinct_siblings=scheme == WITHOUT_REPLACEMENT)
    except ValueError as e:
        field, _, rest = str(e).partition(":")
        raise invalid_argument(f"{FIELDS.get(field, field)}:{rest}" if rest else str(e)) from None
    return parents, scheme
