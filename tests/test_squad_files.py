"""SQuAD files as users have them: offsets missing, null or off, v2.0 files; the official scorer's call."""
import json

import pytest

from data.squad import convert_examples_to_features, evaluate, load_squad, read_squad
from data.vocab import make_tokenizer, train_vocab

CONTEXT = "The river Tala flows past Brenmoor. Brenmoor is a busy town; the river Tala is long."


def _qa(qid, text, start="absent", **extra):
    answer = {"text": text}
    if start != "absent":
        answer["answer_start"] = start
    return {"id": qid, "question": f"What about {qid}?", "answers": [answer], **extra}


def _write(tmp_path, qas, name="file.json", context=CONTEXT):
    path = tmp_path / name
    path.write_text(json.dumps({"version": "x", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}))
    return path


def test_offsets_missing_null_or_off_are_found_from_the_answer_text(tmp_path, capsys):
    second = CONTEXT.index("Brenmoor is")
    qas = [
        _qa("exact", "Brenmoor", CONTEXT.index("Brenmoor")),
        _qa("missing", "busy town"),
        _qa("null", "busy town", None),
        _qa("string", "busy town", str(CONTEXT.index("busy town"))),
        _qa("off_by_3", "Brenmoor", second + 3),  # nearest occurrence to the hint: the second
        _qa("off_to_first", "river Tala", 2),  # the first occurrence is nearer
        _qa("case", "brenmoor", 26),  # only a case-insensitive match exists
        _qa("absent", "Lake Oun", 5),
    ]
    data = load_squad(_write(tmp_path, qas))
    starts = {e.qas_id: e.answer_starts[0] for e in data.examples}
    assert starts == {
        "exact": 26, "missing": CONTEXT.index("busy town"), "null": CONTEXT.index("busy town"),
        "string": CONTEXT.index("busy town"), "off_by_3": second, "off_to_first": CONTEXT.index("river Tala"),
        "case": 26, "absent": None,
    }
    assert sorted(data.relocated) == ["missing", "null", "off_by_3", "off_to_first"]  # "case" sits at its hint
    assert data.unlocated == ["absent"] and not data.unanswerable
    read_squad(tmp_path / "file.json")
    out = capsys.readouterr().out
    assert "4 answer_start missing or wrong" in out and "1 answers not in their context" in out and "absent" in out
    # Scoring uses texts only: every gold text counts, the unlocated one too.
    preds = {e.qas_id: e.answers[0] for e in data.examples}
    assert evaluate(tmp_path / "file.json", preds) == {"exact_match": 100.0, "f1": 100.0}


def test_training_features_point_at_the_located_answers_and_skip_the_unlocatable(tmp_path):
    vocab = train_vocab([CONTEXT] * 3, 120, tmp_path / "vocab.txt")
    tok = make_tokenizer(vocab.path)
    data = load_squad(_write(tmp_path, [_qa("off", "busy town", 3), _qa("none", "busy town", None),
                                        _qa("absent", "Lake Oun", 1)]))
    trainable = [e for e in data.examples if e.answer_starts[0] is not None]
    assert [e.qas_id for e in trainable] == ["off", "none"]
    for f in convert_examples_to_features(trainable, tok, max_seq_length=48, doc_stride=16, max_query_length=8):
        text = CONTEXT[f.offsets[f.start_position][0] : f.offsets[f.end_position][1]]
        assert text == "busy town"


def test_v2_files_count_unanswerable_and_leave_them_out(tmp_path, capsys):
    qas = [
        _qa("yes", "Brenmoor", 26, is_impossible=False),
        {"id": "impossible", "question": "Who?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Tala", "answer_start": 10}]},
        {"id": "empty", "question": "Why?", "answers": []},
        {"id": "no_key", "question": "When?"},
    ]
    path = _write(tmp_path, qas)
    data = load_squad(path)
    assert [e.qas_id for e in data.examples] == ["yes"]
    assert data.unanswerable == ["impossible", "empty", "no_key"]
    read_squad(path)
    assert "3 unanswerable (SQuAD v2.0) left out" in capsys.readouterr().out
    # Left out of scoring: one question, answered right, is 100 %.
    assert evaluate(path, {"yes": "Brenmoor", "impossible": ""}) == {"exact_match": 100.0, "f1": 100.0}


def test_evaluate_takes_the_official_scripts_arguments(tmp_path):
    path = _write(tmp_path, [_qa("a", "busy town", None), _qa("b", "river Tala", 999)])
    dataset_json = json.loads(path.read_text())
    preds = {"a": "a busy town", "b": "Tala"}
    want = {"exact_match": 50.0, "f1": 100 * (1 + 2 * 0.5 / 1.5) / 2}
    for dataset in (dataset_json["data"], dataset_json, path, load_squad(path).examples):
        assert evaluate(dataset, preds) == pytest.approx(want)
    with pytest.raises(ValueError, match="no answerable questions"):
        evaluate([], preds)


def test_malformed_questions_are_value_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(ValueError, match="article 0, paragraph 0 has no 'context'"):
        load_squad(path)
    path.write_text(json.dumps({"data": [{"paragraphs": [{"context": "x", "qas": [{"question": "?"}]}]}]}))
    with pytest.raises(ValueError, match="lacks 'id'"):
        load_squad(path)
