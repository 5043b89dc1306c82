"""SQuAD v1.1: reading, features (gold spans), post-processing and official scoring."""

import collections
import json
import re
import string

import numpy as np
import pytest

from data.demo import generate_documents
from data.squad import (
    Example,
    convert_examples_to_features,
    evaluate,
    exact_match_score,
    f1_score,
    normalize_answer,
    postprocess,
    read_squad,
)
from data.vocab import make_tokenizer, train_vocab


# Reference: the official v1.1 definition, written out here independently of data/squad.py.
def _ref_normalize(s):
    s = s.lower()
    s = "".join(c for c in s if c not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _ref_f1(pred, gold):
    p, g = _ref_normalize(pred).split(), _ref_normalize(gold).split()
    same = sum((collections.Counter(p) & collections.Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


CASES = [
    # (prediction, gold answers, exact match, F1) — worked out by hand
    ("The Eiffel Tower", ["Eiffel Tower"], 1.0, 1.0),
    ("eiffel tower!", ["the Eiffel Tower."], 1.0, 1.0),
    ("an apple a day", ["Apple day"], 1.0, 1.0),
    ("theatre", ["the atre"], 0.0, 0.0),  # "the" inside a word is no article
    ("Paris, France", ["Paris"], 0.0, 2 * (1 / 2 * 1) / (1 / 2 + 1)),
    ("big cat sat", ["the cat sat down"], 0.0, 2 / 3),
    ("1,000 people", ["1000 people"], 1.0, 1.0),  # punctuation inside numbers is removed too
    ("  New\tYork \n City ", ["new york city"], 1.0, 1.0),
    ("Denver", ["Denver Broncos", "Broncos", "the Denver"], 1.0, 1.0),  # max over several golds
    ("Denver Broncos team", ["Broncos", "Carolina Panthers"], 0.0, 2 * (1 / 3) / (1 / 3 + 1)),
    ("", ["anything"], 0.0, 0.0),
    ("a the an", ["the"], 1.0, 0.0),  # both normalise to "": EM 1, F1 0 (no tokens)
    ("don't stop", ["dont stop"], 1.0, 1.0),
]


@pytest.mark.parametrize("pred,golds,em,f1", CASES)
def test_scores_match_official_definition(pred, golds, em, f1):
    assert max(exact_match_score(pred, g) for g in golds) == em
    assert max(f1_score(pred, g) for g in golds) == pytest.approx(f1)
    assert max(_ref_f1(pred, g) for g in golds) == pytest.approx(f1)
    for g in golds:
        assert normalize_answer(g) == _ref_normalize(g)


def test_evaluate_averages_and_counts_missing(tmp_path):
    blob = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": "The cat sat on the mat in Paris, France.",
         "qas": [{"id": "a", "question": "Who sat?", "answers": [{"text": "The cat", "answer_start": 0}]},
                 {"id": "b", "question": "Where?", "answers": [
                     {"text": "Paris, France", "answer_start": 26}, {"text": "Paris", "answer_start": 26}]},
                 {"id": "c", "question": "On what?", "answers": [{"text": "the mat", "answer_start": 15}]}]}]}]}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(blob))
    preds = {"a": "cat", "b": "Paris, France!"}  # "c" unanswered → 0
    want = {"exact_match": 100 * 2 / 3, "f1": 100 * 2 / 3}
    for dataset in (path, blob, read_squad(path)):
        got = evaluate(dataset, preds)
        assert got == pytest.approx(want)
    assert evaluate(path, {"a": "a cat sat", "b": "France", "c": "mat"}) == pytest.approx(
        {"exact_match": 100 / 3, "f1": 100 * (2 * 0.5 / 1.5 + 2 * 0.5 / 1.5 + 1) / 3})


def test_read_squad_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_squad(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [\n  {"title": \n')
    with pytest.raises(ValueError, match=f"{bad}, line 3: invalid JSON"):
        read_squad(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"data": [{"paragraphs": [{"context": "abc def", "qas": [
        {"id": "q", "question": "?", "answers": [{"text": "def", "answer_start": 1}]}]}]}]}))
    # A wrong offset is a hint, not an error (tests/test_squad_files.py has the cases).
    assert read_squad(wrong)[0].answer_starts == (4,)
    nothing = tmp_path / "list.json"
    nothing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="no top-level 'data' list"):
        read_squad(nothing)


@pytest.fixture(scope="module")
def squad_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("squad")
    docs = generate_documents(60, seed=11)
    extra = ["Café Müller opened in 1921, near the old bridge.", "Its owner's name was Zoë-Anne O'Neill."]
    vocab = train_vocab([s for doc in docs for s in doc] + extra, 400, d / "vocab.txt")
    rnd = np.random.default_rng(0)
    examples = []
    for i, doc in enumerate(docs):
        context = " ".join(doc) + " " + " ".join(extra)
        # Gold answers: whole words or word runs, punctuation excluded.
        spans = [(m.start(), m.end()) for m in re.finditer(r"[\w'-]+(?: [\w'-]+){0,3}", context)]
        for k in rnd.choice(len(spans), 3, replace=False):
            a, b = spans[k]
            examples.append(Example(f"q{i}-{k}", f"What is at {k}?", context, (context[a:b],), (a,)))
    tok = make_tokenizer(vocab.path)
    return examples, tok


def test_gold_spans_map_back_to_answer_text(squad_setup):
    examples, tok = squad_setup
    features = convert_examples_to_features(examples, tok, max_seq_length=64, doc_stride=24, max_query_length=10)
    assert len(features) > 2 * len(examples), "long contexts must be split into several windows"
    found = collections.Counter()
    for f in features:
        assert len(f.input_ids) == len(f.segment_ids) == len(f.input_mask) == len(f.offsets) == 64
        if f.start_position == 0:
            assert f.end_position == 0
            continue
        ex = examples[f.example_index]
        s, e = f.offsets[f.start_position], f.offsets[f.end_position]
        assert ex.context[s[0] : e[1]] == ex.answers[0]
        assert f.segment_ids[f.start_position] == 1 and f.segment_ids[f.end_position] == 1
        found[f.example_index] += 1
    # Every answer shorter than a window lies whole inside at least one window.
    assert set(found) == set(range(len(examples)))


def test_postprocess_recovers_answers_and_respects_limits(squad_setup):
    examples, tok = squad_setup
    features = convert_examples_to_features(examples, tok, max_seq_length=64, doc_stride=24, max_query_length=10)
    rnd = np.random.default_rng(1)
    start = rnd.normal(0, 0.1, (len(features), 64))
    end = rnd.normal(0, 0.1, (len(features), 64))
    for i, f in enumerate(features):
        if f.start_position and f.max_context[f.start_position]:
            start[i, f.start_position] += 10
            end[i, f.end_position] += 10
    preds = postprocess(examples, features, start, end)
    assert evaluate(examples, preds) == {"exact_match": 100.0, "f1": 100.0}
    # A span longer than max_answer_length is never chosen.
    short = postprocess(examples, features, start, end, max_answer_length=1)
    single = collections.defaultdict(set)  # texts of single context tokens, per example
    for f in features:
        single[f.example_index] |= {examples[f.example_index].context[o[0] : o[1]] for o in f.offsets if o}
    for i, ex in enumerate(examples):
        assert short[ex.qas_id] in single[i]
    # Logits pointing into the question or at [CLS] give no answer text from there.
    q_only = np.full((len(features), 64), -10.0)
    q_only[:, 1] = 10
    preds = postprocess(examples, features, q_only, q_only)
    for ex in examples:
        assert preds[ex.qas_id] in ex.context and ex.question not in preds[ex.qas_id]
    with pytest.raises(ValueError, match="do not match"):
        postprocess(examples, features, start[:-1], end[:-1])
