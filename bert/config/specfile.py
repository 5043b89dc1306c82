"""Reading the YAML spec of a sweep or a comparison: one reader, one line per fault (the
file missing, a directory, not YAML, a key given twice), then the spec's model (`SpecModel`,
pydantic, strict) with the run configs' error formatter (bert/config/errors.py). Each spec's
reference page is made from its model's field descriptions:

    python -m bert.config.specfile sweep docs/sweep_spec.md            # write it
    python -m bert.config.specfile --check sweep docs/sweep_spec.md    # exit 1 if it differs

tests/test_spec_pages.py fails when a committed page is not what this writes."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, TypeVar, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from bert.config.errors import format_error

__all__ = ["Number", "PAGES", "SpecModel", "held_model", "main", "model_reference", "read_yaml", "validated"]
M = TypeVar("M", bound=BaseModel)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark):
        super().__init__(f"key {key!r} appears twice (lines {first.line + 1} and {again.line + 1})")
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming one key twice is an error: YAML's
    last-one-wins would drop the first silently (a comparison's first arm of two with one name,
    a sweep's first distribution of a parameter). Keys brought in by a merge (`<<: *base`) may
    still be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first is not None:
                    raise _DuplicateKey(key, first, key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:map", _UniqueKeyLoader.construct_yaml_map)


def read_yaml(path: str | os.PathLike, kind: str) -> Any:
    """The YAML document of `path`, the `kind` of file (a "sweep", a "comparison") naming it in
    every error."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{kind} file {path} is a directory; name the YAML file")
    if not path.is_file():
        raise ValueError(f"{kind} file {path} does not exist")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ValueError(f"{kind} file {path}: {e}; give each key once (rename one of the two, "
                         "or remove the one you do not mean)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{kind} file {path} is not valid YAML: {' '.join(str(e).split())}") from None


class SpecModel(BaseModel):
    """A mapping of a sweep's or a comparison's YAML: unknown keys refused, values strictly the
    types written (`true` is not 1, `"5"` is not 5), as in a run config (bert/config/)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _not_text(value: Any) -> Any:
    """A number YAML read as text: PyYAML (YAML 1.1) reads `1e-5` and `1.0e15` as strings, its
    floats needing a decimal point and a signed exponent; the error spells the number it reads."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return value
        mantissa, e, exponent = value.strip().lower().partition("e")
        if not e:
            raise ValueError(f"YAML reads {value} as text, not a number: write it without quotes")
        mantissa = mantissa if "." in mantissa else f"{mantissa}.0"
        exponent = exponent if exponent[:1] in ("+", "-") else f"+{exponent}"
        raise ValueError(f"YAML reads {value} as text, not a number: write it with a decimal point and a signed "
                         f"exponent: {mantissa}e{exponent}")
    return value


# A number of a YAML file: an int stays one (a sweep's int_uniform), text that spells one is named.
Number = Annotated[Union[int, float], BeforeValidator(_not_text)]


def validated(model: type[M], raw: Any, header: str, unknown: Callable[[str], str]) -> M:
    """`raw` (a YAML document) as `model`, every problem in one line after `header` (bert/config/errors.py)."""
    try:
        return model.model_validate(raw, strict=True)
    except ValidationError as e:
        raise ValueError(format_error(e, header, model, unknown)) from None


# ---------------------------------------------------------------------------- reference pages
# The user files with a generated reference page (docs/config.md is bert/config/reference.py's):
# the module whose `reference()` writes it.
PAGES = {"sweep": "bert.sweep.spec", "comparison": "bert.compare.spec"}


def held_model(annotation: Any) -> tuple[Optional[type[BaseModel]], str]:
    """The model a field holds (itself, optional, or the values of a mapping) and the key's tail
    (`.<name>` for a mapping of models); (None, "") for a plain value."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else annotation
    if typing.get_origin(annotation) is dict:
        inner = held_model(typing.get_args(annotation)[1])[0]
        return (inner, ".<name>") if inner is not None else (None, "")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    return None, ""


def _row(key: str, field: FieldInfo, below: bool) -> str:
    """`| key | default | meaning |`: the default as YAML writes it, the choices and limits."""
    value = None if field.is_required() else field.get_default(call_default_factory=True)
    value = value.model_dump(exclude_defaults=True) if isinstance(value, BaseModel) else value
    default = "(required)" if field.is_required() else "none" if value is None else f"`{json.dumps(value)}`"
    notes = [(field.description or "") + (" (below)" if below else "")]
    if typing.get_origin(field.annotation) is Literal and len(typing.get_args(field.annotation)) > 1:
        notes.append("one of " + ", ".join(f"`{c}`" for c in typing.get_args(field.annotation)))
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "at least", "max_length": "at most"}
    notes += [f"{sign} {getattr(m, name)}" for m in field.metadata for name, sign in signs.items()
              if getattr(m, name, None) is not None]
    return f"| `{key}` | {default} | {'; '.join(n for n in notes if n)} |"


def model_reference(model: type[BaseModel], header: str) -> str:
    """The reference page of a user file's `model`: `header`, a table of the file's keys, then one
    table per key that holds a mapping of its own (a sweep's `metric`, each of its `parameters`)."""
    lines, pending = [header], [("", model)]
    while pending:
        key, section = pending.pop(0)
        lines += [f"## `{key}`" if key else "## The file", ""]
        lines += [" ".join((section.__doc__ or "").split()), ""] if key else []
        lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        for name, field in section.model_fields.items():
            inner, tail = held_model(field.annotation)
            dotted = (f"{key}.{name}" if key else name) + tail
            if inner is not None:
                pending.append((dotted, inner))
            lines.append(_row(dotted, field, below=inner is not None))
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """python -m bert.config.specfile [--check] FILE PAGE: write (or check) the reference page of a user FILE."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("file", choices=list(PAGES), help="the user file the page describes")
    parser.add_argument("path", type=Path, help="the Markdown page (docs/sweep_spec.md, docs/compare_spec.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what would be written")
    args = parser.parse_args(argv)
    text = importlib.import_module(PAGES[args.file]).reference()
    if not args.check:
        args.path.write_text(text, encoding="utf-8")
        return 0
    if (args.path.read_text(encoding="utf-8") if args.path.exists() else "") != text:
        print(f"{args.path} is not what {PAGES[args.file]} describes: run python -m bert.config.specfile {args.file} "
              f"{args.path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
