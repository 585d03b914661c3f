"""Declared parameters: what each exercise accepts, checked before any work is done.

Every key an exercise takes is a `Param`: its default, its type, its allowed values or range and
its unit. `lab run` checks each value (defaults, the CPU and quick overrides, and the user's
`--param`) against its declaration before the first exercise starts; a bad one ends the run with
one line naming the parameter, the value and what is allowed (exit 2), and no record is written.

    sizes=Int([2**20, 2**28], min=1, unit="elements", many=True)
    dtype=Choice("fp16", ("fp16", "bf16", "fp32"))
    world_sizes=Int("auto", min=2, many=True, also=("auto",))
    data_dir=Folder(None)               # a folder; stored in records relative to the repo

A list parameter (`many=True`) also takes a single value (`sizes=1024` means `[1024]`), never an
empty list. `also` lists literal values accepted besides the typed ones ("auto").
"""
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path as _Path
from typing import Any, Callable

from .errors import LabError

KINDS = ("int", "float", "bool", "str", "path", "dict", "any")


class ParamError(LabError):
    """A parameter value outside its declaration (exit 2, before any work)."""


@dataclass(frozen=True)
class Param:
    default: Any
    kind: str
    unit: str | None = None
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    many: bool = False            # a list of values, each checked alone
    length: int | None = None     # a list of exactly this many values (a shape)
    nullable: bool = False        # None is allowed (an unset optional value)
    also: tuple = ()              # literal values accepted besides the typed ones, e.g. ("auto",)
    fields: dict | None = None    # kind "dict": the declared keys, each a Param
    help: str | None = None
    must_exist: bool = True       # kind "path": the folder must already be there
    rule: Callable[[Any], str | None] | None = None   # across one value's parts (each item's, in a list): why not

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown parameter kind '{self.kind}'")

    # ------------------------------------------------------------------ what is allowed, in words
    def allowed(self) -> str:
        if self.kind == "dict":
            what = "an object with " + ", ".join(sorted(self.fields or {})) if self.fields else "an object"
        elif self.choices is not None:
            what = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.min is not None and self.max is not None:
                what += f" from {_num(self.min)} to {_num(self.max)}"
            elif self.min is not None:
                what += f" >= {_num(self.min)}"
            elif self.max is not None:
                what += f" <= {_num(self.max)}"
        elif self.kind == "bool":
            what = "true or false"
        elif self.kind == "path":
            what = "an existing folder" if self.must_exist else "a folder (made if missing)"
        elif self.kind == "str":
            what = "a string"
        else:
            what = "any value"
        if self.unit:
            what += f" ({self.unit})"
        if self.length and self.many:
            what = f"a list of shapes, each a list of {self.length} values, each {what}"
        elif self.length:
            what = f"a list of {self.length} values, each {what}"
        elif self.many:
            what = f"a list of values, each {what}"
        extras = [repr(a) if isinstance(a, str) else str(a) for a in self.also]
        if self.nullable:
            extras.append("null")
        return what + (f", or {' or '.join(extras)}" if extras else "")

    # ------------------------------------------------------------------ checking
    def check(self, name: str, value):
        """The value to run with (a single value for a list parameter becomes a list), or
        ParamError with one line naming the parameter, the value and what is allowed."""
        if value in self.also or (value is None and self.nullable and not self.many):
            return value
        if self.many:
            items = value if isinstance(value, (list, tuple)) else [value]
            if self.length and items and not isinstance(items[0], (list, tuple)):
                items = [items]                        # one shape given alone: a list of one shape
            if not items:
                raise ParamError(f"--param {name}={_show(value)}: needs at least one value; allowed: {self.allowed()}")
            out = [self._shape(name, v, value) if self.length else self._one(name, v, value) for v in items]
        elif self.length:
            out = self._shape(name, value, value)
        else:
            out = self._one(name, value, value)
        for item in (out if self.many else [out]) if self.rule else ():   # each shape, each object
            why = self.rule(item)
            if why:
                raise ParamError(f"--param {name}={_show(value)}: {why}")
        return out

    def _shape(self, name: str, shape, whole) -> list:
        if not isinstance(shape, (list, tuple)) or len(shape) != self.length:
            raise self._error(name, whole, None if shape is whole else shape)
        return [self._one(name, v, whole) for v in shape]

    def _one(self, name: str, v, whole):
        bad = lambda: self._error(name, whole, v)          # noqa: E731
        if v is None and self.nullable:
            return v                                       # inside a list too: [null, 16]
        if v in self.also and v is whole and not isinstance(v, bool):
            return v                                       # 'auto' stands for the whole list, not an item
        if self.kind == "any":
            return v
        if self.kind == "bool":
            if not isinstance(v, bool):
                raise bad()
            return v
        if self.kind == "int":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and
                                                                         (not math.isfinite(v) or v != int(v))):
                raise bad()
            v = int(v)
        elif self.kind == "float":             # an int stays an int: 300 is recorded as 300
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad()
        elif self.kind in ("str", "path"):
            if not isinstance(v, str) or not v.strip():
                raise bad()
        elif self.kind == "dict":
            if not isinstance(v, dict):
                raise bad()
            return self._fields(name, v)
        if self.choices is not None and v not in self.choices:
            raise bad()
        if self.kind in ("int", "float"):
            if (self.min is not None and v < self.min) or (self.max is not None and v > self.max):
                raise bad()
        if self.kind == "path":
            p = _Path(v).expanduser()
            if (self.must_exist or p.exists()) and not p.is_dir():
                raise ParamError(f"--param {name}={_show(v)}: no such folder; allowed: {self.allowed()}")
        return v

    def _fields(self, name: str, v: dict) -> dict:
        if self.fields is None:
            return v
        unknown = sorted(set(v) - set(self.fields))
        if unknown:
            raise ParamError(f"--param {name}: unknown key '{unknown[0]}'; allowed keys: {', '.join(sorted(self.fields))}")
        out = {}
        for key, spec in self.fields.items():
            if key in v:
                out[key] = spec.check(f"{name}.{key}", v[key])
            elif spec.default is not None or spec.nullable:
                out[key] = spec.default
            else:
                raise ParamError(f"--param {name}: missing key '{key}' ({spec.allowed()})")
        return out

    def _error(self, name: str, whole, item=None) -> ParamError:
        got = "" if item is None or item is whole else f" ({_show(item)} is not)"
        return ParamError(f"--param {name}={_show(whole)}: must be {self.allowed()}{got}")

    # ------------------------------------------------------------------ how it is recorded
    def recorded(self, value):
        """The value as a record may hold it: a path becomes relative to the repository, or a
        folder name plus a hash of its contents when it lies outside (never absolute)."""
        if self.kind != "path" or value is None or value in self.also:
            return value
        return recorded_path(value)


def recorded_path(value) -> str:
    from .paths import REPO_ROOT
    p = _Path(value).expanduser().resolve()
    try:
        return p.relative_to(REPO_ROOT).as_posix() or "."
    except ValueError:
        pass
    return f"{p.name}@sha256:{content_hash(p)[:16]}"


def content_hash(folder: _Path) -> str:
    """sha256 over the relative names and contents of every file under `folder` (sorted)."""
    h = hashlib.sha256()
    files = sorted(f for f in _Path(folder).rglob("*") if f.is_file()) if _Path(folder).is_dir() else []
    for f in files:
        h.update(f.relative_to(folder).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _num(x) -> str:
    if isinstance(x, float) and x == int(x):
        x = int(x)
    if isinstance(x, int):
        if x >= 2**20 and (x & (x - 1)) == 0:
            return f"{x:,} (2^{x.bit_length() - 1})"
        return f"{x:,}"
    return f"{x:g}"


def _show(v) -> str:
    text = str(v).replace("'", "").replace(" ", "") if isinstance(v, (list, tuple, dict)) else str(v)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------ constructors
def Int(default, *, min=None, max=None, unit=None, many=False, length=None, nullable=False, also=(),
        choices=None, rule=None, help=None) -> Param:
    return Param(default, "int", unit, min, max, tuple(choices) if choices else None, many, length, nullable,
                 tuple(also), None, help, rule=rule)


def Float(default, *, min=None, max=None, unit=None, many=False, nullable=False, also=(), help=None) -> Param:
    return Param(default, "float", unit, min, max, None, many, None, nullable, tuple(also), None, help)


def Bool(default, *, many=False, help=None) -> Param:
    return Param(default, "bool", many=many, help=help)


def Choice(default, choices, *, many=False, nullable=False, help=None) -> Param:
    return Param(default, "str", choices=tuple(choices), many=many, nullable=nullable, help=help)


def Text(default, *, nullable=False, rule=None, help=None) -> Param:
    """A string; `rule(value)` returns why a value is not allowed (an unknown model, a server that
    does not answer), or None."""
    return Param(default, "str", nullable=nullable, help=help, rule=rule)


def Folder(default=None, *, must_exist=True, help=None) -> Param:
    """A folder the user names; None means 'the lab's default place'."""
    return Param(default, "path", nullable=True, help=help, must_exist=must_exist)


def Record(default, fields: dict, *, many=False, rule=None, help=None) -> Param:
    """An object with declared keys (a model shape), or a list of them; `rule(value)` returns why a
    combination of keys is not allowed (n_embd not a multiple of n_head), or None."""
    return Param(default, "dict", many=many, fields=dict(fields), help=help, rule=rule)
