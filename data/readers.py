"""Corpus formats: text → documents of sentences, one reader per format.

| format          | a document is                         | a line is                 |
|-----------------|---------------------------------------|---------------------------|
| `wikiextractor` | a `<doc id=.. url=.. title=..>` block | a paragraph (title first) |
| `jsonl`         | a JSON object with a `"text"` string  | (paragraphs split at \\n) |
| `wikitext`      | an article from ` = Title = ` on      | a paragraph or a heading  |
| `sentences`     | lines up to a blank line              | a sentence                |
| `paragraphs`    | lines up to a blank line              | a paragraph               |

`jsonl` is WikiExtractor's `--json` output (also what `datasets`' `to_json` writes);
`wikitext` is WikiText-2/103 (Merity et al. 2016), raw or tokenised: ` = = Section = = `
headings are section breaks inside an article, the Moses-style spacing (` , `, ` 's`,
`( x )`) is closed up, the `@-@ @,@ @.@` artefacts are joined again and `<unk>` becomes
`[UNK]`. Titles and WikiText headings are not sentences and are dropped.

Paragraphs are split into sentences by pySBD (Sadvilkar and Neumann 2020: rule-based,
pure Python, nothing downloaded at run time; it keeps "Dr.", "U.S.", "3.5" and
"(Acme Inc.)" inside their sentences). Its cost grows faster than linearly with the
length of its input, so a paragraph longer than `PIECE_CHARS` characters is split a
window at a time, and a paragraph without a candidate sentence end is one sentence;
a stretch of more than `PIECE_CHARS` characters without a sentence end is cut at white
space, so no sentence is longer.

A line longer than `LONG_LINE_CHARS` (a file without line breaks, say) is no sentence or
paragraph of any corpus: in the `sentences` format it is read as a paragraph (split as
above) instead of as one sentence of millions of words, whose tokens would all be held
at once and then mostly cut away; `Stats.first_long_line` records where the first one
is, for the warning (data.corpus).

Every error is a ValueError naming the file and the line.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, fields

import numpy as np

FORMATS = ("wikiextractor", "jsonl", "wikitext", "sentences", "paragraphs")

# One pattern text for str and bytes (ASCII classes only, so both match the same lines:
# a UTF-8 multi-byte character never holds the byte of '=', '<', '>' or '\n'). The bytes
# forms find where a document starts when a large file is cut into shards (data.corpus).
_DOC_OPEN = r"[ \t]*<doc(?:[ \t][^\n]*)?>[ \t\r]*"
_TITLE_HEADING = r"[ \t]*= [^=\n](?:[^\n]*[^=\n])? =[ \t\r]*"  # ' = Title = ', not ' = = Section = = '
DOCUMENT_START = {  # a line at which a new document starts
    "wikiextractor": re.compile(rb"(?m)^" + _DOC_OPEN.encode() + rb"$"),
    "jsonl": re.compile(rb"(?m)^"),
    "wikitext": re.compile(rb"(?m)^" + _TITLE_HEADING.encode() + rb"$"),
    # a blank line (the reader skips blank lines before a document)
    "sentences": re.compile(rb"(?m)^[ \t\r\f\v]*\n"),
    "paragraphs": re.compile(rb"(?m)^[ \t\r\f\v]*\n"),
}
_DOC_OPEN_LINE = re.compile(_DOC_OPEN)
_DOC_TITLE = re.compile(r'\btitle="(.*)"[ \t]*>')  # greedy: a title may hold '"' or '>'
_HEADING = re.compile(r"[ \t]*((?:= )+)(.*?)((?: =)+)[ \t\r]*")  # WikiText, any level
_TITLE_LINE = re.compile(_TITLE_HEADING)
_ARTEFACT = re.compile(r" @(\S)@ ")  # WikiText's split '-', ',' and '.' inside words and numbers
# A rule boundary: '.', '!' or '?' (and closing quotes/brackets), white space, then a
# capital, digit or opening quote: to guess cheaply whether lines hold one sentence or
# several (format detection).
_RULE_BOUNDARY = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_CANDIDATE = re.compile(r"[.!?…]\S*\s")  # where any splitter could end a sentence
_WHITE_SPACE = re.compile(r"[^\S ]")
PIECE_CHARS = 4000
LONG_LINE_CHARS = 1 << 16  # no sentence or paragraph is this long (Wikipedia's longest are ~10 K)
_LINE_FORMATS = ("wikiextractor", "wikitext", "sentences", "paragraphs")  # a line is a sentence or paragraph
_LONG_SENTENCE_WORDS = 100
_ENDS_SENTENCE = tuple(".!?:;\"'”’)]…")


@dataclass
class Stats:
    """What a reader saw, summed over files and shards; data.corpus turns it into the
    detection summary and the warnings about a structure that looks wrong."""

    documents: int = 0
    sentences: int = 0
    words: int = 0
    longest: int = 0  # words in the longest sentence
    long_sentences: int = 0  # sentences of more than _LONG_SENTENCE_WORDS words
    one_sentence_documents: int = 0
    line_pairs: int = 0  # consecutive lines of a document (sentences / paragraphs formats)
    wrapped_lines: int = 0  # ... of which the first stops mid-sentence and the next goes on in lower case
    wikitext_lines: int = 0  # ' = Heading = ' lines or ' @-@ ' artefacts outside the wikitext format
    doc_markup_lines: int = 0  # '<doc ...>' / '</doc>' lines outside the wikiextractor format
    first_long_line: int = 0  # the file's line number of the first line over LONG_LINE_CHARS (0: none)

    def add(self, other: Stats) -> Stats:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "longest":
                setattr(self, f.name, max(a, b))
            elif f.name == "first_long_line":  # the first of those the parts of a file saw
                setattr(self, f.name, min(a, b) if a and b else a or b)
            else:
                setattr(self, f.name, a + b)
        return self

    def count_documents(self, docs: list[list[str]]) -> None:
        for doc in docs:
            self.documents += 1
            self.sentences += len(doc)
            self.one_sentence_documents += len(doc) == 1
            for sentence in doc:
                n = len(sentence.split())
                self.words += n
                self.longest = max(self.longest, n)
                self.long_sentences += n > _LONG_SENTENCE_WORDS


@dataclass
class Where:
    """Names a line of a file in errors. The text read may start inside the file (a shard
    of a large file starts at byte `start`): its first line's number is counted only when
    an error needs it."""

    path: str
    start: int = 0

    def line(self, index: int) -> int:
        """The file's line number of line `index` (0-based) of the text."""
        before = 0
        if self.start:
            with open(self.path, "rb") as f:
                left = self.start
                while left > 0:
                    block = f.read(min(left, 1 << 24))
                    if not block:
                        break
                    before += block.count(b"\n")
                    left -= len(block)
        return before + index + 1

    def error(self, index: int, what: str) -> ValueError:
        return ValueError(f"{self.path}, line {self.line(index)}: {what}")


def longest_line(raw: bytes) -> tuple[int, int]:
    """(1-based number, length in bytes without its newline) of the longest line of `raw`;
    one pass in numpy, no copy of the text."""
    ends = np.flatnonzero(np.frombuffer(raw, np.uint8) == 0x0A)
    lengths = np.diff(ends, prepend=-1, append=len(raw)) - 1
    k = int(lengths.argmax())
    return k + 1, int(lengths[k])


# ------------------------------------------------------------------ sentences

_segmenter = None


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of one paragraph (pySBD, English rules; see the module docstring)."""
    # White space of any kind becomes a space: pySBD's list rules take '\x1c68' for a number
    # and fail on it, and BERT's normaliser treats every kind as a space anyway.
    paragraph = _WHITE_SPACE.sub(" ", paragraph).strip()
    if not paragraph:
        return []
    out: list[str] = []
    start = 0  # of the text not split yet: windows are read at an offset, never copied off the front
    while len(paragraph) - start > PIECE_CHARS:
        # pySBD on a window; its last sentence may run on past the window, so only the
        # ones before it are taken and the rest is split again (pySBD with clean=False
        # returns the text in pieces, so lengths give the offsets).
        window = paragraph[start:start + PIECE_CHARS]
        segments = _segment(window)
        taken = sum(map(len, segments[:-1]))
        if len(segments) < 2 or "".join(segments) != window:  # one long "sentence": cut at white space
            taken = window.rfind(" ") + 1 or PIECE_CHARS
            segments = [window[:taken]]
        out.extend(s for s in (s.strip() for s in segments[:max(1, len(segments) - 1)]) if s)
        start += taken
    out.extend(s for s in (s.strip() for s in _segment(paragraph[start:])) if s)
    return out


def _segment(text: str) -> list[str]:
    """pySBD's sentences of `text`, in pieces that join to it; one without a candidate
    sentence end ('.', '!' or '?' before white space) is one sentence."""
    global _segmenter
    if not _CANDIDATE.search(text):
        return [text]
    if _segmenter is None:
        import pysbd  # imported on first use: sentence-per-line corpora never need it

        _segmenter = pysbd.Segmenter(language="en", clean=False)
    return _segmenter.segment(text)


def holds_several_sentences(line: str) -> bool:
    """The cheap rule: a sentence end inside the line (format detection)."""
    return _RULE_BOUNDARY.search(line.strip()) is not None


# ------------------------------------------------------------------ WikiText

_CLOSE_UP_BEFORE = re.compile(r" (?=[,.;:!?%)\]}]|'(?:s|re|ve|d|ll|m|t)\b|n't\b)")
_CLOSE_UP_AFTER = re.compile(r"(?<=[(\[{$]) ")
_PLURAL_POSSESSIVE = re.compile(r"(?<=s) '(?= |$)")


def detokenize_wikitext(line: str) -> str:
    """One WikiText paragraph with the tokeniser's spacing undone:
    'a role @-@ playing game , released in 2 @,@ 011 ( in Japan ) . " Yes , " he said'
    → 'a role-playing game, released in 2,011 (in Japan). "Yes," he said'."""
    text = line.strip().replace("<unk>", "[UNK]")
    text = _ARTEFACT.sub(r"\1", text)
    text = _CLOSE_UP_BEFORE.sub("", text)
    text = _CLOSE_UP_AFTER.sub("", text)
    text = _PLURAL_POSSESSIVE.sub("'", text)
    if '"' in text:  # WikiText spaces both sides of '"': pair them up, opening then closing
        parts = text.split('"')
        for k in range(len(parts) - 1 - (len(parts) - 1) % 2):  # quotes that have a partner
            if k % 2 == 0:
                parts[k + 1] = parts[k + 1].lstrip(" ")
            else:
                parts[k] = parts[k].rstrip(" ")
        text = '"'.join(parts)
    return text


def heading_level(line: str) -> int:
    """1 for ' = Title = ', 2 for ' = = Section = = ', ...; 0 for any other line."""
    m = _HEADING.fullmatch(line)
    if not m or not m.group(2).strip() or m.group(2).startswith("=") or m.group(2).endswith("="):
        return 0
    left, right = m.group(1).count("="), m.group(3).count("=")
    return left if left == right else 0


# ------------------------------------------------------------------ readers


def read_text(text: str, fmt: str, where: Where) -> tuple[list[list[str]], Stats]:
    """Documents (lists of sentences) of `text` in format `fmt`, and what was seen."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown corpus format {fmt!r}; choose one of {', '.join(FORMATS)} or auto")
    lines = text.split("\n")
    stats = Stats()
    if fmt in _LINE_FORMATS:
        long = next((i for i, line in enumerate(lines) if len(line) > LONG_LINE_CHARS), None)
        if long is not None:
            stats.first_long_line = where.line(long)
    docs = _READERS[fmt](lines, where, stats)
    docs = [d for d in docs if d]
    stats.count_documents(docs)
    if fmt != "wikitext":
        stats.wikitext_lines += sum(1 for line in lines if heading_level(line) or _ARTEFACT.search(line))
    if fmt != "wikiextractor":
        stats.doc_markup_lines += sum(1 for line in lines if _DOC_OPEN_LINE.fullmatch(line)
                                      or line.strip() == "</doc>")
    return docs, stats


def _line_documents(lines: list[str], stats: Stats, split) -> list[list[str]]:
    """`sentences` and `paragraphs`: lines up to a blank line form a document."""
    docs: list[list[str]] = []
    current: list[str] = []
    previous = ""
    for line in lines:
        line = line.strip()
        if not line:
            if current:
                docs.append(current)
                current = []
            previous = ""
            continue
        if previous:
            stats.line_pairs += 1
            stats.wrapped_lines += not previous.endswith(_ENDS_SENTENCE) and line[0].islower()
        previous = line
        current.extend(split(line))
    if current:
        docs.append(current)
    return docs


def _sentences(lines: list[str], where: Where, stats: Stats) -> list[list[str]]:
    # An over-long line is no sentence: it is read as a paragraph (see the module docstring).
    return _line_documents(lines, stats, lambda line: [line] if len(line) <= LONG_LINE_CHARS else split_sentences(line))


def _paragraphs(lines: list[str], where: Where, stats: Stats) -> list[list[str]]:
    return _line_documents(lines, stats, split_sentences)


def _wikitext(lines: list[str], where: Where, stats: Stats) -> list[list[str]]:
    docs: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if _TITLE_LINE.fullmatch(line):  # ' = Title = ': a new article
            docs.append(current)
            current = []
        elif not heading_level(line):
            current.extend(split_sentences(detokenize_wikitext(line)))
        # ' = = Section = = ' and deeper: a break inside the article, not a sentence
    docs.append(current)
    return docs


def _wikiextractor(lines: list[str], where: Where, stats: Stats) -> list[list[str]]:
    docs: list[list[str]] = []
    current: list[str] | None = None
    title: str | None = None
    first = False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if _DOC_OPEN_LINE.fullmatch(line):
            if current is not None:
                raise where.error(i, "<doc> opens inside an unclosed <doc> block (a '</doc>' line is missing above)")
            current, first = [], True
            m = _DOC_TITLE.search(stripped)
            title = html.unescape(m.group(1)).strip() if m else None
        elif stripped == "</doc>":
            if current is None:
                raise where.error(i, "</doc> without a matching <doc ...> line")
            docs.append(current)
            current = None
        elif current is None:
            if stripped:
                raise where.error(i, "text outside a <doc ...> ... </doc> block (not WikiExtractor output? "
                                     "pass --format)")
        elif stripped:
            paragraph = html.unescape(stripped)  # WikiExtractor writes &amp; &lt; &gt; (its --html-safe)
            if first and paragraph == title:
                first = False  # WikiExtractor repeats the title as the block's first line
                continue
            first = False
            current.extend(split_sentences(paragraph))
    if current is not None:
        raise where.error(len(lines) - 1, "the last <doc> block is not closed (truncated file?)")
    return docs


def _jsonl(lines: list[str], where: Where, stats: Stats) -> list[list[str]]:
    docs: list[list[str]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise where.error(i, f"not a JSON object ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise where.error(i, "not a JSON object (nested too deeply)") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise where.error(i, "a JSON line must be an object with a \"text\" string (WikiExtractor --json)")
        text = record["text"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise where.error(i, f"\"text\" holds an unpaired surrogate ({text[e.start]!r}), not valid "
                                 "Unicode") from None
        docs.append([s for paragraph in html.unescape(text).split("\n") for s in split_sentences(paragraph)])
    return docs


_READERS = {"wikiextractor": _wikiextractor, "jsonl": _jsonl, "wikitext": _wikitext,
            "sentences": _sentences, "paragraphs": _paragraphs}


# ------------------------------------------------------------------ detection


@dataclass(frozen=True)
class Detected:
    format: str
    reason: str  # what in the text decided it, for the summary line


def detect_format(head: str) -> Detected:
    """The format of a file from its first kilobytes (`head`, whole lines)."""
    lines = [line for line in head.split("\n") if line.strip()]
    if not lines:
        raise ValueError("no text to detect a format from")
    if _DOC_OPEN_LINE.fullmatch(lines[0]):
        return Detected("wikiextractor", "<doc ...> blocks (WikiExtractor)")
    objects = sum(1 for line in lines if line.strip().startswith("{") and line.strip().endswith("}"))
    if objects * 2 >= len(lines):
        return Detected("jsonl", f"{objects} of {len(lines)} lines are JSON objects (WikiExtractor --json)")
    titles = sum(1 for line in lines if _TITLE_LINE.fullmatch(line))
    sections = sum(1 for line in lines if heading_level(line) >= 2)
    artefacts = sum(len(_ARTEFACT.findall(line)) for line in lines)
    if titles or (sections and artefacts):
        return Detected("wikitext", f"{titles} ' = Title = ' and {sections} ' = = Section = = ' headings, "
                                    f"{artefacts} ' @-@ '-style artefacts")
    sample = lines[:200]
    several = sum(map(holds_several_sentences, sample)) / len(sample)
    if 0.1 < several < 0.5:  # unclear by the cheap rule: ask the sentence splitter
        several = sum(len(split_sentences(line)) > 1 for line in sample[:100]) / len(sample[:100])
    if several >= 0.3:
        return Detected("paragraphs", f"{several:.0%} of {len(sample)} lines hold several sentences")
    return Detected("sentences", f"{1 - several:.0%} of {len(sample)} lines hold one sentence")
