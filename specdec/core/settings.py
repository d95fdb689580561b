"""Settings declared once: a field of a config dataclass is a command-line flag, an environment variable
and a row of the docs' settings table (docs/settings.md), after vLLM's engine arguments
(vllm/engine/arg_utils.py builds its CLI from its config dataclasses' fields).

A setting is a field with a type, a default and a comment: the comment beside the field (on its line, the
lines just above it, and aligned continuation lines below it) is its help. Its flag is the field's name
with dashes, less a trailing `_s` (seconds: the help says so), after its group's prefix:
`idle_ttl_s: float = 600.0  # seconds ...` is `--idle-ttl` and SPECDEC_<SERVICE>_IDLE_TTL. A field whose
type is a dataclass is a group of settings (its class docstring's first line titles it; a `#: title`
comment line starts a group within a class, for the fields below it); so adding a
setting is adding a field. `setting(...)` says what the name and type do not: another flag name, a
parser for values such as "auto", or that a field is not a setting at all (`setting(..., cli=False)`).

Types: int, float, str, bool (--x / --no-x; from the environment true/false/1/0/yes/no/on/off, any case,
anything else an error naming the variable), `X | None` (an empty value is None), tuple[int, ...]
(comma-separated), Literal[...] (its values are the choices), a str Enum (parsed by its `parse`).
A flag on the command line wins over its environment variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")
_UNSET = object()  # argparse default: the flag was not given


def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, flag: str | None = None,
            env: str | None = None, aliases: tuple[str, ...] = (), parse: Callable | None = None,
            show: Callable | None = None, choices: Iterable | None = None, secret: bool = False,
            prefix: str = "", cli: bool = True, repr: bool = True):
    """A dataclass field with what its name and type do not say about its flag:
    flag: the flag's whole name without dashes (default: its group's prefix and the field's name, less a
    trailing _s);
    env: the full environment variable name, for names older than SPECDEC_<SERVICE>_<FLAG>;
    aliases: older flag names still accepted (each with its own SPECDEC_<SERVICE>_<ALIAS> too);
    parse / show: text -> value and value -> text, for values that are not their type's plain text;
    choices: the accepted texts; secret: never show the value; prefix: a group's flags' prefix (a
    dataclass-typed field); cli=False: not a setting (set by the code)."""
    meta = {"flag": flag, "env": env, "aliases": aliases, "parse": parse, "show": show,
            "choices": tuple(choices) if choices is not None else None, "secret": secret, "prefix": prefix, "cli": cli}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"setting": meta}, repr=repr)


@dataclass(frozen=True)
class Setting:
    """One flag, found on a field of a config dataclass."""

    path: tuple[str, ...]  # field names from the root config down to this one, e.g. ("tier", "batch", "max_queue")
    flag: str  # without dashes, e.g. "max-queue"
    env: str  # the environment variable, e.g. SPECDEC_TARGET_MAX_QUEUE
    aliases: tuple[str, ...]  # older flag names
    kind: object  # the field's type, Optional unwrapped
    optional: bool  # `X | None`: an empty value is None
    default: object  # the field's default (_UNSET: none; the service gives one)
    help: str
    group: str  # the title of the dataclass that holds the field
    parse: Callable[[str], object]
    show: Callable[[object], str]
    choices: tuple | None
    secret: bool
    custom_show: bool  # show= given: it reads None too

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    def text(self, value) -> str:
        """How a value reads in --help and the docs."""
        if self.secret:
            return "set" if value else "unset"
        if callable(value):  # a default computed at start, e.g. specdec.models.default_target
            return f"{value.__module__}.{value.__qualname__}()"
        if (value is None or value == "") and not self.custom_show:
            return "none"
        if self.kind is bool:
            return "on" if value else "off"
        return self.show(value)


@functools.cache
def comments(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """(help, group): each annotated field's comment (the comment lines just above it, the comment on its
    line(s), and the comment lines below it indented past the field: a continued comment), and the title of
    the last `#: title` line above it, where a class splits its fields into groups (else none)."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    found = {}  # row -> (text, comment-only line, continues the line above: indented past its "#" or the field)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = not lines[row - 1][:col].strip()
            found[row] = (tok.string.lstrip("#").strip(), alone, alone and tok.string[1:].startswith("  "), col)
    marks = {row: text[1:].strip() for row, (text, alone, _, _) in found.items() if alone and text.startswith(":")}
    out, groups = {}, {}
    for stmt in ast.parse(src).body[0].body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above_marks = [row for row in marks if row < stmt.lineno]
        if above_marks:
            groups[stmt.target.id] = marks[max(above_marks)]
        above, row = [], stmt.lineno - 1
        while row in found and row not in marks and found[row][1] and not found[row][2] and found[row][3] == stmt.col_offset:
            above.insert(0, found[row][0])
            row -= 1
        beside = [found[r][0] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in found and not found[r][1]]
        below, row = [], stmt.end_lineno + 1
        while beside and row in found and found[row][1] and (found[row][2] or found[row][3] > stmt.col_offset):
            below.append(found[row][0])
            row += 1
        out[stmt.target.id] = " ".join(part for part in above + beside + below if part)
    return out, groups


def title(cls: type) -> str:
    """A group's title: its docstring's first sentence, else its name."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
        return cls.__name__
    return doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"expected a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)}), got {text!r}")


def _unwrap(kind) -> tuple[object, bool]:
    """(type, optional) of an annotation, `X | None` unwrapped."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def _text_parser(kind, choices) -> tuple[Callable[[str], object], Callable[[object], str], tuple | None]:
    """(parse, show, choices) for a type."""
    if typing.get_origin(kind) is typing.Literal:
        values = typing.get_args(kind)
        return str, str, choices or values
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]

        def parse_tuple(text: str) -> tuple:
            try:
                return tuple(item(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise ValueError(f"expected {item.__name__} values separated by commas, got {text!r}") from None

        return parse_tuple, lambda v: ",".join(map(str, v)), choices
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return getattr(kind, "parse", kind), lambda v: str(v.value), choices or tuple(m.value for m in kind)
    if kind is bool:
        return parse_bool, str, choices
    if kind in (int, float, str):
        return kind, str, choices
    raise TypeError(f"settings of type {kind!r} need parse= (specdec.core.settings)")


def flag_name(name: str) -> str:
    return (name[:-2] if name.endswith("_s") else name).replace("_", "-")


def settings_of(cls: type, service: str, path: tuple[str, ...] = (), prefix: str = "") -> list[Setting]:
    """The settings of a config dataclass and the dataclasses in its fields, depth first."""
    hints = typing.get_type_hints(cls)
    helps, groups = comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting", {})
        if not meta.get("cli", True):
            continue
        kind, optional = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            out += settings_of(kind, service, path + (f.name,), prefix + meta.get("prefix", ""))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = _UNSET
        parse, show, choices = _text_parser(kind, meta.get("choices"))
        flag = meta.get("flag") or prefix + flag_name(f.name)
        out.append(Setting(
            path=path + (f.name,), flag=flag, env=meta.get("env") or env_name(service, flag),
            aliases=tuple(meta.get("aliases", ())), kind=kind, optional=optional, default=default,
            help=helps.get(f.name, ""), group=groups.get(f.name) or title(cls), parse=meta.get("parse") or parse,
            show=meta.get("show") or show, choices=choices, secret=meta.get("secret", False),
            custom_show=meta.get("show") is not None))
    return out


def env_name(service: str, flag: str) -> str:
    return f"SPECDEC_{service.upper()}_{flag.replace('-', '_').upper()}"


class SettingsError(ValueError):
    """A setting's value (from the command line or the environment) is unusable."""


class Settings:
    """The flags of one service (its env prefix SPECDEC_<SERVICE>_), built from its root config dataclasses.

    defaults: per flag name, a default that differs from the field's (a service's port, the tiers'
    connection age), or a function giving it at start (the default model)."""

    def __init__(self, service: str, roots: Mapping[str, type], defaults: Mapping[str, object] | None = None) -> None:
        self.service = service
        self.roots = dict(roots)  # name -> root dataclass
        self.settings = [s for name, cls in self.roots.items() for s in settings_of(cls, service, (name,))]
        by_flag = {}
        for s in self.settings:
            for name in (s.flag, *s.aliases):
                if name in by_flag:
                    raise ValueError(f"{service}: flag --{name} is declared twice ({by_flag[name].dest}, {s.dest})")
                by_flag[name] = s
        self.by_flag = {s.flag: s for s in self.settings}
        unknown = set(defaults or ()) - set(self.by_flag)
        if unknown:
            raise ValueError(f"{service}: defaults for unknown flags {sorted(unknown)}")
        self.defaults = {s.flag: (defaults or {}).get(s.flag, s.default) for s in self.settings}

    def default(self, s: Setting):
        """The default before the environment: the service's, else the field's; a function is called."""
        value = self.defaults[s.flag]
        return value() if callable(value) else value

    def from_env(self, s: Setting, environ: Mapping[str, str]):
        """The value of the setting's environment variable (or an alias's), _UNSET if none is set."""
        for env in (s.env, *(env_name(self.service, a) for a in s.aliases)):
            if env in environ:
                try:
                    return self.convert(s, environ[env])
                except (ValueError, argparse.ArgumentTypeError) as e:
                    raise SettingsError(f"environment variable {env}: {e}") from None
        return _UNSET

    def convert(self, s: Setting, text: str):
        if s.optional and text == "":
            return None
        if s.choices is not None and text not in s.choices:
            raise ValueError(f"expected one of {', '.join(map(str, s.choices))}, got {text!r}")
        try:
            return s.parse(text)
        except ValueError:
            if s.parse in (int, float):
                raise ValueError(f"expected {'an integer' if s.parse is int else 'a number'}, got {text!r}") from None
            raise

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add every setting to parser, in one argument group per config dataclass."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for s in self.settings:
            group = groups.get(s.group) or groups.setdefault(s.group, parser.add_argument_group(s.group))
            shown = s.text(self.defaults[s.flag])
            help_ = f"{s.help} [env {s.env}; default {shown}]".replace("%", "%%")
            names = [f"--{n}" for n in (s.flag, *s.aliases)]
            if s.kind is bool:
                group.add_argument(*names, dest=s.dest, action=argparse.BooleanOptionalAction, default=_UNSET, help=help_)
            else:
                group.add_argument(*names, dest=s.dest, type=self._argparse_type(s), default=_UNSET, help=help_,
                                   metavar=("{" + ",".join(map(str, s.choices)) + "}") if s.choices else _metavar(s))

    def _argparse_type(self, s: Setting) -> Callable[[str], object]:
        def convert(text: str):
            try:
                return self.convert(s, text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        convert.__name__ = s.flag
        return convert

    def values(self, namespace: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """dest -> value: the command line's, else the environment's, else the default."""
        environ = os.environ if environ is None else environ
        out = {}
        for s in self.settings:
            value = getattr(namespace, s.dest, _UNSET)
            if value is _UNSET:
                value = self.from_env(s, environ)
            if value is _UNSET:
                value = self.default(s)
            if value is _UNSET:
                raise SettingsError(f"--{s.flag} (or {s.env}) is required")
            out[s.dest] = value
        return out

    def build(self, values: Mapping[str, object]) -> dict[str, object]:
        """root name -> its config, each dataclass constructed from its settings (so its checks run)."""
        return {name: _construct(cls, (name,), values) for name, cls in self.roots.items()}

    def parse(self, parser: argparse.ArgumentParser, argv=None, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """Parse argv into the root configs; a bad value exits 2 with a one-line error naming its flag or variable."""
        return self.load(parser.parse_args(argv), environ)

    def load(self, namespace: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The root configs from a parsed command line (of a parser add_to filled) and the environment."""
        try:
            return self.build(self.values(namespace, environ))
        except ValueError as e:  # a config's own check (__post_init__) or an unusable environment variable
            fail(self.flags_in(str(e)))

    def flags_in(self, message: str) -> str:
        """message with config field names (tls_cert) shown as their flags (--tls-cert)."""
        if "environment variable" in message:
            return message
        names = {s.path[-1]: s.flag for s in self.settings}
        for name in sorted(names, key=len, reverse=True):
            message = _replace_word(message, name, "--" + names[name])
        return message

    def table(self) -> str:
        """The settings as markdown: a section per group (in the order of their first setting), a row per flag."""
        groups: dict[str, list[Setting]] = {}
        for s in self.settings:
            groups.setdefault(s.group, []).append(s)
        out = []
        for group, members in groups.items():
            out += ["", f"**{group}**", "", "| flag | environment variable | default | meaning |", "|---|---|---|---|"]
            out += [self._row(s) for s in members]
        return "\n".join(out).lstrip("\n")

    def _row(self, s: Setting) -> str:
        """One setting's row of the table."""
        flags = " ".join(f"`--{n}`" + (f" / `--no-{n}`" if s.kind is bool else "") for n in (s.flag, *s.aliases))
        choices = f" (one of {', '.join(f'`{c}`' for c in s.choices)})" if s.choices else ""
        return f"| {flags} | `{s.env}` | {s.text(self.defaults[s.flag])} | {s.help.replace('|', '/')}{choices} |"


def _metavar(s: Setting) -> str:
    if typing.get_origin(s.kind) is tuple:
        return "N,N,..."
    return {int: "N", float: "X"}.get(s.kind, "TEXT")


def _replace_word(text: str, word: str, by: str) -> str:
    """Replace `word` where it stands alone (not inside a longer name or after a dash)."""
    out, i = [], 0
    while (j := text.find(word, i)) >= 0:
        before = text[j - 1] if j else " "
        after = text[j + len(word)] if j + len(word) < len(text) else " "
        whole = not (before.isalnum() or before in "_-") and not (after.isalnum() or after == "_")
        out += [text[i:j], by if whole else word]
        i = j + len(word)
    return "".join(out + [text[i:]])


def _construct(cls: type, path: tuple[str, ...], values: Mapping[str, object]):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("setting", {}).get("cli", True):
            continue
        kind, _ = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(kind):
            kwargs[f.name] = _construct(kind, path + (f.name,), values)
        else:
            kwargs[f.name] = values[".".join(path + (f.name,))]
    return cls(**kwargs)


def fail(message: str) -> typing.NoReturn:
    """Exit 2 with a one-line error, as argparse does for a bad flag."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
