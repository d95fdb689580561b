"""docs/settings.md: every service's settings, generated from their config dataclasses (specdec.core.settings).

    python -m tests.settings_doc          # rewrite docs/settings.md (make settings-doc)
    python -m tests.settings_doc --check  # exit 1 if it is stale (tests/test_settings.py does the same)
"""

from __future__ import annotations

import sys
from pathlib import Path

PATH = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

HEADER = """# Settings

Every flag of every service, generated from the config dataclasses that declare them
(`specdec/core/settings.py`): each field is a flag `--some-flag` and an environment variable
`SPECDEC_<SERVICE>_SOME_FLAG`; a flag on the command line wins over its variable, which wins over the
default. Booleans take `--x` / `--no-x`, and from the environment `true`/`false`, `1`/`0`, `yes`/`no`,
`on`/`off` (any case; anything else stops the service with an error naming the variable). An empty
value of a setting whose default is "none" means none.

Do not edit this page: change the field's comment (its help) or default, then run
`make settings-doc` (`python -m tests.settings_doc`); `tests/test_settings.py` fails while it is stale.
To add a setting, add a field ("Adding a setting", at the end, says how).
"""

FOOTER = """
## Adding a setting

Add a typed field with a default and a comment to the config dataclass it belongs to (a tier's engine:
`specdec/engine/config.py`; the gRPC server: `ServerConfig`; the coordinator and its API:
`CoordinatorConfig`; a strategy: its config class). The comment is its help; the field's name, less
a trailing `_s` (seconds), after its group's prefix (`suffix-`, `lookup-`, ...) is its flag; its type
picks the parser (`bool`, `int`, `float`, `str`, `X | None`, `tuple[int, ...]`, a `Literal`, a str
enum). A field whose type is a dataclass is a group (titled by its class docstring's first sentence);
a `#: title` comment line starts a group within a class. `setting(...)` (specdec.core.settings) says the
rest where needed: another flag name (`flag=`), older names (`aliases=`), a parser for text such as
`auto` (`parse=`, `show=`), accepted values (`choices=`), a secret (`secret=True`), or a field that
is no setting (`cli=False`). Then `make settings-doc`.
"""


def services():
    """(title, command, Settings) of every entry point."""
    import coordinator.__main__ as coordinator
    import draft_service.__main__ as draft
    import target_service.__main__ as target
    from specdec.client import serve

    return [("The target tier", "python -m target_service", target.settings()),
            ("The draft tier", "python -m draft_service", draft.settings()),
            ("The coordinator", "python -m coordinator", coordinator.settings()),
            ("One machine", "specdec serve", serve.settings())]


def render() -> str:
    out = [HEADER]
    for title, command, settings in services():
        out += [f"## {title}: `{command}`", "", settings.table(), ""]
    return "\n".join(out) + FOOTER


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PATH.read_text() != text:
            print(f"{PATH} is stale: run make settings-doc", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
