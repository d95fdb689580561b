"""The cache directory ($SPECDEC_CACHE_DIR, default ~/.cache/specdec): what is derived once from a model's files
(a GGUF's float32 copy and its tokenizer, a GGUF's block index, a tokenizer's facts), found again by a key of
those files as they are now (each one's resolved path, size and modification time: files_key).

An entry whose files have since changed or gone can never be found again: a GGUF re-installed or copied afresh
(a new modification time), a test's temporary model. Each entry therefore records the files it was derived from
(`sources`), and writing a new entry removes every entry whose sources no longer match (prune): a float32 copy
of the default target is 517 MiB, and one was left behind each time its file was re-created. Entries without a
record (written before 2026-11-28) and anything else in the directory (compiled kernels, trained heads) are
left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = "sources.json"  # a directory entry's record of its source files
STALE_TMP_S = 3600.0  # a half-written entry (name.tmpPID) this old is a crashed writer's, removed by prune
HALF_WRITTEN = re.compile(r"\.tmp\d+$")


def cache_dir() -> Path:
    """$SPECDEC_CACHE_DIR, default ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def _stamp(f) -> list:
    """[resolved path, size, whole seconds of modification time]: what a key takes of a file."""
    p = Path(f).resolve()
    st = p.stat()
    return [str(p), st.st_size, int(st.st_mtime)]


def files_key(files, *extra: str) -> str:
    """A cache key for `files` as they are now, and `extra`: a cached result derived from them is found again
    until one of them changes."""
    parts = ["|".join(str(x) for x in _stamp(f)) for f in files]
    return hashlib.sha256("|".join([*parts, *extra]).encode()).hexdigest()[:16]


def sources(files) -> list[list]:
    """The record an entry keeps of the files it was derived from."""
    return [_stamp(f) for f in files]


def publish_dir(where: Path, write: Callable[[Path], None], files: Sequence) -> None:
    """A cache directory made whole or not at all: write(tmp) fills a directory beside `where`, which then takes
    its place, unless another process put one there meanwhile (theirs is kept, ours dropped). `files`: its
    sources, recorded in it; then the entries no key can find any more are removed."""
    tmp = where.with_name(where.name + f".tmp{os.getpid()}")
    write(tmp)
    (tmp / SOURCES).write_text(json.dumps(sources(files)))
    if where.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(where)
    prune(where.parent)


def publish_json(where: Path, value: dict, files: Sequence) -> None:
    """A small cache file (a JSON object), written whole, with its sources under "sources"; then prune."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_name(where.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**value, "sources": sources(files)}))
    tmp.replace(where)
    prune(where.parent)


def _recorded(entry: Path) -> list | None:
    """An entry's recorded sources, or None (no record: not ours to judge)."""
    try:
        if entry.is_dir():
            return json.loads((entry / SOURCES).read_text())
        if entry.suffix == ".json":
            return json.loads(entry.read_text()).get("sources")
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _alive(recorded: list) -> bool:
    """Each source file is still there as it was when the entry was written."""
    for path, size, mtime in recorded:
        try:
            if _stamp(path) != [path, size, mtime]:  # (path was recorded resolved)
                return False
        except OSError:
            return False
    return True


def prune(root: Path | None = None) -> list[Path]:
    """Remove the entries of `root` (default cache_dir()) that no key can find again: those whose recorded
    sources have changed or gone, and half-written ones older than STALE_TMP_S. Returns what it removed (best
    effort: another process may be removing the same)."""
    root = cache_dir() if root is None else root
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            if HALF_WRITTEN.search(entry.name):
                dead = now - entry.stat().st_mtime > STALE_TMP_S
            else:
                recorded = _recorded(entry)
                dead = recorded is not None and not _alive(recorded)
        except OSError:
            continue
        if not dead:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        log.info("cache: removed %d entries whose model files changed or went (%s)", len(removed), root)
    return removed
