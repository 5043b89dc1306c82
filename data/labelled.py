"""Users' labelled files for fine-tuning, read and checked, and turned into model features.

Two shapes of file:

- tables (`read_table`): one example per row, one or two texts and a label (sentence and
  sentence-pair classification, regression), as TSV the way GLUE distributes it, CSV, or
  JSON lines;
- tagged sentences (`read_tagged`): a word and its IOB tag per line, sentences separated by
  blank lines (CoNLL-2003), or JSON lines of `tokens` and `ner_tags` (the HuggingFace
  datasets export).

Every fault of a file is a one-line ValueError naming the file, the line and what to do.
Features are built by the `tokenizers` BertWordPiece pipeline (data.vocab.make_tokenizer),
with its own truncation, so they equal HuggingFace's BertTokenizerFast.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import BertWordPieceTokenizer, Tokenizer

from data.packing import IGNORE_INDEX  # the label of positions the loss skips
from data.readers import longest_line

__all__ = ["MAX_LINE_BYTES", "Table", "Tagged", "read_table", "read_tagged", "label_names", "tag_names", "label_ids",
           "regression_targets", "sentence_features", "token_features", "text_word_features", "IGNORE_INDEX"]

_TABLE_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
_TAGGED_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".conll": "conll"}  # any other suffix: conll
_IOB = re.compile(r"O|[BI]-\S+")
_MAX_CONLL_WORDS = 1000  # CoNLL-2003's longest sentence has 124; past the sequence length words are predicted O
MAX_LINE_BYTES = 1 << 20  # data.max_line_bytes' default: no labelled row or sentence is 1 MiB long


@dataclass(frozen=True)
class Table:
    """The rows of a classification/regression file."""

    path: str
    texts: list[tuple[str, ...]]  # one or two texts per row (the text columns, in the config's order)
    labels: list[str]  # the label column's value per row, as written (stripped)
    lines: list[int]  # the 1-based line number in the file of each row (for messages)


@dataclass(frozen=True)
class Tagged:
    """The sentences of a token-classification file: words and their IOB tags."""

    path: str
    words: list[list[str]]
    tags: list[list[str]]
    lines: list[int]  # the line of each sentence's first word
    tag_lines: list[list[int]]  # the line of each tag (for messages)


def read_table(path: str, text_columns: Sequence[str | int], label_column: str | int, *,
               header: Optional[bool] = None, fmt: str = "auto", max_line_bytes: int = MAX_LINE_BYTES,
               format_option: str = "data.format") -> Table:
    """The texts and labels of a TSV, CSV or JSON-lines file.

    Columns are header names (str) or 0-based indices (int), not both; `header` None means a
    header row exists exactly when columns are names, and a first row that looks like a
    header under indices (`_refuse_header_like`) is refused, not trained on. TSV is read as GLUE
    writes it: quotes are ordinary characters, so a broken row shows as a wrong field count.
    CSV quoting is strict, so an unbalanced quote is an error at its line. Blank lines are
    skipped; a line longer than `max_line_bytes` is refused before it is parsed.
    """
    _not_a_directory(path)
    fmt = _format(path, fmt, _TABLE_FORMATS, option=format_option)
    columns = [*text_columns, label_column]
    if not 1 <= len(text_columns) <= 2:
        raise ValueError(f"{path}: {len(text_columns)} text columns {list(text_columns)} given; give one "
                         "(single sentences) or two (sentence pairs)")
    if any(not isinstance(c, (str, int)) or isinstance(c, bool) for c in columns):
        raise ValueError(f"{path}: columns {columns} must be header names (strings) or 0-based indices (integers)")
    by_name = all(isinstance(c, str) for c in columns)
    if not by_name and any(isinstance(c, str) for c in columns):
        raise ValueError(f"{path}: columns {columns} mix names and indices; give all as header names or all "
                         "as 0-based indices")
    text = _decode(path, max_line_bytes)
    if fmt == "jsonl":
        if not by_name:
            raise ValueError(f"{path}: JSON-lines columns are keys, not indices ({columns}); give the "
                             "text and label columns by their key names")
        rows = _json_rows(path, text, columns)
    else:
        if by_name and header is False:
            raise ValueError(f"{path}: columns {columns} are given by name but header is false; give "
                             "0-based indices, or set header true if the first row names the columns")
        guessed = header is None
        if guessed:
            header = by_name
        rows = _delimited_rows(path, text, fmt, columns, header)
        if guessed and not by_name:
            _refuse_header_like(path, rows)
    if not rows:
        after = " after its header" if fmt != "jsonl" and header and text.strip() else ""
        raise ValueError(f"{path} has no rows: the file is empty{after}; give it one example per line")
    texts, labels, lines = [], [], []
    for line, values in rows:
        label = values[-1].strip()
        if not label:
            raise ValueError(f"{path} line {line}: the label (column {label_column!r}) is empty; give every "
                             "row a label, or remove the row")
        texts.append(tuple(values[:-1]))
        labels.append(label)
        lines.append(line)
    return Table(path=str(path), texts=texts, labels=labels, lines=lines)


def _format(path: str, fmt: str, suffixes: dict[str, str], default: Optional[str] = None,
            option: str = "data.format") -> str:
    """The format `fmt` names, or for "auto" the one the file's suffix implies; `option` is the
    setting that gives `fmt` (data.format, infer.py's --format), which its errors advise."""
    choices = list(dict.fromkeys(suffixes.values()))
    if fmt != "auto":
        if fmt not in choices:
            raise ValueError(f"{path}: format {fmt!r} is not one of {', '.join(choices)} or auto; set "
                             f"{option} to one of them")
        return fmt
    found = suffixes.get(Path(path).suffix.lower(), default)
    if found is None:
        raise ValueError(f"{path}: cannot tell the format from the suffix {Path(path).suffix!r}; set "
                         f"{option} to {', '.join(choices[:-1])} or {choices[-1]}")
    return found


def _not_a_directory(path: str) -> None:
    if Path(path).is_dir():
        raise ValueError(f"{path} is a directory, not a data file; name the file in it")


def _decode(path: str, max_line_bytes: int) -> str:
    """The file's text (a UTF-8 byte-order mark dropped); a missing file, a line longer than
    `max_line_bytes` or bad bytes: one error line, before anything is parsed."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; check the data file's path") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror}); check the data file's path") from None
    line, length = longest_line(raw)
    if length > max_line_bytes:
        raise ValueError(f"{path} line {line}: {length:,} bytes, longer than data.max_line_bytes {max_line_bytes:,}; "
                         "a row (or a CoNLL word) is one line: break the file into lines, or raise "
                         "data.max_line_bytes")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path} line {line}: not valid UTF-8 (byte {raw[e.start]:#04x}); save the file "
                         "as UTF-8") from None


def _delimited_rows(path: str, text: str, fmt: str, columns: list[str | int],
                    header: bool) -> list[tuple[int, list[str]]]:
    """(line, the values of `columns`) per non-blank row after the header."""
    if fmt == "tsv":
        dialect = dict(delimiter="\t", quoting=csv.QUOTE_NONE)
        cause = "a tab inside a text"
    else:
        dialect = dict(delimiter=",", strict=True)
        cause = "an unbalanced quote or an unquoted comma inside a text"
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a field is bounded by the line limit instead
    reader = csv.reader(io.StringIO(text, newline=""), **dialect)
    width = indices = None
    rows, end = [], 0
    while True:
        start = end + 1  # a quoted CSV field may span lines: a row starts after the last one read
        try:
            fields = next(reader, None)
        except csv.Error as e:
            raise ValueError(f"{path} line {start}: broken CSV ({e}); a text with a quote must be quoted "
                             'whole, with its quotes doubled ("say ""hi""")') from None
        end = reader.line_num
        if fields is None:
            return rows
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue  # a blank line
        if width is None:
            width = len(fields)
            indices = _column_indices(path, start, columns, fields if header else None, width)
            if header:
                continue
        if len(fields) != width:
            what = "the header has" if header else "the first row has"
            raise ValueError(f"{path} line {start}: {len(fields)} fields where {what} {width}; the likely "
                             f"cause is {cause}")
        rows.append((start, [fields[i] for i in indices]))


def _refuse_header_like(path: str, rows: list[tuple[int, list[str]]]) -> None:
    """Columns given by index and no `header` set: a first row whose label looks like a
    column name rather than one of the labels below it (a word above numbers, or a value
    found nowhere else above labels that each recur) is refused, not trained on."""
    if len(rows) < 2:
        return
    line, first = rows[0][0], rows[0][1][-1].strip()
    rest = [values[-1].strip() for _, values in rows[1:]]
    counts = Counter(rest)
    if _is_number(first) or first in counts:
        return
    if all(map(_is_number, rest)):
        why = "a word above numbers"
    elif len(rest) >= 4 and min(counts.values()) >= 2:
        why = "found in no other row, while every other label recurs"
    else:
        return
    raise ValueError(f"{path} line {line} looks like a header row (its label {first!r} is {why}); set data.header "
                     "true to skip it, or data.header false to train on it as an example")


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _column_indices(path: str, line: int, columns: list[str | int], names: Optional[list[str]],
                    width: int) -> list[int]:
    """The field index of each column, by header name or by index within `width` fields."""
    if names is not None and all(isinstance(c, str) for c in columns):
        names = [n.strip() for n in names]
        missing = [c for c in columns if c not in names]
        if missing:
            raise ValueError(f"{path} line {line}: no column {missing[0]!r} in the header (it has "
                             f"{', '.join(map(repr, names))}); set the column names to ones of the header")
        return [names.index(c) for c in columns]
    for c in columns:
        if not -width <= c < width:
            raise ValueError(f"{path} line {line}: column index {c} is beyond the row's {width} fields; "
                             f"give indices from 0 to {width - 1}")
    return [c % width for c in columns]


def _json_rows(path: str, text: str, columns: list[str]) -> list[tuple[int, list[str]]]:
    """(line, the values of `columns`) per non-blank line of a JSON-lines file."""
    rows = []
    for line, obj in _json_lines(path, text):
        if not isinstance(obj, dict):
            raise ValueError(f"{path} line {line}: a {type(obj).__name__}, not an object; give one JSON "
                             "object per line")
        values = []
        for k, column in enumerate(columns):
            if column not in obj:
                raise ValueError(f"{path} line {line}: no key {column!r} (it has "
                                 f"{', '.join(map(repr, obj)) or 'none'}); set the columns to keys of the file")
            value = obj[column]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and k == len(columns) - 1:
                value = str(value)  # a numeric label (class number or regression target), as written
            if not isinstance(value, str):
                raise ValueError(f"{path} line {line}: {column!r} is {json.dumps(value)[:40]}, not a string; "
                                 "give texts and labels as strings")
            values.append(value)
        rows.append((line, values))
    return rows


def _json_lines(path: str, text: str) -> Iterable[tuple[int, object]]:
    """(line, parsed value) per non-blank line."""
    for line, raw in enumerate(text.split("\n"), start=1):
        if raw.strip():
            try:
                yield line, json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line}: invalid JSON ({e.msg}, column {e.colno}); give one "
                                 "JSON object per line") from None


def read_tagged(path: str, word_column: int = 0, tag_column: int = -1, *, fmt: str = "auto",
                max_line_bytes: int = MAX_LINE_BYTES, format_option: str = "data.format") -> Tagged:
    """The sentences of a token-classification file, with IOB tags (IOB1 or IOB2).

    CoNLL columns: whitespace-separated fields, one word per line, a blank line between
    sentences, `-DOCSTART-` lines skipped; the word and tag are at `word_column` and
    `tag_column` (negative counts from the end). JSON lines (`.jsonl`/`.json`): an object per
    sentence with lists `tokens` and `ner_tags`, the tags as strings. A line longer than
    `max_line_bytes` is refused before it is parsed.
    """
    _not_a_directory(path)
    fmt = _format(path, fmt, _TAGGED_FORMATS, default="conll", option=format_option)
    text = _decode(path, max_line_bytes)
    sentences = _json_sentences(path, text) if fmt == "jsonl" else \
        _conll_sentences(path, text, word_column, tag_column)
    longest = max(sentences, key=lambda s: len(s[1]), default=None)
    if fmt == "conll" and longest is not None and len(longest[1]) > _MAX_CONLL_WORDS:
        raise ValueError(f"{path} line {longest[0]}: a sentence of {len(longest[1]):,} words (to line "
                         f"{longest[3][-1]}): are the blank lines between sentences missing? CoNLL ends each "
                         "sentence with an empty line; add them")
    if not sentences:
        raise ValueError(f"{path} has no sentences: the file is empty; give it one word and tag per line, "
                         "a blank line between sentences")
    for _, _, tags, tag_lines in sentences:
        for tag, line in zip(tags, tag_lines):
            if not _IOB.fullmatch(tag):
                raise ValueError(f"{path} line {line}: tag {tag!r} is not O, B-TYPE or I-TYPE; the file must "
                                 "have IOB/BIO tags (convert IOBES to IOB2)")
    return Tagged(path=str(path), words=[s[1] for s in sentences], tags=[s[2] for s in sentences],
                  lines=[s[0] for s in sentences], tag_lines=[s[3] for s in sentences])


def _conll_sentences(path: str, text: str, word_column: int,
                     tag_column: int) -> list[tuple[int, list[str], list[str], list[int]]]:
    """(first line, words, tags, line of each tag) per sentence of a CoNLL file."""
    sentences: list[tuple[int, list[str], list[str], list[int]]] = []
    current: Optional[tuple[int, list[str], list[str], list[int]]] = None
    for line, raw in enumerate(text.split("\n"), start=1):
        fields = raw.split()
        if not fields or fields[0] == "-DOCSTART-":
            current = None
            continue
        n = len(fields)
        if not (-n <= word_column < n and -n <= tag_column < n) or word_column % n == tag_column % n:
            raise ValueError(f"{path} line {line}: {n} field(s) {raw.strip()[:40]!r}, too few for the word in "
                             f"column {word_column} and the tag in column {tag_column}; give each word its "
                             "tag, and separate sentences by an empty line")
        if current is None:
            current = (line, [], [], [])
            sentences.append(current)
        current[1].append(fields[word_column])
        current[2].append(fields[tag_column])
        current[3].append(line)
    return sentences


def _json_sentences(path: str, text: str) -> list[tuple[int, list[str], list[str], list[int]]]:
    """(line, words, tags, that line per tag) per non-empty sentence of a JSON-lines file."""
    sentences = []
    for line, obj in _json_lines(path, text):
        words = obj.get("tokens") if isinstance(obj, dict) else None
        tags = obj.get("ner_tags") if isinstance(obj, dict) else None
        if not isinstance(words, list) or not isinstance(tags, list):
            raise ValueError(f"{path} line {line}: not an object with lists 'tokens' and 'ner_tags'; give "
                             "one sentence per line in that shape")
        if any(isinstance(t, int) for t in tags):
            raise ValueError(f"{path} line {line}: ner_tags are numbers; tags must be the tag strings ('B-PER', "
                             "'O', ...): export them with their names")
        if not all(isinstance(x, str) for x in words + tags) or len(words) != len(tags):
            raise ValueError(f"{path} line {line}: {len(words)} tokens and {len(tags)} ner_tags; give one "
                             "tag string per token string")
        if words:
            sentences.append((line, words, tags, [line] * len(tags)))
    return sentences


def label_names(labels: Iterable[str]) -> tuple[str, ...]:
    """The distinct labels in Python string order (as HF's run_glue sorts them): id = position."""
    return tuple(sorted(set(labels)))


def tag_names(tags: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """The distinct tags of all sentences, sorted (as HF's run_ner sorts them)."""
    return tuple(sorted({t for sentence in tags for t in sentence}))


def label_ids(table_labels: list[str], names: tuple[str, ...], path: str, lines: list[int], *,
              what: str = "label") -> np.ndarray:
    """(N,) int64: each label's position in `names` (the training file's labels)."""
    index = {name: i for i, name in enumerate(names)}
    ids = np.empty(len(table_labels), np.int64)
    for i, (label, line) in enumerate(zip(table_labels, lines)):
        if label not in index:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ValueError(f"{path} line {line}: {what} {label!r} is not among the training file's {what}s "
                             f"[{shown}]: the model cannot predict it; fix the {what}, or add examples of it "
                             "to the training file")
        ids[i] = index[label]
    return ids


def regression_targets(labels: list[str], path: str, lines: list[int]) -> np.ndarray:
    """(N,) float32: each label as a finite number."""
    targets = np.empty(len(labels), np.float32)
    for i, (label, line) in enumerate(zip(labels, lines)):
        try:
            value = float(label)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"{path} line {line}: regression target {label!r} is not a finite number; give "
                             "a number (or set the task to classification)")
        targets[i] = value
    return targets


def _encode(tokenizer: BertWordPieceTokenizer, inputs: list, max_length: int, least: int,
            pretokenized: bool = False) -> tuple[list, dict[str, np.ndarray]]:
    """The encodings of `inputs` truncated (longest first) and padded to `max_length`, and their
    `input_ids`, `segment_ids`, `input_mask` (N, S). A copy of the tokenizer's pipeline does
    the work, so the caller's tokenizer keeps its own truncation and padding."""
    if max_length < least:
        raise ValueError(f"sequence length {max_length} is too short: the special tokens alone take {least}; "
                         "set a longer sequence length")
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.enable_truncation(max_length, strategy="longest_first")
    copy.enable_padding(length=max_length, pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
    encodings = copy.encode_batch(inputs, is_pretokenized=pretokenized)
    shape = (len(inputs), max_length)  # (N, S)
    return encodings, {
        "input_ids": np.array([e.ids for e in encodings], np.int64).reshape(shape),
        "segment_ids": np.array([e.type_ids for e in encodings], np.int64).reshape(shape),
        "input_mask": np.array([e.attention_mask for e in encodings], np.int64).reshape(shape),
    }


def sentence_features(tokenizer: BertWordPieceTokenizer, texts: list[tuple[str, ...]],
                      max_length: int) -> dict[str, np.ndarray]:
    """BERT inputs for one or two texts per row: `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]`.

    `input_ids`, `segment_ids` (0 up to the first [SEP], 1 after), `input_mask`: (N, S) int64,
    zero-padded to S = max_length. Longer rows are cut as HF's truncation="longest_first"
    cuts them (the tokenizers library's own truncation); `truncated` (N,) bool marks them.
    """
    least = 3 if any(len(t) == 2 for t in texts) else 2  # the special tokens
    encodings, features = _encode(tokenizer, [t[0] if len(t) == 1 else (t[0], t[1]) for t in texts],
                                  max_length, least)
    features["truncated"] = np.array([bool(e.overflowing) for e in encodings], bool).reshape(len(texts))
    return features


def token_features(tokenizer: BertWordPieceTokenizer, words: list[list[str]],
                   tag_ids: Optional[list[list[int]]], max_length: int) -> dict[str, np.ndarray]:
    """BERT inputs for pre-split sentences, `[CLS] w1 w2 ... [SEP]`, truncated to max_length.

    `input_ids`, `segment_ids` (zeros), `input_mask`: (N, S) int64. `labels` (N, S), only when
    `tag_ids` is given: the word's tag id at the first sub-word of each word, IGNORE_INDEX at
    every other position ([CLS], [SEP], further sub-words, padding), as HF's run_ner labels
    them. `word_index` (N, S): the word number at each first sub-word, -1 elsewhere, to map
    predictions back to words. `words_kept` (N,): how many words fit (a word counts when its
    first sub-word does). A word that tokenizes to nothing (a control character, say) has no
    position: `word_index` never names it, and it is to be scored as predicted `O`.
    """
    encodings, features = _encode(tokenizer, words, max_length, 2, pretokenized=True)
    word_index = _first_sub_words(encodings, max_length)
    kept = np.array([word_index[row].max() + 1 if e.overflowing else len(words[row]) for row, e in enumerate(encodings)],
                    np.int64)
    features.update(word_index=word_index, words_kept=kept)
    if tag_ids is not None:
        assert [len(t) for t in tag_ids] == [len(w) for w in words], "one tag id per word"
        labels = np.full(word_index.shape, IGNORE_INDEX, np.int64)  # (N, S)
        for row, ids in enumerate(tag_ids):
            first = word_index[row] >= 0
            labels[row, first] = np.asarray(ids, np.int64)[word_index[row, first]]
        features["labels"] = labels
    return features


def text_word_features(tokenizer: BertWordPieceTokenizer, texts: list[str],
                       max_length: int) -> tuple[dict[str, np.ndarray], list[list[tuple[int, int]]]]:
    """token_features for raw texts (serving): the words are the tokenizer's own
    pre-tokenization (whitespace, and each punctuation mark a word of its own, as CoNLL splits
    them). Returns the arrays (`input_ids`, `segment_ids`, `input_mask`, `word_index`) and each
    text's words as character spans of the text, as far as they fit in max_length."""
    encodings, features = _encode(tokenizer, list(texts), max_length, 2)
    spans: list[list[tuple[int, int]]] = []
    for encoding in encodings:
        words: dict[int, tuple[int, int]] = {}  # in the order of the words
        for word, (start, end) in zip(encoding.word_ids, encoding.offsets):
            if word is not None:
                words[word] = (words.get(word, (start, end))[0], end)
        spans.append(list(words.values()))
    features["word_index"] = _first_sub_words(encodings, max_length)
    return features, spans


def _first_sub_words(encodings: list, max_length: int) -> np.ndarray:
    """(N, S): the word's number at the first sub-word of each word, -1 elsewhere."""
    word_index = np.full((len(encodings), max_length), -1, np.int64)
    for row, encoding in enumerate(encodings):
        previous = None
        for position, word in enumerate(encoding.word_ids):
            if word is not None and word != previous:
                word_index[row, position] = word
            previous = word
    return word_index
