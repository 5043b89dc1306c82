"""infer.py and SQuAD as a user runs them (issue 20): every fault ends in one line naming the
culprit, nothing the user wrote is replaced (files compared before and after), questions
without gold answers are answered, the vocab travels with every export, the documented
HuggingFace fine-tune command runs as written, and --eval-only scores without training."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import infer
from bert import build_model
from session import InferenceSession
from tests.helpers import tiny_config
from tests.squad_data import write_tiny_squad
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("squad")
    train, dev, vocab = write_tiny_squad(d, train_docs=40, dev_docs=6)
    return d, train, dev, vocab


@pytest.fixture(scope="module")
def export(squad_files, tmp_path_factory):
    """A tiny SQuAD export (random weights) with its vocab and config in the metadata."""
    d, _, _, vocab = squad_files
    cfg = tiny_config("bert", task="squad", vocab_size=vocab.size, sequence_length=40, max_positions=48)
    proto = build_model(cfg, with_loss=False).builder.model_proto()
    path = tmp_path_factory.mktemp("export") / "squad.onnx"
    InferenceSession(proto).export(path, extra_metadata={
        "task": "squad", "vocab": vocab.path.read_text(), "lower_case": "true",
        "config": json.dumps(cfg.model_dump(mode="json")), "squad": json.dumps({"doc_stride": 16, "max_query_length": 12})})
    return path


def _main(argv, capsys):
    code = infer.main([*argv, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, *names) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


# ------------------------------------------------------------------ infer.py faults
def test_quantize_onto_its_own_input_is_refused_and_the_model_kept(export, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    shutil.copyfile(export, model)
    before = snapshot(tmp_path)
    code, _, err = _main(["--model", str(model), "--quantize", str(model)], capsys)
    assert code == 2 and "is the input" in _one_error_line(err, model)
    code, _, err = _main(["--model", str(model), "--quantize", str(tmp_path / "." / "m.onnx")], capsys)
    assert code == 2 and "is the input" in _one_error_line(err)
    other = tmp_path / "mine.onnx"
    other.write_bytes(b"a file of the user's")
    before = snapshot(tmp_path)
    code, _, err = _main(["--model", str(model), "--quantize", str(other)], capsys)
    assert code == 2 and "already exists" in _one_error_line(err, other)
    assert snapshot(tmp_path) == before, "nothing the user wrote may change"


def test_a_truncated_onnx_is_named(export, tmp_path, capsys):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(export.read_bytes()[: export.stat().st_size // 2])
    code, _, err = _main(["--model", str(broken), "--task", "squad", "--squad", "x.json"], capsys)
    assert code == 2
    _one_error_line(err, broken)


def test_max_seq_length_past_the_positions_is_refused(export, squad_files, capsys):
    _, _, dev, _ = squad_files
    code, _, err = _main(["--model", str(export), "--task", "squad", "--squad", str(dev), "--max-seq-length", "49"],
                         capsys)
    assert code == 2 and "48 positions" in _one_error_line(err, "--max-seq-length 49", export)


@pytest.mark.parametrize("flag,value", [("--top-k", "0"), ("--batch-size", "0"), ("--top-k", "-3"),
                                        ("--batch-size", "x")])
def test_non_positive_counts_are_refused(export, flag, value, capsys):
    code, _, err = _main(["--model", str(export), "--task", "mlm", "--text", "a [MASK] b", flag, value], capsys)
    assert code == 2
    _one_error_line(err, flag)


def test_squad_batch_size_zero_and_bad_stride_are_refused(export, squad_files, capsys):
    _, _, dev, _ = squad_files
    for flag in ("--batch-size", "--doc-stride"):
        code, _, err = _main(["--model", str(export), "--task", "squad", "--squad", str(dev), flag, "0"], capsys)
        assert code == 2
        _one_error_line(err, flag)


def test_a_missing_text_file_is_named(export, tmp_path, capsys):
    code, _, err = _main(["--model", str(export), "--task", "mlm", "--file", str(tmp_path / "none.txt")], capsys)
    assert code == 2 and "does not exist" in _one_error_line(err, tmp_path / "none.txt")


def test_a_sequence_past_the_positions_is_refused_by_the_input_check(export):
    session = InferenceSession(export)
    feeds = {k: np.zeros((1, 49), np.int64) for k in ("input_ids", "segment_ids", "input_mask")}
    with pytest.raises(ValueError, match=r"input 'input_ids' .* 49 along dimension 1, but the graph takes at most 48 "
                                         r"\(the 48 rows of bert\.embeddings\.position_embeddings\.weight\)"):
        session.run(feeds)
    feeds = {k: np.zeros((1, 48), np.int64) for k in ("input_ids", "segment_ids", "input_mask")}
    assert session.run(feeds)["start_logits"].shape == (1, 48)


# ------------------------------------------------------------- answers, served
def _questions_only(dev: Path, path: Path) -> Path:
    blob = json.loads(dev.read_text())
    for article in blob["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                del qa["answers"]
    path.write_text(json.dumps(blob))
    return path


def test_questions_without_answers_are_answered_and_printed(export, squad_files, tmp_path, capsys):
    _, _, dev, _ = squad_files
    questions = _questions_only(dev, tmp_path / "questions.json")
    ids = [qa["id"] for a in json.loads(questions.read_text())["data"] for p in a["paragraphs"] for qa in p["qas"]]
    code, out, err = _main(["--model", str(export), "--task", "squad", "--squad", str(questions)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ids, "one line per question, in file order, no scores"
    assert all("score" in line for line in lines) and "without answers" in err
    # JSON lines with --output: text, score and span, the span cut from the context.
    jsonl = tmp_path / "answers.jsonl"
    code, out, err = _main(["--model", str(export), "--task", "squad", "--squad", str(questions), "--output",
                            str(jsonl)], capsys)
    assert code == 0 and out == ""
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    contexts = {qa["id"]: p["context"] for a in json.loads(questions.read_text())["data"] for p in a["paragraphs"]
                for qa in p["qas"]}
    assert [r["id"] for r in records] == ids
    for r in records:
        assert set(r) == {"id", "answer", "score", "start", "end", "null_odds"} and 0 < r["score"] <= 1
        assert contexts[r["id"]][r["start"] : r["end"]] == r["answer"]


def test_scores_only_when_answers_are_given(export, squad_files, capsys):
    _, _, dev, _ = squad_files
    code, out, _ = _main(["--model", str(export), "--task", "squad", "--squad", str(dev)], capsys)
    assert code == 0
    scores = json.loads(out.splitlines()[-1])
    assert set(scores) == {"exact_match", "f1"}
    answers = {line.split(":")[0]: line for line in out.splitlines()[:-1]}
    assert len(answers) == sum(len(p["qas"]) for a in json.loads(dev.read_text())["data"] for p in a["paragraphs"])


def test_output_never_replaces_a_file(export, squad_files, tmp_path, capsys):
    _, _, dev, _ = squad_files
    squad = tmp_path / "dev.json"
    shutil.copyfile(dev, squad)
    taken = tmp_path / "taken.jsonl"
    taken.write_text("the user's\n")
    before = snapshot(tmp_path)
    for output, message in ((squad, "is the input"), (taken, "already exists")):
        code, _, err = _main(["--model", str(export), "--task", "squad", "--squad", str(squad), "--output",
                              str(output)], capsys)
        assert code == 2 and message in _one_error_line(err, output)
    assert snapshot(tmp_path) == before
