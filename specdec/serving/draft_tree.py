"""The wire form of a draft token-tree request (draft.proto: ProposeRequest.tree_*, speculate) checked and
converted for the engine (specdec.engine.propose_tree), each failure an INVALID_ARGUMENT naming the field,
and the tree reply's fields back."""

from __future__ import annotations

from specdec.core.errors import invalid_argument
from specdec.engine.propose_tree import TreeProposeResult
from specdec.engine.tree_growth import GREEDY, TreeShape
from specdec.engine.verify import CANDIDATES, IID, WITHOUT_REPLACEMENT
from specdec.math.params import SamplingParams
from specdec.proto import draft_pb2, target_pb2

MAX_SPECULATE = 16  # outcomes one request may pre-draft
DEFAULT_BRANCHING = 4  # tree_branching 0
SCHEMES = {target_pb2.TREE_SCHEME_UNSPECIFIED: WITHOUT_REPLACEMENT, target_pb2.TREE_SCHEME_CANDIDATES: CANDIDATES,
           target_pb2.TREE_SCHEME_IID: IID, target_pb2.TREE_SCHEME_WITHOUT_REPLACEMENT: WITHOUT_REPLACEMENT}
WIRE_SCHEMES = {GREEDY: target_pb2.TREE_SCHEME_CANDIDATES, CANDIDATES: target_pb2.TREE_SCHEME_CANDIDATES,
                IID: target_pb2.TREE_SCHEME_IID, WITHOUT_REPLACEMENT: target_pb2.TREE_SCHEME_WITHOUT_REPLACEMENT}


def shape_of(request: draft_pb2.ProposeRequest, params: SamplingParams, max_nodes: int) -> TreeShape | None:
    """The requested tree's shape, or None for a chain request; INVALID_ARGUMENT naming the field."""
    n = request.tree_nodes
    if n == 0:
        for name in ("tree_depth", "tree_branching", "speculate"):
            if getattr(request, name):
                raise invalid_argument(f"{name} needs tree_nodes > 0 (a chain with a speculation cache is "
                                       "tree_branching 1)")
        return None
    if not 1 <= n <= max_nodes:
        raise invalid_argument(f"tree_nodes must be in [0, {max_nodes}], got {n}")
    depth = request.tree_depth or n
    if not 1 <= depth <= n:
        raise invalid_argument(f"tree_depth must be in [0, tree_nodes = {n}], got {request.tree_depth}")
    branching = request.tree_branching or min(DEFAULT_BRANCHING, n)
    if not 1 <= branching <= n:
        raise invalid_argument(f"tree_branching must be in [0, tree_nodes = {n}], got {request.tree_branching}")
    if request.tree_scheme not in SCHEMES:
        raise invalid_argument(f"tree_scheme {request.tree_scheme} is not a TreeScheme")
    if not 0 <= request.speculate <= MAX_SPECULATE:
        raise invalid_argument(f"speculate must be in [0, {MAX_SPECULATE}], got {request.speculate}")
    if request.grammar:
        raise invalid_argument("tree_nodes: structured output (grammar) drafts chains only; ask for a chain")
    if params.penalized:
        raise invalid_argument("tree_nodes: penalised sampling (presence, frequency or repetition penalty) takes no "
                               "trees, their counts differ per branch; ask for a chain")
    return TreeShape(n, depth, branching, GREEDY if params.greedy else SCHEMES[request.tree_scheme])


def encode(r: TreeProposeResult, response: draft_pb2.ProposeResponse) -> draft_pb2.ProposeResponse:
    """The tree fields of a reply."""
    response.parents.extend(r.parents)
    response.tree_scheme = WIRE_SCHEMES[r.scheme] if r.parents else target_pb2.TREE_SCHEME_UNSPECIFIED
    response.speculated = r.speculated
    response.salvaged = r.salvaged
    return response
