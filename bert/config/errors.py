"""One line for an invalid user file (a run config, a sweep's or a comparison's YAML): every
problem of a pydantic ValidationError by the dotted key it names, with the value given and what
to do. STYLE.md 30: every user file is a model of one validation library with one kind of error;
each file adds only its own fixes (the config's: version-1 names, the optimizer's rules)."""
from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, Callable, Optional, Union

from pydantic import BaseModel, Tag, ValidationError

__all__ = ["field_key", "format_error", "tagged_members"]


def _inner(annotation: Any) -> Any:
    """`X` of `Optional[X]`; any other annotation as it is (a union of several stays one)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation


def tagged_members(annotation: Any) -> dict[str, Any]:
    """The members of a tagged union by tag (`Annotated[X, Tag("x")] | ...`: the optimizer
    section's rules); {} for other annotations."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    members = {}
    for member in typing.get_args(annotation) if typing.get_origin(annotation) is Union else ():
        if typing.get_origin(member) is Annotated:
            inner, *marks = typing.get_args(member)
            members.update({mark.tag: inner for mark in marks if isinstance(mark, Tag)})
    return members


def field_key(model: type[BaseModel], loc: tuple) -> str:
    """The dotted key of an error location in `model`: fields, list indices and mapping keys
    (a sweep's `parameters.optimizer.learning_rate`), without pydantic's union-member tags."""
    return _walk(model, loc)[0]


def _walk(model: type[BaseModel], loc: tuple) -> tuple[str, Any]:
    """field_key, and the annotation of the value at the key (None where it is not known)."""
    annotation: Any = model
    parts = []
    for part in loc:
        inner = _inner(annotation)
        fields = getattr(inner, "model_fields", None)
        origin = typing.get_origin(inner)
        if part == "[key]":  # the mapping key itself: the key before it names it
            return ".".join(parts), None
        if fields is not None:
            parts.append(str(part))
            if part not in fields:  # an unknown key
                return ".".join(parts), None
            annotation = fields[part].annotation
        elif origin is dict:
            parts.append(str(part))
            annotation = typing.get_args(inner)[1]
        elif isinstance(part, int):  # an index into a list
            parts.append(str(part))
            args = typing.get_args(inner)
            annotation = args[0] if origin in (list, tuple) and args else None
        elif part in tagged_members(inner):  # the tag of a tagged union's member: its fields go on
            annotation = tagged_members(inner)[part]
        else:  # the tag of a union member
            return ".".join(parts), None
    return ".".join(parts), annotation


def _a_mapping(annotation: Any) -> str:
    """What a key that holds a model takes: `should be a mapping with config (and overrides), or null`."""
    model = _inner(annotation)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "should be a mapping"
    required = [k for k, f in model.model_fields.items() if f.is_required()]
    others = [k for k in model.model_fields if k not in required]
    keys = (", ".join(required) + (f" (and {', '.join(others)})" if others else "")) if required else ", ".join(others)
    return f"should be a mapping with {keys}" + (", or null for none" if model is not annotation else "")


def format_error(error: ValidationError, header: str, model: type[BaseModel], unknown: Callable[[str], str],
                 explain: Optional[Callable[[dict, str, str], Optional[tuple[str, str]]]] = None) -> str:
    """`header: problem; problem`, each problem by dotted key with the value given (JSON literals,
    quoted strings). `unknown(key)`: what to do about the unknown dotted `key`; `explain(error, key,
    value)`: a file's own (key, line) for one of pydantic's errors (the run config's optimizer
    rules), None for the common line."""
    problems: dict[str, list[str]] = {}
    for e in error.errors():
        key, annotation = _walk(model, e["loc"])
        given = e.get("input")
        value = repr(given) if isinstance(given, str) else json.dumps(given, default=str)  # true, not True
        if not key:
            what = e["msg"].removeprefix("Value error, ")
        elif explain is not None and (own := explain(e, key, value)) is not None:
            key, what = own
        elif e["type"] == "extra_forbidden":
            what = f"unknown key {key!r} (value {value}): {unknown(key)}"
        elif e["type"] == "missing":
            what = f"missing key {key!r}"
        else:
            shown = "" if isinstance(given, dict) or e["loc"][-1:] == ("[key]",) else f" = {value}"  # a key: named
            # Python mode names the model's class ("a valid dictionary or instance of ArmSpec"): say its keys.
            msg = _a_mapping(annotation) if e["type"] == "model_type" and "instance of" in e["msg"] else e["msg"]
            what = f"{key}{shown}: {msg.removeprefix('Value error, ')}"
        problems.setdefault(key, []).append(what)
    # A union reports one error per member: join them as alternatives.
    merged = [whats[0] if len(whats) == 1 else whats[0] + " or " + ", ".join(w.split(": ", 1)[-1] for w in whats[1:])
              for whats in problems.values()]
    return f"{header}: " + "; ".join(merged)
