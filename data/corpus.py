"""Corpus files → shards of documents of sentences; format detection and structure checks.

The formats and their readers are in data/readers.py. Here:

* `plan_file`: a file's format (`auto`: detected from its first 64 KB, `detect_format`)
  and its cut into `Split`s of about `shard_bytes` bytes of text each, every cut at the
  start of a document (found with the format's `DOCUMENT_START` pattern, reading forward
  from the target offset); where no document starts within another `shard_bytes`, a
  line-based format is cut at a line instead, and where no line starts either (a file
  without line breaks), at white space inside the line, so that no split, and no
  worker's memory, grows with the file (a warning says so). The cuts depend only on the
  file and `shard_bytes`, so the shards are the same whatever the number of workers; a
  file no larger than `shard_bytes` is one split.
* `read_split`: the documents of one split, and what the reader saw (`Stats`); errors
  name the file and its line.
* `describe`: the lines that say what was detected and read, and the warnings when the
  structure looks wrong ("sentences" of hundreds of words, no document breaks, ...).
"""

from __future__ import annotations

import glob
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.readers import (DOCUMENT_START, FORMATS, LONG_LINE_CHARS, PIECE_CHARS, Detected, Stats, Where,
                          detect_format, read_text)

__all__ = ["DEFAULT_MAX_LINE_BYTES", "FORMATS", "FilePlan", "Split", "Stats", "describe", "expand_inputs", "parse_size", "plan_file",
           "read_documents", "read_split"]

HEAD_BYTES = 1 << 16  # what format detection reads of a file
DEFAULT_SHARD_BYTES = 16 << 20  # text per shard: 16 MB (a few hundred thousand sentences)
DEFAULT_MAX_LINE_BYTES = 4 << 20  # --max-line-bytes: Wikipedia's longest article as one JSON line is about 1 MB
_SCAN_BYTES = 1 << 20
_ANY_LINE = re.compile(rb"(?m)^")
_AFTER_SPACE = re.compile(rb"(?<=[ \t])(?=[^ \t\r\n])")  # a word's start inside a line (UTF-8 safe: ASCII only)
_CUT_INSIDE = ("sentences", "paragraphs", "wikitext")  # line-based: a document may be cut at a line

# Structure checks (describe): thresholds with what they catch.
_LONG_SHARE = 0.01  # > 1 % of "sentences" over 100 words: paragraphs read as sentences
_SINGLE_DOCUMENT_SENTENCES = 20  # a file that is one document of this many sentences: no breaks found
_ONE_SENTENCE_SHARE = 0.5  # half the documents a single sentence: a blank line after every line
_WRAPPED_SHARE = 0.2  # a fifth of the line breaks inside sentences: hard-wrapped text
_MIN_LINES = 20  # shares are judged over at least this many documents / line pairs
_MIN_FOREIGN_LINES = 3  # WikiText headings or <doc> markup read as text


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


def decode_utf8(raw: bytes, where: Where) -> str:
    """Decode `raw`; an invalid byte is an error naming the file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        column = e.start - line_start + 1
        line = where.line(raw.count(b"\n", 0, e.start))
        raise ValueError(
            f"{where.path}, line {line}, column {column}: not valid UTF-8 "
            f"(byte 0x{raw[e.start]:02x}: {e.reason}); re-encode the file as UTF-8"
        ) from None


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)i?b?\s*", re.IGNORECASE)


def parse_size(text: str, flag: str = "--shard-size") -> int:
    """'16M', '512K', '1G', '4096' → bytes (powers of 1024)."""
    m = _SIZE.fullmatch(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r} is not a size: give bytes or a number with K, M or G (e.g. 16M)")
    return max(1, int(float(m.group(1)) * 1024 ** " kmg".index(m.group(2).lower() or " ")))


@dataclass(frozen=True)
class Split:
    """Bytes [start, end) of a corpus file: whole documents in one format."""

    path: str
    start: int
    end: int
    format: str

    def where(self) -> Where:
        return Where(self.path, self.start)


@dataclass(frozen=True)
class FilePlan:
    path: str
    size: int
    detected: Detected | None  # None: the format was given (--format)
    splits: tuple[Split, ...]
    cuts_inside_documents: int = 0  # no document started within a shard's length of a cut
    cuts_inside_lines: int = 0  # ... nor any line: cut at white space inside one
    long_line: int = 0  # the line number of the first line cut inside (0: none)

    @property
    def format(self) -> str:
        return self.splits[0].format


def plan_file(path: str | Path, fmt: str = "auto", shard_bytes: int = DEFAULT_SHARD_BYTES,
              max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> FilePlan:
    """The format of `path` (detected when `fmt` is 'auto') and its splits; a line longer
    than `max_line_bytes` is refused here, before any worker reads it."""
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}; choose auto or one of {', '.join(FORMATS)}")
    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"input file {path} does not exist")
    size = Path(path).stat().st_size
    long = _first_line_over(path, max_line_bytes) if size > max_line_bytes else None
    if long is not None:
        raise ValueError(f"{path}, line {long:,}: a line of more than {max_line_bytes:,} bytes (--max-line-bytes), "
                         "no sentence or paragraph: put each on a line of its own, or raise --max-line-bytes to "
                         f"read it in pieces of {PIECE_CHARS:,} characters")
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
        while head and not head.decode("utf-8", errors="replace").strip():  # skip leading blank lines
            head = f.read(HEAD_BYTES)
        if not head:
            raise ValueError(f"input file {path} is empty")
        if f.read(1):  # more follows: detect on whole lines
            head = head[: head.rfind(b"\n") + 1] or head
    detected = None
    if fmt == "auto":
        detected = detect_format(head.decode("utf-8", errors="replace"))
        fmt = detected.format
    cuts, inside, in_line, long_line = [0], 0, 0, 0
    if size > shard_bytes:
        with open(path, "rb") as f:
            while cuts[-1] + shard_bytes < size:
                target = cuts[-1] + shard_bytes
                cut = _line_start(f, DOCUMENT_START[fmt], target, target + shard_bytes)
                if cut is None and fmt in _CUT_INSIDE and target + shard_bytes < size:
                    # No document starts within another shard's length: a file without
                    # document breaks (one sentence per line and no blank line, say) is cut at
                    # a line, or one worker would get all of it; inside a line longer than
                    # LONG_LINE_CHARS (a file without line breaks), which its reader splits
                    # anyway (data.readers), at white space.
                    window = target + max(shard_bytes, LONG_LINE_CHARS)
                    cut = _line_start(f, _ANY_LINE, target, window)
                    if cut is not None:
                        inside += 1
                    elif window < size:  # (else the rest of the file is the end of one line)
                        cut = _word_start(f, target, target + shard_bytes)
                        if cut is not None:
                            in_line += 1
                            long_line = long_line or Where(path, cut).line(0)
                elif cut is None:
                    cut = _line_start(f, DOCUMENT_START[fmt], target + shard_bytes, size)
                if cut is None:
                    break
                cuts.append(cut)
    bounds = cuts + [size]
    splits = tuple(Split(path, a, b, fmt) for a, b in zip(bounds, bounds[1:]))
    return FilePlan(path, size, detected, splits, inside, in_line, long_line)


def _first_line_over(path: str, limit: int) -> int | None:
    """The number of the first line of `path` longer than `limit` bytes, or None: one pass
    in blocks of _SCAN_BYTES, so memory does not grow with the line."""
    line, run = 1, 0  # run: the bytes of the current line read so far
    with open(path, "rb") as f:
        while block := f.read(_SCAN_BYTES):
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 0x0A)
            if not len(ends):
                run += len(block)
                if run > limit:
                    return line
                continue
            if run + ends[0] > limit:
                return line
            over = np.flatnonzero(np.diff(ends) - 1 > limit)
            if len(over):
                return line + 1 + int(over[0])
            line, run = line + len(ends), len(block) - int(ends[-1]) - 1
            if run > limit:
                return line
    return None


def _word_start(f, target: int, limit: int) -> int | None:
    """The offset of the first word that starts after white space in [target, limit), or None."""
    f.seek(target - 1)  # one byte before: the white space before a word at `target`
    block = f.read(limit - target + 1)
    m = _AFTER_SPACE.search(block, 1)
    return target - 1 + m.start() if m else None


def _line_start(f, pattern: re.Pattern, target: int, limit: int) -> int | None:
    """The offset of the first line starting in [target, limit) (target > 0) that `pattern`
    matches (a document start), or None. Only whole lines are tested."""
    base = target - 1  # one byte before: `^` must see the newline that ends the line before
    f.seek(base)
    buf, pos = b"", 1
    while True:
        block = f.read(_SCAN_BYTES)
        buf += block
        end = len(buf) if not block else buf.rfind(b"\n") + 1
        if end > pos:
            m = pattern.search(buf, pos, end)
            if m:
                return base + m.start() if base + m.start() < limit else None
            # keep the newline before `end`: the next line's `^` needs it
            buf, base, pos = buf[end - 1:], base + end - 1, 1
        if not block or base + pos >= limit:
            return None


def read_split(split: Split) -> tuple[list[list[str]], Stats]:
    """Documents (lists of sentences) of one split, and what the reader saw."""
    with open(split.path, "rb") as f:
        f.seek(split.start)
        raw = f.read(split.end - split.start)
    where = split.where()
    return read_text(decode_utf8(raw, where), split.format, where)


def read_documents(path: str | Path, format: str = "auto") -> list[list[str]]:
    """Documents (lists of sentences) of one whole corpus file; raises ValueError naming the file."""
    plan = plan_file(path, format, shard_bytes=1 << 62)
    docs, _ = read_split(plan.splits[0])
    if not docs:
        raise ValueError(f"input file {path} holds no sentences (only white space or markup)")
    return docs


# ------------------------------------------------------------------ what was read


_BREAKS = {"sentences": "a blank line ends a document", "paragraphs": "a blank line ends a document",
           "wikitext": "a ' = Title = ' line starts one", "wikiextractor": "a <doc> block is one",
           "jsonl": "a JSON line is one"}


def describe(plans: Sequence[FilePlan], stats: dict[str, Stats] | None = None) -> tuple[list[str], list[str]]:
    """(summary lines, warnings) for a corpus: before reading (`stats` None) what format each
    group of files has and how it is cut into shards; after, what was read per format and
    whatever looks wrong with the structure."""
    groups: dict[str, list[FilePlan]] = defaultdict(list)
    for p in plans:
        groups[p.format].append(p)
    lines: list[str] = []
    warnings: list[str] = []
    for fmt, group in groups.items():
        if stats is None:
            detected = [p for p in group if p.detected is not None]
            how = (f"detected in {_files(len(detected))}; {detected[0].path}: {detected[0].detected.reason}"
                   if detected else "--format")
            lines.append(f"format {fmt} ({how}): {_files(len(group))}, {_size(sum(p.size for p in group))}, "
                         f"{_count(sum(len(p.splits) for p in group), 'shard')}")
            continue
        total = Stats()
        for p in group:
            total.add(stats.get(p.path, Stats()))
        per_doc = total.sentences / max(total.documents, 1)
        per_sentence = total.words / max(total.sentences, 1)
        lines.append(f"read {fmt}: {_files(len(group))}, {_count(total.documents, 'document')}, "
                     f"{_count(total.sentences, 'sentence')} ({per_doc:.1f} per document, {per_sentence:.1f} words per sentence, "
                     f"longest {total.longest:,} words)")
        warnings.extend(_structure_warnings(fmt, group, total, stats))
    return lines, warnings


def _structure_warnings(fmt: str, group: Sequence[FilePlan], total: Stats, stats: dict[str, Stats]) -> Iterable[str]:
    how = f"read as {fmt}" + ("" if all(p.detected for p in group) else ", as --format says")
    if total.sentences and total.long_sentences / total.sentences >= _LONG_SHARE:
        worst = max(group, key=lambda p: stats.get(p.path, Stats()).long_sentences)
        advice = ("are these lines paragraphs? try --format paragraphs or auto" if fmt == "sentences" else
                  "is the text punctuated into sentences? check the format (--format)")
        yield (f"{total.long_sentences:,} of {total.sentences:,} sentences ({total.long_sentences / total.sentences:.1%})"
               f" have more than 100 words (longest {total.longest:,}, most in {worst.path}), {how}: {advice}")
    long = [(p, min(n for n in (stats.get(p.path, Stats()).first_long_line, p.long_line) if n)) for p in group
            if stats.get(p.path, Stats()).first_long_line or p.long_line]
    if long:  # once, naming the first: a file without line breaks holds nothing else
        (first, line), more = long[0], f" (and in {len(long) - 1} more file(s))" if len(long) > 1 else ""
        split = (f"split into sentences of at most {PIECE_CHARS:,} characters at pySBD's sentence ends, else at "
                 "white space" + (", and the shards are cut inside it" if first.cuts_inside_lines else ""))
        unit = "sentence" if fmt == "sentences" else "paragraph"
        yield (f"{first.path}, line {line:,}: a line of more than {LONG_LINE_CHARS:,} characters{more} ({how}): no "
               f"line breaks? {'it is read as a paragraph, not as one sentence: ' if fmt == 'sentences' else 'it is '}"
               f"{split}; put each {unit} on a line of its own")
    single = [p.path for p in group if stats.get(p.path, Stats()).documents == 1
              and stats[p.path].sentences >= _SINGLE_DOCUMENT_SENTENCES]
    cut = [p for p in group if p.cuts_inside_documents]
    if cut:
        more = f" and {len(cut) - 3} more file(s)" if len(cut) > 3 else ""
        yield (f"no document breaks: {', '.join(p.path for p in cut[:3])}{more} had no document start within "
               f"--shard-size of {sum(p.cuts_inside_documents for p in cut)} cut(s), so shards were cut at a line "
               f"inside a document ({how}: {_BREAKS[fmt]})")
    if single:
        more = f" and {len(single) - 3} more file(s)" if len(single) > 3 else ""
        yield (f"no document breaks: {', '.join(single[:3])}{more} {'is' if len(single) == 1 else 'are each'} one "
               f"document ({how}: {_BREAKS[fmt]}); NSP's random next sentences come from other "
               "documents of the same shard")
    if total.documents >= _MIN_LINES and total.one_sentence_documents / total.documents >= _ONE_SENTENCE_SHARE:
        yield (f"{total.one_sentence_documents:,} of {total.documents:,} documents hold a single sentence ({how}): "
               "a blank line after every line? NSP pairs come from documents of several sentences")
    if total.wikitext_lines >= _MIN_FOREIGN_LINES:
        yield (f"{total.wikitext_lines:,} lines look like WikiText (' = Heading = ' lines or ' @-@ ' artefacts) "
               f"but are {how}: use --format wikitext (or auto)")
    if total.doc_markup_lines >= _MIN_FOREIGN_LINES:
        yield f"{total.doc_markup_lines:,} lines are <doc> markup but are {how}: use --format wikiextractor (or auto)"
    if total.line_pairs >= _MIN_LINES and total.wrapped_lines / total.line_pairs >= _WRAPPED_SHARE:
        yield (f"{total.wrapped_lines:,} of {total.line_pairs:,} line breaks ({total.wrapped_lines / total.line_pairs:.0%})"
               f" fall inside a sentence ({how}): hard-wrapped text? put each "
               f"{'sentence' if fmt == 'sentences' else 'paragraph'} on one line")


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def _files(n: int) -> str:
    return _count(n, "file")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"
