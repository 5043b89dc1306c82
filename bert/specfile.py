"""Reading the YAML spec of a sweep or a comparison: one reader, one line per fault (the
file missing, a directory, not YAML), before the spec's own checks."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_yaml"]


def read_yaml(path: str | os.PathLike, kind: str) -> Any:
    """The YAML document of `path`, the `kind` of file (a "sweep", a "comparison") naming it in
    every error."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{kind} file {path} is a directory; name the YAML file")
    if not path.is_file():
        raise ValueError(f"{kind} file {path} does not exist")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{kind} file {path} is not valid YAML: {' '.join(str(e).split())}") from None
