"""data.labelled: users' labelled files read and checked, and their features equal to
HuggingFace's BertTokenizerFast (pairs truncated longest-first; first sub-word labels)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import BertTokenizerFast

from data.labelled import (
    IGNORE_INDEX, Table, label_ids, label_names, read_table, read_tagged, regression_targets,
    sentence_features, tag_names, token_features,
)
from data.vocab import SPECIAL_TOKENS, make_tokenizer

WORDS = ("the a cat dog sat ran on mat , . \" ' un ##believ ##able ##s ##ly eu rejects german call to boycott "
         "british lamb peter black ##burn").split()

SENTENCES = ["The cat sat on the mat.", "unbelievables", "a", "",
             "the cat sat on the mat , the dog ran on the mat , unbelievably"]
PAIRS = [("the cat", "a dog ran"),  # fits
         ("the cat", "unbelievables dog sat on the mat ."),  # the second member long
         ("unbelievably the dog ran on the mat .", "a cat"),  # the first member long
         ("the cat sat on the mat , the dog ran", "unbelievables black ##burn , the lamb sat")]  # both long


@pytest.fixture
def vocab_file(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join((*SPECIAL_TOKENS, *WORDS)) + "\n")
    return path


def write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def one_line_error(call, *fragments: str) -> str:
    """The ValueError `call` raises: one line, holding every fragment."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


@pytest.mark.parametrize("texts", [[(s,) for s in SENTENCES], PAIRS], ids=["single", "pairs"])
@pytest.mark.parametrize("length", [6, 9, 12, 32])
def test_sentence_features_match_hf(vocab_file, texts, length):
    tokenizer = make_tokenizer(vocab_file, lower_case=True)
    hf = BertTokenizerFast(vocab=str(vocab_file), do_lower_case=True)
    a, b = [t[0] for t in texts], [t[1] for t in texts] if len(texts[0]) == 2 else None
    expected = hf(a, b, truncation="longest_first", max_length=length, padding="max_length")
    got = sentence_features(tokenizer, texts, length)
    np.testing.assert_array_equal(got["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(got["segment_ids"], expected["token_type_ids"])
    np.testing.assert_array_equal(got["input_mask"], expected["attention_mask"])
    assert all(v.dtype == np.int64 and v.shape == (len(texts), length) for k, v in got.items() if k != "truncated")
    whole = [len(ids) for ids in hf(a, b)["input_ids"]]
    np.testing.assert_array_equal(got["truncated"], [n > length for n in whole])
    assert tokenizer.truncation is None and tokenizer.padding is None  # the caller's tokenizer untouched


def reference_token_labels(hf, words, tags, length):
    """HF run_ner's labelling (label_all_tokens False): the tag at each word's first sub-word."""
    encoded = hf(words, is_split_into_words=True, truncation=True, max_length=length, padding="max_length")
    labels, word_index = [], []
    for row in range(len(words)):
        ids = encoded.word_ids(row)
        first = [w is not None and (i == 0 or ids[i - 1] != w) for i, w in enumerate(ids)]
        labels.append([tags[row][w] if f else IGNORE_INDEX for w, f in zip(ids, first)])
        word_index.append([w if f else -1 for w, f in zip(ids, first)])
    return encoded, labels, word_index


@pytest.mark.parametrize("length", [5, 8, 40])
def test_token_features_label_first_sub_words(vocab_file, length):
    tokenizer = make_tokenizer(vocab_file)
    hf = BertTokenizerFast(vocab=str(vocab_file), do_lower_case=True)
    words = [["EU", "rejects", "German", "call", "."], ["Peter", "Blackburn"], ["the", "unbelievables", "cat", "sat"],
             ["a", "\x00", "dog"]]  # "\x00" tokenizes to nothing: it has no position
    tags = [[1, 0, 2, 0, 0], [3, 4], [0, 2, 0, 0], [0, 1, 0]]
    encoded, labels, word_index = reference_token_labels(hf, words, tags, length)
    got = token_features(tokenizer, words, tags, length)
    np.testing.assert_array_equal(got["input_ids"], encoded["input_ids"])
    np.testing.assert_array_equal(got["input_mask"], encoded["attention_mask"])
    np.testing.assert_array_equal(got["segment_ids"], 0)
    np.testing.assert_array_equal(got["labels"], labels)
    np.testing.assert_array_equal(got["word_index"], word_index)
    kept = {5: [3, 2, 2, 3], 8: [5, 2, 3, 3], 40: [5, 2, 4, 3]}[length]  # [CLS] the un ##believ [SEP]: 2 words
    np.testing.assert_array_equal(got["words_kept"], kept)
    assert "labels" not in token_features(tokenizer, words, None, length)


def test_read_table_glue_shapes(tmp_path):
    sst2 = write(tmp_path, "sst2.tsv", '\ufeffsentence\tlabel\r\nit \'s a "charming journey . \t1\r\n\r\n'
                                       'unflinchingly bleak\t0\r\n')
    table = read_table(sst2, ["sentence"], "label")
    assert table == Table(sst2, [('it \'s a "charming journey . ',), ("unflinchingly bleak",)], ["1", "0"], [2, 4])
    cola = write(tmp_path, "cola.tsv", "gj04\t1\t\tOur friends won't buy this.\ngj04\t0\t*\tThey drank the pub.\n")
    table = read_table(cola, [3], 1)
    assert (table.texts, table.labels, table.lines) == ([("Our friends won't buy this.",),
                                                         ("They drank the pub.",)], ["1", "0"], [1, 2])
    assert read_table(cola, [3], 1, header=True).lines == [2]
    mrpc = write(tmp_path, "mrpc.tsv", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                                       "1\t702876\t702977\tAmrozi accused his brother .\tReferring to him .\n")
    table = read_table(mrpc, ["#1 String", "#2 String"], "Quality")
    assert (table.texts, table.labels) == ([("Amrozi accused his brother .", "Referring to him .")], ["1"])


def test_read_table_csv_and_json_lines(tmp_path):
    csv_file = write(tmp_path, "a.csv", 'text,label\n"Hello, world",pos\n"She said ""hi""\nthen left", neg \n')
    table = read_table(csv_file, ["text"], "label")
    assert (table.texts, table.labels, table.lines) == ([("Hello, world",), ('She said "hi"\nthen left',)],
                                                        ["pos", "neg"], [2, 3])
    jsonl = write(tmp_path, "a.data", '{"s1": "a", "s2": "b", "score": 3.5}\n\n{"s1": "c", "s2": "d", "score": 1}\n')
    table = read_table(jsonl, ["s1", "s2"], "score", fmt="jsonl")
    assert (table.texts, table.labels, table.lines) == ([("a", "b"), ("c", "d")], ["3.5", "1"], [1, 3])


SST2 = "sentence\tlabel\nfine\t1\n"


@pytest.mark.parametrize("name, content, columns, label, options, fragments", [
    ("a.tsv", SST2, ["text"], "label", {}, ["line 1", "no column 'text'", "'sentence', 'label'"]),
    ("a.tsv", SST2 + "a\ttab\t0\n", ["sentence"], "label", {}, ["line 3", "3 fields", "header has 2", "tab"]),
    ("a.tsv", "x\t1\ny\n", [0], 1, {}, ["line 2", "1 fields", "first row has 2"]),
    ("a.csv", 'text,label\n"open quote,1\nnext,0\n', ["text"], "label", {}, ["line 2", "quote"]),
    ("a.csv", 'text,label\nok,1\n"He said "hi"",0\n', ["text"], "label", {}, ["line 3", "quote"]),
    ("a.tsv", "", ["sentence"], "label", {}, ["has no rows"]),
    ("a.tsv", "sentence\tlabel\n\n", ["sentence"], "label", {}, ["has no rows", "header"]),
    ("a.tsv", SST2 + "empty\t \n", ["sentence"], "label", {}, ["line 3", "label", "empty"]),
    ("a.tsv", SST2.encode() + b"caf\xe9\t1\n", ["sentence"], "label", {}, ["line 3", "UTF-8"]),
    ("a.txt", SST2, ["sentence"], "label", {}, ["'.txt'", "data.format", "tsv, csv or jsonl"]),
    ("a.tsv", SST2, [5], 0, {}, ["line 1", "index 5", "2 fields"]),
    ("a.tsv", SST2, ["sentence"], 1, {}, ["mix"]),
    ("a.tsv", SST2, ["sentence"], "label", {"header": False}, ["by name", "header"]),
    ("a.tsv", SST2, ["sentence", "sentence", "sentence"], "label", {}, ["3 text columns", "one", "two"]),
    ("a.jsonl", '{"sentence": "a", "label": 1}\n', [0], 1, {}, ["keys"]),
    ("a.jsonl", '{"text": "a", "label": 1}\n', ["sentence"], "label", {}, ["line 1", "no key 'sentence'", "'text'"]),
    ("a.jsonl", '{"sentence": "a", "label": 1}\n{"sentence": "a"\n', ["sentence"], "label", {}, ["line 2", "JSON"]),
])
def test_read_table_refuses(tmp_path, name, content, columns, label, options, fragments):
    path = write(tmp_path, name, content)
    one_line_error(lambda: read_table(path, columns, label, **options), path, *fragments)


HEADED = "sentence\tsentiment\na\tpos\nb\tneg\nc\tpos\nd\tneg\n"


@pytest.mark.parametrize("content, why", [
    (SST2 + "bad\t0\n", "a word above numbers"),
    (HEADED, "found in no other row, while every other label recurs"),
])
def test_a_header_row_under_column_indices_is_refused_or_read_as_told(tmp_path, content, why):
    path = write(tmp_path, "a.tsv", content)
    one_line_error(lambda: read_table(path, [0], 1), path, "line 1 looks like a header row", why,
                   "set data.header true to skip it")
    rows = content.count("\n")
    assert read_table(path, [0], 1, header=True).lines == list(range(2, rows + 1))
    assert read_table(path, [0], 1, header=False).labels[0] == content.split("\t")[1].split("\n")[0]


@pytest.mark.parametrize("content", [
    "a\tx\nb\ty\nc\ty\n",  # too few rows to tell
    "a\tw\nb\ty\nc\tz\nd\ty\ne\tz\nf\tv\n",  # another label is rare too
    "a\t5\nb\t1\nc\t2\n",  # numbers all the way down
    "a\tpos\nb\tpos\nc\tneg\nd\tneg\n",  # its label recurs below
])
def test_a_first_row_like_the_others_is_an_example(tmp_path, content):
    path = write(tmp_path, "a.tsv", content)
    assert read_table(path, [0], 1).lines[0] == 1


def test_a_line_over_the_limit_is_refused_before_parsing(tmp_path):
    """8 MB on one line (a file saved without line breaks) is one error line at once, in every
    labelled reader, with the limit named; below the limit the same file reads."""
    text = "word " * ((8 << 20) // 5)
    table = write(tmp_path, "big.jsonl", '{"sentence": "ok", "label": "1"}\n{"sentence": "' + text + '", "label": "0"}\n')
    conll = write(tmp_path, "big.conll", "EU B-ORG\n\n" + text + "O\n")
    one_line_error(lambda: read_table(table, ["sentence"], "label"), table, "line 2", "longer than "
                   "data.max_line_bytes 1,048,576", "break the file into lines")
    one_line_error(lambda: read_tagged(conll), conll, "line 3", "data.max_line_bytes")
    assert read_table(table, ["sentence"], "label", max_line_bytes=16 << 20).lines == [1, 2]
    # Below the limit, a long TSV field is a field (csv's own 128 KB field limit called it broken quoting).
    tsv = write(tmp_path, "long.tsv", "sentence\tlabel\nok\t1\n" + "word " * 60_000 + "\t0\n")
    assert len(read_table(tsv, ["sentence"], "label").texts[1][0]) == 300_000


def test_labels_ids_and_targets():
    assert label_names(["b", "a", "B", "10", "2", "a"]) == ("10", "2", "B", "a", "b")
    assert tag_names([["O", "B-PER"], ["I-PER", "O", "B-LOC"]]) == ("B-LOC", "B-PER", "I-PER", "O")
    ids = label_ids(["neg", "pos", "neg"], ("neg", "pos"), "dev.tsv", [2, 3, 4])
    assert ids.dtype == np.int64 and ids.tolist() == [0, 1, 0]
    one_line_error(lambda: label_ids(["neg", "meh"], ("neg", "pos"), "dev.tsv", [2, 5]),
                   "dev.tsv line 5: label 'meh' is not among the training file's labels [neg, pos]")
    targets = regression_targets(["0.5", "3", "-1e2"], "train.tsv", [2, 3, 4])
    assert targets.dtype == np.float32 and targets.tolist() == [0.5, 3.0, -100.0]
    for bad in ("high", "nan", "inf"):
        one_line_error(lambda: regression_targets(["1", bad], "train.tsv", [2, 7]), "train.tsv line 7", repr(bad))


CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP I-MISC
call NN I-NP O


Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
-DOCSTART- -X- -X- O
Lamb NN B-NP O"""


def test_read_tagged_conll_and_json_lines(tmp_path):
    tagged = read_tagged(write(tmp_path, "train.txt", CONLL))
    assert tagged.words == [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["Lamb"]]
    assert tagged.tags == [["B-ORG", "O", "I-MISC", "O"], ["B-PER", "I-PER"], ["O"]]
    assert tagged.lines == [3, 9, 12]
    assert tagged.tag_lines == [[3, 4, 5, 6], [9, 10], [12]]  # a dev tag training lacks is named at its own line
    assert read_tagged(write(tmp_path, "chunk.conll", CONLL), word_column=0, tag_column=2).tags[2] == ["B-NP"]
    jsonl = write(tmp_path, "train.jsonl", '{"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG", "O"]}\n'
                                           '{"tokens": [], "ner_tags": []}\n{"tokens": ["x"], "ner_tags": ["O"]}\n')
    tagged = read_tagged(jsonl)
    assert (tagged.words, tagged.tags, tagged.lines) == ([["EU", "rejects"], ["x"]], [["B-ORG", "O"], ["O"]], [1, 3])


@pytest.mark.parametrize("name, content, fragments", [
    ("a.txt", "EU B-ORG\nLondon S-LOC\n", ["line 2", "'S-LOC'", "IOB", "convert IOBES to IOB2"]),
    ("a.txt", "EU B-ORG\n\nPeter PER\n", ["line 3", "'PER'", "IOB"]),
    ("a.txt", "EU b-org\n", ["line 1", "'b-org'"]),
    ("a.txt", "EU B-ORG\nLondon\n", ["line 2", "1 field", "too few"]),
    ("a.txt", "-DOCSTART- O\n\n", ["has no sentences"]),
    ("a.jsonl", '{"tokens": ["EU"], "ner_tags": [3]}\n', ["line 1", "tag strings"]),
    ("a.jsonl", '{"tokens": ["EU", "x"], "ner_tags": ["O"]}\n', ["line 1", "2 tokens and 1 ner_tags"]),
    ("a.jsonl", '{"words": ["EU"]}\n', ["line 1", "'tokens'"]),
    ("a.conll", "EU B-ORG\n\n" + "w O\n" * 1001, ["line 3", "a sentence of 1,001 words (to line 1003)",
                                                  "blank lines between sentences missing"]),
])
def test_read_tagged_refuses(tmp_path, name, content, fragments):
    path = write(tmp_path, name, content)
    one_line_error(lambda: read_tagged(path), path, *fragments)


def test_the_readers_advise_the_option_that_sets_the_format(tmp_path):
    """The format advice names the setting the caller has (issue 51): data.format for a run,
    infer.py's --format for infer.py, which has no data.format."""
    path = write(tmp_path, "dev.txt", "sentence\tlabel\nfine\t1\n")
    message = one_line_error(lambda: read_table(path, ["sentence"], "label", format_option="--format"),
                             "cannot tell the format from the suffix '.txt'; set --format to tsv, csv or jsonl")
    assert "data.format" not in message, message
    one_line_error(lambda: read_tagged(path, fmt="tsv", format_option="--format"),
                   "format 'tsv' is not one of jsonl, conll or auto; set --format to one of them")
