"""The parameter schema every notebook's parameter class is declared in, and its one loader.

A parameter class is a frozen dataclass deriving from `Params`: each field is
one parameter (its type, its default, a comment saying what it controls),
and the class adds only `validate()`, its checks across values. A long set is
declared in sections, small dataclasses of related fields, joined by
`composed(*sections)`; the class still reads flat (`params.lr`), as records
and `params.json` do.

Values arrive as papermill's `-p` strings ("true", "None", "1e-3", "a,b"), as
YAML's typed values (`-f`, params/*.yaml) or from a notebook's namespace; the
field's type says how each is read (`coerce`), or a field declared with
`parsed_by` names its own reader. An unknown name is refused with the
likeliest meant one.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

from cflib.errors import ParamError

NONE_WORDS = frozenset({"none", "null", "~", ""})
TRUE_WORDS = frozenset({"true", "yes", "1", "on"})
FALSE_WORDS = frozenset({"false", "no", "0", "off"})
# The first line of the cell papermill (2.x, papermill.translators) injects for `-p`/`-f`/`-y` in a Python kernel.
INJECTED_HEADER = "# Parameters"

Parse = Callable[[str, Any], Any]
P = TypeVar("P", bound="Params")


@dataclasses.dataclass(frozen=True)
class Params:
    """A notebook's parameters: declared fields, read by one loader, checked by `validate`."""

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[P], raw: dict[str, Any], source: str = "parameters") -> P:
        """The parameters `raw` names (the rest at their defaults), read and checked; ParamError naming the culprit."""
        reject_unknown(raw, cls.names(), source)
        hints = typing.get_type_hints(cls)
        fields = {field.name: field for field in dataclasses.fields(cls)}
        values = {}
        for name, value in raw.items():
            parse = fields[name].metadata.get("parse")
            values[name] = parse(name, value) if parse else coerce(name, value, hints[name])
        params = cls(**values)
        params.validate()
        return params

    @classmethod
    def from_namespace(cls: type[P], namespace: dict[str, Any]) -> P:
        """A notebook's parameters: the declared names its namespace binds, whatever later cells bound besides.
        A name papermill injected that is not declared (a misspelt `-p`) is refused."""
        reject_unknown(dict.fromkeys(injected_names(namespace)), cls.names(), "notebook parameters")
        return cls.from_dict({name: namespace[name] for name in cls.names() if name in namespace},
                             source="notebook parameters")

    def validate(self) -> None:
        """ParamError naming the parameter whose value cannot run; the fields' types are already checked."""


def composed(*sections: type) -> type[Params]:
    """The base of a parameter class declared in sections: one dataclass with every section's fields, in order.

    (Inheriting the sections directly would put the last base's fields first.)
    """
    fields = []
    for section in sections:
        hints = typing.get_type_hints(section)
        fields += [(field.name, hints[field.name], dataclasses.field(default=field.default, metadata=field.metadata))
                   for field in dataclasses.fields(section)]
    joined = dataclasses.make_dataclass("_".join(section.__name__ for section in sections), fields,
                                        bases=(Params,), frozen=True)
    joined.__module__ = sections[0].__module__
    return joined


def parsed_by(parse: Parse, default: Any = None) -> Any:
    """A field read by `parse(name, value)` instead of by its type: id ranges, a YAML file's mapping, ..."""
    return dataclasses.field(default=default, metadata={"parse": parse})


def as_given(name: str, value: Any) -> Any:
    """A value of several shapes (a path or a list of rows), taken as it is and checked by `validate`."""
    return value


def reject_unknown(raw: dict[str, Any], known: list[str], source: str) -> None:
    """ParamError naming the first name of `raw` that is not in `known`, with the likeliest meant."""
    for name in raw:
        if name not in known:
            # A known name that extends the unknown one ("micro_batch") beats spelling distance.
            close = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ParamError(f"{source}: unknown parameter {name!r}{hint}; known: {', '.join(known)}")


def injected_names(namespace: dict[str, Any]) -> list[str]:
    """The names papermill's injected-parameters cell assigned, read from the kernel's executed cells (`In`)."""
    names = []
    for source in namespace.get("In") or ():
        if isinstance(source, str) and source.lstrip().partition("\n")[0].strip() == INJECTED_HEADER:
            names += [target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
                      for target in node.targets if isinstance(target, ast.Name)]
    return names


def is_none_word(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in NONE_WORDS


def coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` (possibly a papermill string) as the declared type `hint`, or ParamError naming `name`."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    nullable = type(None) in options
    target = next(option for option in options if option is not type(None))
    if value is None or (nullable and is_none_word(value)):
        if nullable:
            return None
        raise ParamError(f"{name} cannot be None")
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return value.strip().lower() in TRUE_WORDS
        raise ParamError(f"{name} must be true or false, got {value!r}")
    if target in (int, float):
        return _number(name, value, target, nullable)
    if target is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ParamError(f"{name} must be a string, got {value!r}")
    if typing.get_origin(target) is tuple:
        return _coerce_items(name, value, typing.get_args(target)[0])
    if target is dict:
        return _mapping(name, value, nullable)
    raise TypeError(f"unsupported parameter type {hint} for {name}")


def _number(name: str, value: Any, kind: type, nullable: bool) -> int | float:
    # An int parameter takes a whole float (YAML's 5.0); a float parameter takes any number.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or isinstance(value, int) or value.is_integer()):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    what = f"an integer{' or None' if nullable else ''}" if kind is int else "a number"
    raise ParamError(f"{name} must be {what}, got {value!r}")


def _mapping(name: str, value: Any, nullable: bool) -> dict:
    # From YAML (-f) or a notebook dict, or -p as a YAML/JSON string.
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ParamError(f"{name}: not a YAML/JSON mapping ({err})") from None
    if isinstance(value, dict):
        return value
    raise ParamError(f"{name} must be a mapping{' or None' if nullable else ''}, got {value!r}")


def _coerce_items(name: str, value: Any, item: type) -> tuple:
    """A list: from YAML or a notebook, or one string as papermill gives it ("a,b", "[16, 32]", "'a', 'b'")."""
    if isinstance(value, str):
        value = value.strip().strip("[]()").split(",")
    elif item is int and isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if item is str:
        if not isinstance(value, (list, tuple)) or not all(isinstance(entry, str) for entry in value):
            raise ParamError(f"{name} must be a list of names or one comma-separated string, got {value!r}")
        return tuple(entry.strip().strip("'\"") for entry in value if entry.strip())
    if not isinstance(value, (list, tuple)):
        raise ParamError(f"{name} must be a list, got {value!r}")
    return tuple(coerce(name, entry.strip() if isinstance(entry, str) else entry, item) for entry in value
                 if not (isinstance(entry, str) and not entry.strip()))
