"""The layers are layers: an import graph of every non-test module (parsed, not run) has no cycle and no
import upward, and the coordinator, the client and the torch-free serving modules do not import torch.

The layers, bottom to top (a module imports only lower layers and its own room):
  0 specdec.math (imports nothing of ours), specdec.proto (generated)
  1 specdec.core (errors, prefix fingerprints, proposer names, the settings mechanism)
  2 specdec.models (where models come from)
  3 specdec.engine
  4 specdec.serving (server skeleton, auth, flags, metrics, logs, the tiers' shared server parts),
    specdec.training (trainers of draft heads: above the engine, beside serving)
  5 draft_service, target_service (the tiers)
  6 coordinator, specdec.client (rooms of one layer: neither imports the other)
  7 bench
Every import counts: inside functions and under `if TYPE_CHECKING:` too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "coordinator", "draft_service", "target_service", "bench")
# (room, layer): a module belongs to the room with the longest matching prefix.
ROOMS = {
    "specdec.math": 0, "specdec.proto": 0, "specdec": 0,
    "specdec.core": 1,
    "specdec.models": 2,
    "specdec.engine": 3,
    "specdec.serving": 4, "specdec.training": 4,
    "draft_service": 5, "target_service": 5,
    "coordinator": 6, "specdec.client": 6,
    "bench": 7,
}

TORCH_FREE = ["coordinator.service", "coordinator.api.frontend", "coordinator.api.openai_api",
              "coordinator.api.http_server", "coordinator.metrics", "coordinator.generation", "specdec.client",
              "specdec.client.cli", "specdec.client.bench", "specdec.serving.metrics", "specdec.serving.logs",
              "specdec.serving.server", "specdec.serving.auth", "specdec.serving.flags", "specdec.core.errors",
              "specdec.core.prefix", "specdec.core.settings", "specdec.core.proposer_names"]


def modules() -> dict[str, Path]:
    """Every tracked source module outside tests, by dotted name (the generated stubs are not tracked)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if ".venv" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Our modules `name` imports, anywhere in the file (TYPE_CHECKING blocks and function bodies included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when that is a module, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES + ("tests",):
                found.add(t)
    return found


def room(module: str) -> str:
    return max((r for r in ROOMS if module == r or module.startswith(r + ".")), key=len)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of g that runs upward or sideways (to another room of the same layer), or from tests."""
    bad = []
    for importer, targets in g.items():
        r = room(importer)
        for t in targets:
            if t.split(".")[0] == "tests":
                bad.append(f"{importer} imports {t} (tests are not a library)")
                continue
            tr = room(t)
            if tr == r or ROOMS[tr] < ROOMS[r] and r != "specdec.math":
                continue
            bad.append(f"{importer} (layer {ROOMS[r]}, {r}) imports {t} (layer {ROOMS[tr]}, {tr})")
    return sorted(bad)


def test_no_upward_import_and_none_from_tests():
    bad = upward(graph())
    assert not bad, "\n".join(bad)


def test_the_client_imports_no_server():
    """specdec.client (what a user's program imports) needs none of the coordinator or the tiers: the client
    is covered by the check above, and the check finds such an arrow."""
    g = graph()
    client = {m: ts for m, ts in g.items() if room(m) == "specdec.client"}
    assert "specdec.client.cli" in client and "specdec.client.serve" in client
    assert not upward(client)
    assert upward({"specdec.client.cli": {"coordinator.config"}}) == [
        "specdec.client.cli (layer 6, specdec.client) imports coordinator.config (layer 6, coordinator)"]
    servers = [f"{m} imports {t}" for m, ts in client.items() for t in ts
               if t.split(".")[0] in ("coordinator", "draft_service", "target_service")]
    assert not servers, servers  # it starts them as processes (specdec.client.local), never imports them


def test_math_imports_nothing_of_ours():
    bad = [f"{m} imports {t}" for m, ts in graph().items() if room(m) == "specdec.math"
           for t in ts if room(t) != "specdec.math"]
    assert not bad, bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_coordinator_and_client_do_not_import_torch():
    code = f"import sys\nfor m in {TORCH_FREE!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
