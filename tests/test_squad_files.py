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
    assert data.realigned == ["case"]  # ... but its text differs in case: aligned to the context's characters
    assert data.unlocated == ["absent"] and not data.unanswerable
    read_squad(tmp_path / "file.json")
    out = capsys.readouterr().out
    assert ("8 questions (8 answerable); answers: 2 kept as written, 5 fixed (4 answer_start missing or wrong, "
            "found by the answer text; 1 differing from the context in white space or case, aligned), 1 dropped "
            "from training (not in their context; still scored: absent)") in out, out
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


def test_v2_files_keep_unanswerable_questions_and_score_them_officially(tmp_path, capsys):
    qas = [
        _qa("yes", "Brenmoor", 26, is_impossible=False),
        {"id": "impossible", "question": "Who?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Tala", "answer_start": 10}]},
        {"id": "empty", "question": "Why?", "answers": []},  # empty answers in a v2.0 file: no answer
        {"id": "no_key", "question": "When?"},  # no answers at all: asked, not graded
    ]
    path = _write(tmp_path, qas)
    data = load_squad(path)
    assert [e.qas_id for e in data.examples] == ["yes", "impossible", "empty", "no_key"] and data.version_2
    assert data.unanswerable == ["impossible", "empty"] and data.ungraded == ["no_key"]
    assert [e.qas_id for e in data.trainable] == ["yes", "impossible", "empty"]
    read_squad(path)
    assert "4 questions (1 answerable, 2 unanswerable (SQuAD v2.0), 1 without answers" in capsys.readouterr().out
    # v2.0 figures under their official names: "" is right for the unanswerable questions.
    scores = evaluate(path, {"yes": "Brenmoor", "impossible": "", "empty": "Tala", "no_key": "x"})
    assert scores == {"exact": 200 / 3, "f1": 200 / 3, "total": 3, "HasAns_exact": 100.0, "HasAns_f1": 100.0,
                      "HasAns_total": 1, "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2}


def test_a_whitespace_difference_is_aligned_not_dropped(tmp_path):
    # The reference tooling (google-research/bert read_squad_examples) compares white-space
    # normalised text: an answer written with one space where the context has two aligns.
    context = "The river  Tala flows past Brenmoor.\nIts   banks are green."
    path = _write(tmp_path, [_qa("double", "river Tala", 4), _qa("newline", "Brenmoor. Its banks", None)],
                  context=context)
    data = load_squad(path)
    spans = {e.qas_id: e.answer_span for e in data.examples}
    assert context[slice(*spans["double"])] == "river  Tala"
    assert context[slice(*spans["newline"])] == "Brenmoor.\nIts   banks"
    assert not data.unlocated and sorted(data.realigned) == ["double", "newline"]
    assert [e.qas_id for e in data.trainable] == ["double", "newline"]


def test_a_case_insensitive_match_at_the_offset_beats_an_exact_one_far_away(tmp_path):
    context = "brenmoor lies on the Tala. " + "filler words here. " * 200 + "Brenmoor is a town."
    data = load_squad(_write(tmp_path, [_qa("near", "Brenmoor", 0)], context=context))
    assert data.examples[0].answer_span == (0, 8), "the annotator's offset wins over an exact match 3,000+ away"
    far = load_squad(_write(tmp_path, [_qa("none", "Brenmoor")], context=context, name="nohint.json"))
    assert far.examples[0].answer_starts[0] == context.index("Brenmoor")  # without a hint: the exact match


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, "no"])
def test_is_impossible_that_is_not_a_boolean_is_refused(tmp_path, value):
    path = _write(tmp_path, [_qa("q", "Brenmoor", 26, is_impossible=value)])
    with pytest.raises(ValueError, match=rf"{path}: data\[0\], paragraph 0, question 0 \(id 'q'\): 'is_impossible' "
                                         r"must be true or false, got "):
        load_squad(path)


@pytest.mark.parametrize("blob,pattern", [
    ({"data": ["Normans"]}, r"data\[0\] is a string, not an article object"),
    ({"data": [{"title": "t", "paragraphs": "x"}]}, r"data\[0\] \('t'\) has no 'paragraphs' list"),
    ({"data": [{"paragraphs": [7]}]}, r"data\[0\], paragraph 0 is a number"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": {"id": 1}}]}]}, r"'qas' must be a list"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": ["q"]}]}]}, r"question 0 is a string"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q", "question": "?", "answers": "c"}]}]}]},
     r"\(id 'q'\): 'answers' must be a list of .* got string \"c\""),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q", "question": "?", "answers": ["c"]}]}]}]},
     r"answers\[0\] must be an object"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q", "question": 5}]}]}]}, r"'question' must be text"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "q", "question": "?", "is_impossible": True,
                                                         "answers": [{"text": "c"}]}]}]}]}, r"has 'is_impossible': true"),
])
def test_structural_faults_name_the_file_and_the_place(tmp_path, blob, pattern):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(blob))
    with pytest.raises(ValueError, match=rf"{path}: .*{pattern}") as error:
        load_squad(path)
    assert "\n" not in str(error.value)


def test_evaluate_takes_the_official_scripts_arguments(tmp_path):
    path = _write(tmp_path, [_qa("a", "busy town", None), _qa("b", "river Tala", 999)])
    dataset_json = json.loads(path.read_text())
    preds = {"a": "a busy town", "b": "Tala"}
    want = {"exact_match": 50.0, "f1": 100 * (1 + 2 * 0.5 / 1.5) / 2}
    for dataset in (dataset_json["data"], dataset_json, path, load_squad(path).examples):
        assert evaluate(dataset, preds) == pytest.approx(want)
    with pytest.raises(ValueError, match="no questions with gold answers"):
        evaluate([], preds)


def test_malformed_questions_are_value_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(ValueError, match=r"data\[0\], paragraph 0 has no 'context'"):
        load_squad(path)
    path.write_text(json.dumps({"data": [{"paragraphs": [{"context": "x", "qas": [{"question": "?"}]}]}]}))
    with pytest.raises(ValueError, match="lacks 'id'"):
        load_squad(path)


@pytest.mark.parametrize("scored", [False, True], ids=["training-file", "dev-file"])
def test_two_questions_of_one_id_are_refused_naming_the_id_and_the_file(tmp_path, scored):
    """Predictions and scores are keyed by id: two questions of one id would be answered and
    scored as one ("2 questions", one answer). The second paragraph's id is the number 7, the
    first's the text "7": one id as the predictions key them."""
    from bert.tasks.squad import _load

    path = tmp_path / "twice.json"
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [
        {"context": CONTEXT, "qas": [_qa("a", "Brenmoor", 26), _qa("7", "river Tala", 4)]},
        {"context": CONTEXT, "qas": [_qa(7, "busy town", None)]}]}]}))
    with pytest.raises(ValueError) as error:
        _load(str(path), scored=scored)
    assert str(error.value) == (f"{path}: question id '7' is given twice (data[0], paragraph 0, question 1 and "
                                "data[0], paragraph 1, question 0); every question needs its own id: rename or "
                                "remove one")


def test_a_dev_file_s_line_says_what_is_scored_not_what_is_dropped_from_training(tmp_path, capsys):
    """The dev file is only scored: an answer not in its context is scored all the same."""
    from bert.tasks.squad import _load

    path = _write(tmp_path, [_qa("here", "Brenmoor", 26), _qa("absent", "Lake Oun", 5)])
    _load(str(path), scored=True)
    dev = capsys.readouterr().out
    assert "dropped" not in dev and dev.strip().endswith(
        "1 not in their context (scored all the same: absent)"), dev
    _load(str(path))  # as a training file
    assert capsys.readouterr().out.strip().endswith(
        "1 dropped from training (not in their context; still scored: absent)")
