"""Component configs as the one source of truth for the command line and YAML.

A component owns a dataclass next to its code. Each field a user may set is declared with
:func:`option` (its flag, aliases, choices or range, whether it names a path) and documented by
the docstring under it, which is also its ``--help`` text::

    @dataclass
    class EmaConfig:
        eta: float = option(0.9, flag="--ema-eta", aliases=("--ref-policy-ema-tau",),
                            range=between(0, 1))
        \"\"\"EMA anchor decay eta; 1.0 is the fixed reference policy of GRPO.\"\"\"

A tree of such dataclasses (:class:`~emapg_megatron.arguments.RunConfig`) generates the parser
(:func:`add_arguments`), reads YAML against it (:func:`yaml_defaults`), is built back from the
parsed values (:func:`build`) and checked field by field (:func:`check_fields`). Fields declared
without :func:`option` are set by code, never by the user. This module imports nothing of the
package but its errors: every config module may use it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass

import yaml

from emapg_megatron.errors import ConfigError

_OPTION = "emapg_option"


# --- declaring options ------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """Valid numbers: ``low``/``high`` bounds (None: unbounded), open or closed, plus ``also``
    (values outside the range that mean something, e.g. -1 for "off")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()

    def __contains__(self, value) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok

    def __str__(self) -> str:
        if self.high is None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.low is None:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                    f"{')' if self.high_open else ']'}")
        return text + "".join(f" or {v:g}" for v in self.also)


def at_least(low: float, *, also: tuple = ()) -> Range:
    return Range(low=low, also=also)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open)


ANY_NUMBER = Range()
"""Every finite number (a rotary base, an init std, ...): the range check is then "finite"."""


@dataclass(frozen=True)
class Option:
    """How a field appears on the command line (``flag`` None: ``--`` + the field's name)."""

    flag: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple | None = None
    range: Range | None = None
    path: str | None = None
    """``"exists"``: must exist (file or directory); ``"dir"``: an existing directory;
    ``"output"``: a directory that is or can be made writable."""
    negatable: bool = False
    """A boolean with ``--no-`` form (its default is True)."""
    metavar: tuple[str, ...] | str | None = None
    deprecated: tuple[str, ...] = ()
    """Old spellings still accepted, left out of ``--help``; each one used prints one line on
    stderr naming the flag that replaces it."""
    trajectory: bool = False
    """Changing it changes the data order or the samples: a run resumed with another value no
    longer follows the uninterrupted one (:func:`trajectory_dests`)."""
    const: object = None
    """A flag that may be given without a value (``--dry-run`` or ``--dry-run=json``): alone it
    takes this value; its default (not among the choices) means "not given"."""


def option(default=MISSING, *, flag: str | None = None, aliases: tuple[str, ...] = (),
           choices=None, range: Range | None = None, path: str | None = None,
           negatable: bool = False, metavar=None, deprecated: tuple[str, ...] = (),
           trajectory: bool = False, const=None):
    """A dataclass field the user sets by a flag (and in YAML); see :class:`Option`. Without a
    default the flag is required (:func:`check_fields` says it needs a value)."""
    meta = Option(flag, tuple(aliases), tuple(choices) if choices is not None else None, range,
                  path, negatable, metavar, tuple(deprecated), trajectory, const)
    return dataclasses.field(default=default, metadata={_OPTION: meta})


# --- reading the declarations -----------------------------------------------------------------
def option_of(f: dataclasses.Field) -> Option | None:
    return f.metadata.get(_OPTION)


def flag_of(f: dataclasses.Field) -> str:
    opt = option_of(f)
    return (opt.flag if opt and opt.flag else "--" + f.name.replace("_", "-"))


def dest_of(f: dataclasses.Field) -> str:
    """The parsed value's name: the flag without dashes (``--kl-coef`` -> ``kl_coef``)."""
    return flag_of(f)[2:].replace("-", "_")


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if option_of(f) is not None]


def component_fields(cls) -> list[dataclasses.Field]:
    """Fields of a config tree that are configs themselves."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of ``cls`` (and its dataclass bases), whitespace folded."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):  # no source (a frozen install): no help text
            continue
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def value_type(cls, f: dataclasses.Field):
    """(scalar type, count): ``int | None`` -> (int, None); ``tuple[float, float]`` -> (float, 2);
    ``tuple[str, ...]`` -> (str, "+"), one value or more."""
    tp = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return args[0], ("+" if args[-1] is Ellipsis else len(args))
    return tp, None


def walk(cls, path: tuple[str, ...] = ()):
    """``(path to the component, component class, option field)`` for every option of a tree.

    An option that several components inherit from one base comes once per component: the same
    field, one flag, whose value each of them gets."""
    for f in option_fields(cls):
        yield path, cls, f
    for f in component_fields(cls):
        yield from walk(typing.get_type_hints(cls)[f.name], (*path, f.name))


def component_classes(cls, path: tuple[str, ...] = ()):
    """``(path, component class)`` for the tree ``cls`` and each component in it."""
    yield path, cls
    for f in component_fields(cls):
        yield from component_classes(typing.get_type_hints(cls)[f.name], (*path, f.name))


def components(cfg):
    """Every component of a config instance, ``cfg`` first."""
    yield cfg
    for f in component_fields(type(cfg)):
        yield from components(getattr(cfg, f.name))


# --- the command line -------------------------------------------------------------------------
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help text already says what the default is, or there
    is none (an unset optional flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser, tree) -> None:
    """One argument group per component of ``tree`` and one argument per option field. An option
    several components share (inherited from one base) is one argument, in the group of the
    closest component that holds them all."""
    classes = dict(component_classes(tree))
    homes: dict[dataclasses.Field, tuple[str, ...]] = {}
    for path, _, f in walk(tree):
        homes[f] = tuple(os.path.commonprefix([homes[f], path])) if f in homes else path
    groups: dict[tuple, argparse._ArgumentGroup] = {}
    seen: dict[str, str] = {}
    for _, cls, f in walk(tree):
        home = homes.pop(f, None)
        if home is None:
            continue  # shared, and added already
        if home not in groups:
            groups[home] = _group(parser, home, classes[home])
        _add_option(groups[home], cls, f, seen)


def _group(parser: argparse.ArgumentParser, path: tuple[str, ...], cls) -> argparse._ArgumentGroup:
    title = path[-1] if path else "run"
    doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    return parser.add_argument_group(title, doc.replace("%", "%%") or None)


def _add_option(group: argparse._ArgumentGroup, cls, f: dataclasses.Field, seen: dict[str, str]) -> None:
    """The field's flag and aliases, and its deprecated spellings (left out of ``--help``)."""
    opt, flag = option_of(f), flag_of(f)
    for name in (flag, *opt.aliases, *opt.deprecated):
        if name in seen:
            raise TypeError(f"{name} is declared twice ({seen[name]} and {cls.__name__}.{f.name})")
        seen[name] = f"{cls.__name__}.{f.name}"
    kw = _argument(cls, f)
    group.add_argument(flag, *opt.aliases, **kw)
    for old in opt.deprecated:  # the same action class as the flag's, so the old spelling parses alike
        base = group._registry_get("action", kw.get("action"), kw.get("action"))
        group.add_argument(old, **dict(kw, action=deprecated_action(base, flag),
                                       default=argparse.SUPPRESS, help=argparse.SUPPRESS))


def deprecated_action(base: type[argparse.Action], new: str) -> type[argparse.Action]:
    """``base`` that first says, once per parser, that the spelling used is deprecated."""

    class Deprecated(base):
        def __call__(self, parser, namespace, values, option_string=None):
            warn_deprecated(parser, option_string, new)
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


def warn_deprecated(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """One line on stderr the first time ``parser`` meets the deprecated spelling ``old``."""
    warned = vars(parser).setdefault("_deprecated_seen", set())
    if old not in warned:
        warned.add(old)
        print(f"warning: {old} is deprecated: use {new}", file=sys.stderr)


def _argument(cls, f: dataclasses.Field) -> dict:
    opt = option_of(f)
    default = None if f.default is MISSING else f.default
    kw = dict(dest=dest_of(f), default=default,
              help=field_docs(cls).get(f.name, "").replace("%", "%%"))
    scalar, count = value_type(cls, f)
    if scalar is bool:
        kw["action"] = argparse.BooleanOptionalAction if opt.negatable else "store_true"
        return kw
    kw["type"] = scalar
    if count is not None:
        kw["nargs"] = count
    if opt.const is not None:
        kw.update(nargs="?", const=opt.const)
    if opt.choices is not None:
        kw["choices"] = opt.choices
    if opt.metavar is not None:
        kw["metavar"] = opt.metavar
    return kw


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching (``--train-iter`` is not ``--train-iters``), whose errors
    are one ConfigError line, an unknown flag with the closest known one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            unknown = [a.split("=", 1)[0] for a in message.split(": ", 1)[1].split() if a.startswith("-")]
            known = [s for a in self._actions for s in a.option_strings]
            close = difflib.get_close_matches(unknown[0], known, n=1) if unknown else []
            if close:
                message += f" (did you mean {close[0]}?)"
        raise ConfigError(message)


# --- YAML --------------------------------------------------------------------------------------
def yaml_defaults(parser: argparse.ArgumentParser, path: str, what: str,
                  refused: tuple[str, ...] = ()) -> dict:
    """``{dest: value}`` of a YAML mapping whose keys are flag names (or aliases) without the
    dashes, with ``-`` or ``_``; each value checked as the command line checks its flag."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of flag names to values")
    actions = {s[2:].replace("-", "_"): a for a in parser._actions for s in a.option_strings
               if s.startswith("--") and a.dest not in (*refused, "help")}
    unknown = [key for key in data if str(key).replace("-", "_") not in actions]
    if unknown:
        known = [k.replace("_", "-") for k in actions]
        said = []
        for key in unknown:
            close = difflib.get_close_matches(str(key).replace("_", "-"), known, n=1)
            said.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{what} {path}: unknown option{'s' if len(said) > 1 else ''} {', '.join(said)}")
    out = {}
    for key, value in data.items():
        action = actions[str(key).replace("-", "_")]
        try:
            out[action.dest] = _yaml_value(action, value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{what} {path}: {key}: {e}") from None
    return out


def _yaml_value(action: argparse.Action, value):
    """A YAML value checked as the command line checks the flag: type, arity and choices."""
    if value is None:
        return None
    if action.nargs == "?" and isinstance(value, bool):  # the flag alone (true), or not given
        return action.const if value else action.default
    if action.nargs == "?" and value not in action.choices:
        raise ValueError(f"must be true, false or one of {', '.join(map(str, action.choices))} (got {value!r})")
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false (got {value!r})")
        return value
    if action.nargs == "+":
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be a list of one value or more (got {value!r})")
        return [_yaml_scalar(action, v) for v in value]
    if isinstance(action.nargs, int):
        if not isinstance(value, list) or len(value) != action.nargs:
            raise ValueError(f"must be a list of {action.nargs} values (got {value!r})")
        return [_yaml_scalar(action, v) for v in value]
    return _yaml_scalar(action, value)


def _yaml_scalar(action: argparse.Action, value):
    if isinstance(value, (list, dict)):
        raise ValueError(f"must be a single value (got {value!r})")
    kind = action.type
    if kind in (int, float) and isinstance(value, bool):
        raise ValueError(f"must be a number (got {value!r})")
    if kind is int and not (isinstance(value, int)
                            or (isinstance(value, str) and value.strip().lstrip("+-").isdigit())):
        raise ValueError(f"must be an integer (got {value!r})")
    out = kind(value) if kind is not None else (value if isinstance(value, str) else str(value))
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))} (got {value!r})")
    return out


# --- building and checking --------------------------------------------------------------------
def build(tree, values: dict):
    """An instance of the config tree ``tree`` from parsed ``{dest: value}``; a missing value
    keeps the field's default."""
    hints = typing.get_type_hints(tree)
    kwargs = {f.name: build(hints[f.name], values) for f in component_fields(tree)}
    for f in option_fields(tree):
        if dest_of(f) in values:
            value = values[dest_of(f)]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return tree(**kwargs)


def flat(cfg) -> dict:
    """``{dest: value}`` of every option of a config tree (what ``--dry-run`` prints and a
    checkpoint records)."""
    out = {}
    for f in option_fields(type(cfg)):
        out[dest_of(f)] = getattr(cfg, f.name)
    for f in component_fields(type(cfg)):
        out.update(flat(getattr(cfg, f.name)))
    return out


def trajectory_dests(tree) -> tuple[str, ...]:
    """The dests of a config tree's options declared ``trajectory=True``, in declaration order."""
    return tuple(dict.fromkeys(dest_of(f) for _, _, f in walk(tree) if option_of(f).trajectory))


def check_fields(cfg) -> None:
    """Each option of ``cfg`` (one component) against its declaration: a value where the default
    has one (or there is no default), a choice, a finite number in its range. Raises ConfigError
    with one line."""
    for f in option_fields(type(cfg)):
        value, opt, flag = getattr(cfg, f.name), option_of(f), flag_of(f)
        if opt.const is not None and value == f.default:
            continue  # a flag with an optional value, not given
        if value is None:
            if f.default is not None:
                raise ConfigError(f"{flag} needs a value")
            continue
        if opt.choices is not None and value not in opt.choices:
            raise ConfigError(f"{flag} must be {_alternatives(opt.choices)} (got {value!r})")
        scalar, count = value_type(type(cfg), f)
        if scalar in (int, float):
            for v in (value if count is not None else (value,)):
                _check_number(flag, v, opt.range or ANY_NUMBER, scalar)


def _alternatives(choices) -> str:
    """``one of a, b, c``; ``a or b`` for two."""
    names = [str(c) for c in choices]
    return " or ".join(names) if len(names) <= 2 else f"one of {', '.join(names)}"


def _check_number(flag: str, value, rng: Range, scalar) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (scalar is int and isinstance(value, float)):
        raise ConfigError(f"{flag} must be {'an integer' if scalar is int else 'a number'} (got {value!r})")
    if value not in rng:
        raise ConfigError(f"{flag} must be a finite number (got {value})" if rng == ANY_NUMBER
                          else f"{flag} must be {rng} (got {value})")


def check_paths(cfg, *, outputs: bool = True) -> None:
    """Each path option of a config tree: inputs exist, outputs are (or can be made) writable
    directories; ``outputs=False`` skips the latter (a dry run may name another machine's)."""
    for path, cls, f in walk(type(cfg)):
        value = getattr(_component(cfg, path), f.name)
        kind = option_of(f).path
        if value is None or kind is None:
            continue
        flag = flag_of(f)
        if kind == "exists" and not os.path.exists(value):
            raise ConfigError(f"{flag} does not exist: {value}")
        if kind == "dir" and not os.path.isdir(value):
            raise ConfigError(f"{flag} path does not exist: {value}")
        if kind == "output" and outputs:
            check_writable_dir(flag, value)


def _component(cfg, path: tuple[str, ...]):
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is a directory, or one can be made there: its nearest existing ancestor is a
    writable directory (else rank 0 would fail alone, after the build, leaving the others waiting)."""
    there = os.path.abspath(path)
    while not os.path.exists(there):
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise ConfigError(f"{flag} {path}: {there} is not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {there} is not writable")
