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


# Reference: the official v1.1 definition, written out here independently of data/squad/.
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
    with pytest.raises(ValueError, match=f"SQuAD file {tmp_path} is a directory, not a file; name the SQuAD JSON file"):
        read_squad(tmp_path)  # data.train_file or data.dev_file naming a directory (issue 51)
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


# ------------------------------------------------------------------ SQuAD v2.0
def _v2_file(rng, questions=60):
    """A v2.0-style file: each question answerable (1-3 golds, some normalising to "") or not."""
    words = ["the", "a", "river", "Tala", "flows", "past", "Brenmoor", "town", "old", "bridge", "an", "of", "1921",
             "Café", "Müller", "!", "(born", "1900)"]
    qas, gold_texts = [], {}
    for q in range(questions):
        qid = f"q{q}"
        if rng.random() < 0.45:
            qas.append({"id": qid, "question": "?", "answers": [], "is_impossible": True})
            continue
        golds = [" ".join(rng.choice(words, rng.integers(1, 4))) for _ in range(rng.integers(1, 4))]
        if rng.random() < 0.1:
            golds.append("the !")  # normalises to "": dropped from the golds, as the script does
        qas.append({"id": qid, "question": "?", "answers": [{"text": g, "answer_start": 0} for g in golds],
                    "is_impossible": False})
        gold_texts[qid] = golds
    context = " ".join(words)
    return {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}, gold_texts


def _v2_predictions(rng, blob, gold_texts):
    words = ["river", "Tala", "the town", "Brenmoor", "old bridge", "1921", "Müller"]
    predictions = {}
    for qa in blob["data"][0]["paragraphs"][0]["qas"]:
        r = rng.random()
        if r < 0.3:
            predictions[qa["id"]] = ""
        elif r < 0.55 and qa["id"] in gold_texts:
            predictions[qa["id"]] = str(rng.choice(gold_texts[qa["id"]])).upper() + "."
        else:
            predictions[qa["id"]] = " ".join(rng.choice(words, rng.integers(1, 3)))
    return predictions


@pytest.mark.parametrize("seed", range(5))
def test_v2_scores_equal_the_official_v2_script(tmp_path, seed):
    from tests.squad_v2_reference import official_v2

    rng = np.random.default_rng(seed)
    blob, gold_texts = _v2_file(rng)
    predictions = _v2_predictions(rng, blob, gold_texts)
    path = tmp_path / "dev-v2.json"
    path.write_text(json.dumps(blob))
    want = official_v2(blob["data"], predictions)
    got = evaluate(path, predictions)
    assert set(got) == set(want) and got == pytest.approx(want), (got, want)
    # With no-answer scores (ties included): the thresholded figures and the best thresholds.
    na_probs = {q: float(rng.choice([-2.0, -0.5, 0.0, 0.5, 1.5, 3.0])) for q in predictions}
    want = official_v2(blob["data"], predictions, na_probs)
    got = evaluate(blob, predictions, na_probs)
    assert set(got) == set(want) and got == pytest.approx(want), (got, want)
    assert "best_f1_thresh" in got and "HasAns_exact" in got and "NoAns_f1" in got


def test_v2_figures_are_not_the_answerable_only_figures(tmp_path):
    # The wrong figure: HasAns scores printed as plain exact/f1. One answerable right,
    # two unanswerable wrong (answered with text): HasAns 100, overall 33.3.
    blob = {"data": [{"paragraphs": [{"context": "Tala flows.", "qas": [
        {"id": "a", "question": "?", "answers": [{"text": "Tala", "answer_start": 0}], "is_impossible": False},
        {"id": "b", "question": "?", "answers": [], "is_impossible": True},
        {"id": "c", "question": "?", "answers": [], "is_impossible": True}]}]}]}
    scores = evaluate(blob, {"a": "Tala", "b": "Tala", "c": "flows"})
    assert scores["exact"] == pytest.approx(100 / 3) and scores["HasAns_exact"] == 100.0 and "exact_match" not in scores


def test_unanswerable_questions_train_on_the_cls_null_answer(squad_setup):
    examples, tok = squad_setup
    unanswerable = [Example(e.qas_id + "-no", e.question, e.context, (), (), is_impossible=True) for e in examples[:5]]
    features = convert_examples_to_features(examples[:5] + unanswerable, tok, max_seq_length=64, doc_stride=24,
                                            max_query_length=10)
    assert any(f.start_position for f in features if f.example_index < 5)
    for f in features:
        if f.example_index >= 5:
            assert f.start_position == f.end_position == 0, "every window of an unanswerable question points at [CLS]"


def test_null_predictions_follow_the_threshold(squad_setup):
    from data.squad import apply_null_threshold, nbest_predictions

    examples, tok = squad_setup
    features = convert_examples_to_features(examples[:4], tok, max_seq_length=64, doc_stride=24, max_query_length=10)
    rng = np.random.default_rng(3)
    start, end = rng.normal(0, 1, (2, len(features), 64))
    preds, _ = nbest_predictions(examples[:4], features, start, end, details=True)
    for ex_index, ex in enumerate(examples[:4]):
        mine = [i for i, f in enumerate(features) if f.example_index == ex_index]
        null = min(start[i, 0] + end[i, 0] for i in mine)
        text_only = nbest_predictions(examples[:4], features, start, end)[0][ex.qas_id]
        p = preds[ex.qas_id]
        assert p.text == text_only == ex.context[p.start : p.end]
        best = max(start[i, s] + end[i, e] for i in mine for s in range(64) for e in range(64)
                   if features[i].offsets[s] and features[i].offsets[e] and features[i].max_context[s]
                   and s <= e < s + 30 and ex.context[features[i].offsets[s][0]: features[i].offsets[e][1]] == p.text)
        assert p.null_odds == pytest.approx(null - best)
    odds = sorted(p.null_odds for p in preds.values())
    threshold = (odds[1] + odds[2]) / 2
    chosen = apply_null_threshold(preds, threshold)
    assert sum(t == "" for t in chosen.values()) == 2 and apply_null_threshold(preds, None) == {
        q: p.text for q, p in preds.items()}


# ----------------------------------------------------- features: linear, exact
def _reference_max_context(windows, w_index, pos):
    """BERT run_squad.py's _check_is_max_context, as written there (every window, per token)."""
    best, best_score = None, None
    for i, (start, length) in enumerate(windows):
        end = start + length - 1
        if not start <= pos <= end:
            continue
        score = min(pos - start, end - pos) + 0.01 * length
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best == w_index


def test_features_tokenize_each_context_once_and_keep_the_reference_max_context(squad_setup):
    examples, tok = squad_setup

    class Counting:
        def __init__(self, inner):
            self.inner, self.texts = inner, collections.Counter()

        def encode_batch(self, texts, **kw):
            self.texts.update(texts)
            return self.inner.encode_batch(texts, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = Counting(tok)
    features = convert_examples_to_features(examples, counting, max_seq_length=64, doc_stride=24, max_query_length=10)
    contexts = {e.context for e in examples}
    assert len(examples) > len(contexts) and all(counting.texts[c] == 1 for c in contexts), \
        "a context shared by several questions must be tokenized once"
    by_example = collections.defaultdict(list)
    for f in features:
        by_example[f.example_index].append(f)
    for ex_index, feats in list(by_example.items())[:6]:
        ctx_at = [f.segment_ids.index(1) for f in feats]
        context_ids = tok.encode(examples[ex_index].context, add_special_tokens=False).ids
        windows, pos = [], 0
        for f, c in zip(feats, ctx_at):
            length = sum(f.segment_ids) - 1
            windows.append((pos, length))
            assert f.input_ids[c : c + length] == context_ids[pos : pos + length]
            pos += 24
        for w, (f, c) in enumerate(zip(feats, ctx_at)):
            flags = f.max_context[c : c + windows[w][1]]
            assert flags == [_reference_max_context(windows, w, windows[w][0] + i) for i in range(windows[w][1])]


# ------------------------------------------------- v2.0: the served null threshold
def _v2_case(squad_setup, odds, right, unanswerable):
    """Real features of 12 questions with random span logits, the [CLS] logit moved so that
    question i's null odds are `odds[i]`; question i is unanswerable where `unanswerable[i]`,
    else its gold answer is its predicted span where `right[i]` (F1 1), else a text the
    context lacks (F1 0). Returns (examples, features, start, end, articles for the reference)."""
    from data.squad import nbest_predictions

    examples, tok = squad_setup
    examples = examples[: len(odds)]
    features = convert_examples_to_features(examples, tok, max_seq_length=64, doc_stride=24, max_query_length=10)
    rng = np.random.default_rng(7)
    start, end = rng.normal(0, 2, (2, len(features), 64))
    details, _ = nbest_predictions(examples, features, start, end, details=True)
    for i, ex in enumerate(examples):  # [CLS] is never a span: moving it moves the null score alone
        start[[k for k, f in enumerate(features) if f.example_index == i], 0] += odds[i] - details[ex.qas_id].null_odds
    details, _ = nbest_predictions(examples, features, start, end, details=True)
    cases = []
    for i, ex in enumerate(examples):
        assert details[ex.qas_id].null_odds == pytest.approx(odds[i])
        gold = () if unanswerable[i] else ((details[ex.qas_id].text,) if right[i] else ("zzyzx quorble",))
        cases.append(Example(ex.qas_id, ex.question, ex.context, gold, (None,) * len(gold),
                             is_impossible=unanswerable[i]))
    articles = [{"paragraphs": [{"context": e.context, "qas": [
        {"id": e.qas_id, "question": e.question, "answers": [{"text": t, "answer_start": 0} for t in e.answers],
         "is_impossible": e.is_impossible}]} for e in cases]}]
    return cases, features, start, end, articles


def _served_f1_is_the_best(answers, articles, odds, cases):
    """The served answers' official F1 is the best of every threshold the odds can realise."""
    from tests.squad_v2_reference import official_v2

    spans = {q: p.text for q, p in answers.details.items()}
    values = sorted(set(odds))
    cuts = [values[0] - 1] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1]
    best = max(official_v2(articles, {q: "" if answers.details[q].null_odds > c else t for q, t in spans.items()})["f1"]
               for c in cuts)
    served = official_v2(articles, answers.texts)
    assert served["f1"] == pytest.approx(best) and answers.scores["f1"] == pytest.approx(best)
    official = official_v2(articles, spans, na_probs={q: p.null_odds for q, p in answers.details.items()})
    for key in ("best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"):  # reported as the script's
        assert answers.scores[key] == pytest.approx(official[key]), key
    return official


@pytest.mark.parametrize("sign", [-1, 1])
def test_an_all_null_optimum_is_served_as_no_answer_on_log_odds_of_either_sign(squad_setup, sign):
    from data.squad import answer_questions

    # Null odds all below zero (or all above), every span wrong: answering nothing is best.
    odds = [sign * (0.2 + 0.11 * i) for i in range(12)]
    unanswerable = [i % 3 == 0 for i in range(12)]
    cases, features, start, end, articles = _v2_case(squad_setup, odds, [False] * 12, unanswerable)
    answers = answer_questions(cases, features, start, end, tune_null_threshold=True)
    official = _served_f1_is_the_best(answers, articles, odds, cases)
    assert answers.null_threshold < min(odds) and set(answers.texts.values()) == {""}
    assert answers.scores["f1"] == pytest.approx(official["best_f1"]) == pytest.approx(100 * 4 / 12)
    # The official search reports its start value 0.0: as a threshold on log-odds below zero it
    # answers every question, far from its own best.
    assert official["best_f1_thresh"] == 0.0
    if sign < 0:
        from tests.squad_v2_reference import official_v2

        at_zero = official_v2(articles, {q: "" if o > 0.0 else p.text for (q, p), o in
                                         zip(answers.details.items(), odds)})
        assert at_zero["f1"] == 0.0 < official["best_f1"]
    # The threshold travels: applied again (infer.py's way), it gives the same answers and F1.
    again = answer_questions(cases, features, start, end, null_threshold=answers.null_threshold)
    assert again.texts == answers.texts and again.scores["f1"] == answers.scores["f1"]


@pytest.mark.parametrize("pattern", ["all answered", "between", "ties"])
def test_the_served_threshold_gives_the_best_f1_of_any_threshold(squad_setup, pattern):
    from data.squad import answer_questions

    rng = np.random.default_rng(len(pattern))
    if pattern == "all answered":  # spans right but the unanswerable question with the lowest odds: answer all
        odds, right, unanswerable = sorted(rng.normal(1.0, 0.5, 12)), [True] * 12, [True] + [False] * 11
    elif pattern == "between":  # right spans have low odds, unanswerable ones high: a cut inside
        right = [i % 2 == 0 for i in range(12)]
        unanswerable = [not r and i % 4 == 1 for i, r in enumerate(right)]
        odds = [float(-1.5 + 0.1 * i if right[i] else 0.3 + 0.1 * i) for i in range(12)]
    else:  # several questions share an odds value
        right, unanswerable = list(rng.random(12) < 0.5), [False] * 12
        unanswerable = [not r and rng.random() < 0.6 for r in right]
        odds = [float(v) for v in rng.choice([-0.75, -0.25, 0.5], 12)]
    cases, features, start, end, articles = _v2_case(squad_setup, odds, right, unanswerable)
    answers = answer_questions(cases, features, start, end, tune_null_threshold=True)
    _served_f1_is_the_best(answers, articles, odds, cases)
    if pattern == "all answered":
        assert answers.null_threshold > max(odds) and "" not in answers.texts.values()
        assert answers.scores["best_f1_thresh"] == pytest.approx(max(odds))
    if pattern == "between":
        low = max(o for o, r in zip(odds, right) if r)
        assert low < answers.null_threshold < min(o for o, r in zip(odds, right) if not r)
    # A margin either side: odds moved by float noise of another runtime give the same answers.
    gap = min(abs(o - answers.null_threshold) for o in odds)
    assert gap >= min(0.05, min(abs(a - b) for a in odds for b in odds if a != b) / 2 - 1e-9)
