"""Reading the YAML spec of a sweep or a comparison: one reader, one line per fault (the
file missing, a directory, not YAML, a key given twice), before the spec's own checks."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_yaml"]


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
