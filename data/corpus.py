"""Reading raw text corpora into documents of sentences.

Two input formats are recognised, per file:

* plain text: one sentence per line, blank lines between documents (the format of
  google-research/bert's `create_pretraining_data.py`);
* WikiExtractor output: `<doc id=... title=...>` ... `</doc>` blocks. Inside a block
  the first line is the article title (dropped) and each further line is a
  paragraph, which is split into sentences by a small punctuation rule (a sentence
  ends at `.`, `!` or `?` followed by white space and an upper-case letter, digit or
  quote). That is cruder than a trained splitter (NLTK punkt, as NVIDIA's pipeline
  uses) but needs nothing downloaded; NSP only needs plausible segment boundaries.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Sequence
from pathlib import Path

_DOC_OPEN = re.compile(r"^<doc(\s[^>]*)?>\s*$")
_DOC_CLOSE = "</doc>"
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def expand_inputs(patterns: Sequence[str | Path]) -> list[Path]:
    """Files named by `patterns` (paths or globs), sorted and de-duplicated.

    A pattern that matches nothing is an error naming it, so a typo never silently
    shrinks the corpus.
    """
    files: list[Path] = []
    for pattern in patterns:
        pattern = str(pattern)
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            matches = [m for m in matches if Path(m).is_file()]
            if not matches:
                raise ValueError(f"input pattern {pattern!r} matches no file")
            files.extend(Path(m) for m in matches)
        else:
            path = Path(pattern)
            if not path.exists():
                raise ValueError(f"input file {path} does not exist")
            if not path.is_file():
                raise ValueError(f"input {path} is not a regular file")
            files.append(path)
    if not files:
        raise ValueError("no input files given")
    unique = sorted(set(files), key=lambda p: str(p))
    return unique


def decode_utf8(raw: bytes, path: Path) -> str:
    """Decode `raw`; an invalid byte is an error naming the file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - line_start + 1
        raise ValueError(
            f"{path}, line {line}, column {column}: not valid UTF-8 "
            f"(byte 0x{raw[e.start]:02x}: {e.reason}); re-encode the file as UTF-8"
        ) from None


def split_sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def read_documents(path: str | Path) -> list[list[str]]:
    """Documents (lists of sentences) of one corpus file; raises ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file {path} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"input file {path} is empty")
    text = decode_utf8(raw, path)
    lines = text.splitlines()
    if any(_DOC_OPEN.match(line) for line in lines[:1000]) or text.lstrip().startswith("<doc"):
        docs = _wikiextractor_documents(lines, path)
    else:
        docs = _plain_documents(lines)
    if not docs:
        raise ValueError(f"input file {path} holds no sentences (only white space or markup)")
    return docs


def _plain_documents(lines: list[str]) -> list[list[str]]:
    docs: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            docs.append(current)
            current = []
    if current:
        docs.append(current)
    return docs


def _wikiextractor_documents(lines: list[str], path: Path) -> list[list[str]]:
    docs: list[list[str]] = []
    current: list[str] | None = None
    title_pending = False
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip()
        if _DOC_OPEN.match(stripped):
            if current is not None:
                raise ValueError(f"{path}, line {lineno}: <doc> opens inside an unclosed <doc> block")
            current, title_pending = [], True
        elif stripped == _DOC_CLOSE:
            if current is None:
                raise ValueError(f"{path}, line {lineno}: </doc> without a matching <doc>")
            if current:
                docs.append(current)
            current = None
        elif current is None:
            if stripped:
                raise ValueError(f"{path}, line {lineno}: text outside a <doc> ... </doc> block")
        elif stripped:
            if title_pending:
                title_pending = False  # WikiExtractor repeats the title as the first line
                continue
            current.extend(split_sentences(stripped))
    if current is not None:
        raise ValueError(f"{path}: the last <doc> block is not closed (truncated file?)")
    return docs
