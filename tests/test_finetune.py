"""SQuAD fine-tuning through `bert.py` (configs/squad_tiny.json) on a small generated SQuAD file:
it learns (F1 rises), writes its predictions and scores, resumes exactly, exports, and
onnxruntime (infer.py) answers the dev file with the same answers and scores."""
import json
import signal
from pathlib import Path

import numpy as np
import pytest

import bert.run.loop
import infer
from bert import config_from_dict, load_config, with_overrides
from bert.tasks.squad import fine_tune
from bert.run.loop import round_figure
from data.squad import read_squad
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)
from session import checkpoint as checkpoints
from tests.squad_data import write_tiny_squad
from tests.test_distributed import torchrun
from tests.helpers import merge_settings, signal_a_run
from tests.test_faults_runs import snapshot


@pytest.fixture(scope="module")
def squad(tmp_path_factory):
    d = tmp_path_factory.mktemp("squad")
    train, dev, vocab = write_tiny_squad(d)
    overrides = ["--data.train_file", str(train), "--data.dev_file", str(dev), "--data.vocab_file", str(vocab.path)]
    return d, train, dev, vocab, overrides


@pytest.mark.slow
def test_fine_tuning_raises_f1_and_onnxruntime_agrees(squad, tmp_path):
    d, train, dev, vocab, overrides = squad
    examples = read_squad(dev)
    # Before training: bert.py eval of the run's initial weights (drawn from (seed, name)).
    assert bert_cli()(["eval", "--config", str(ROOT / "configs/squad_tiny.json"), *overrides,
                       "--training.output_dir", str(tmp_path / "before")]) == 0
    before = json.loads((tmp_path / "before" / "eval_results.json").read_text())

    run = tmp_path / "run"
    assert bert_cli()(["train", "--config", str(ROOT / "configs/squad_tiny.json"), *overrides,
                       "--training.output_dir", str(run)]) == 0
    results = json.loads((run / "eval_results.json").read_text())
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["f1"] == results["f1"] and last["exact_match"] == results["exact_match"]
    assert results["f1"] > before["f1"] + 15, f"F1 {before['f1']:.1f} before training, {results['f1']:.1f} after"
    predictions = json.loads((run / "predictions.json").read_text())
    nbest = json.loads((run / "nbest_predictions.json").read_text())
    assert set(predictions) == set(nbest) == {e.qas_id for e in examples}
    for qid, text in predictions.items():
        assert nbest[qid][0]["text"] == text
        assert sum(c["probability"] for c in nbest[qid]) == pytest.approx(1.0)
    assert (run / "vocab.txt").read_text() == vocab.path.read_text()

    # The exported fine-tuned model in onnxruntime gives the run's answers and scores, exactly.
    exported = tmp_path / "squad.onnx"
    assert bert_cli()(["export", "--config", str(ROOT / "configs/squad_tiny.json"), *overrides,
                       "--checkpoint-input", str(run / "checkpoint-final"), "--output", str(exported)]) == 0
    model = infer.OnnxModel(exported)
    served = infer.answer_squad(model, str(dev))
    scores = served.scores
    assert served.texts == predictions
    assert {k: round_figure(v) for k, v in scores.items()} == {k: v for k, v in results.items() if k != "dev_file"}
    # int8: quantized in onnxruntime, scored on the same file (figure recorded in docs/inference.md).
    int8 = infer.quantize(exported, tmp_path / "squad.int8.onnx")
    int8_scores = infer.answer_squad(infer.OnnxModel(int8), str(dev)).scores
    print(f"tiny SQuAD dev F1: before {before['f1']:.2f}, after {results['f1']:.2f}, onnxruntime {scores['f1']:.2f}, "
          f"int8 {int8_scores['f1']:.2f}")
    assert int8_scores["f1"] > before["f1"] + 10


def test_fine_tuning_resumes_exactly(squad, tmp_path):
    d, train, dev, vocab, overrides = squad
    base = with_overrides(load_config(ROOT / "configs/squad_tiny.json"), {
        "data.train_file": str(train), "data.vocab_file": str(vocab.path), "data.dev_file": None,
        "training.steps": 6, "schedule.warmup_steps": 2, "checkpoint.every": 3, "training.log_every": 1,
    })
    from bert.tasks.squad import fine_tune

    whole = fine_tune(base.model_copy(update={"training": base.training.model_copy(
        update={"output_dir": str(tmp_path / "whole")})}), progress=False)
    first = [m["loss"] for m in whole.metrics]
    resumed = fine_tune(base.model_copy(update={"training": base.training.model_copy(
        update={"output_dir": str(tmp_path / "other")})}), checkpoint_input=str(tmp_path / "whole" / "checkpoint-3"),
        progress=False)
    assert [m["loss"] for m in resumed.metrics] == first[3:], "a resumed run must continue bit for bit"


def test_fine_tuning_config_errors(squad, tmp_path):
    d, train, dev, vocab, overrides = squad
    main = bert_cli()
    config = str(ROOT / "configs/squad_tiny.json")
    assert main(["--config", config, *overrides, "--data.source", "demo"]) == 2  # task squad needs SQuAD data
    assert main(["--config", config, *overrides, "--data.train_file", str(tmp_path / "none.json"),
                 "--training.output_dir", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists(), "a rejected run writes nothing"
    with pytest.raises(ValueError, match="data.train_file is not set"):
        with_overrides(load_config(config), {"data.train_file": None})


# ------------------------------------------- the run loop's safeguards, for SQuAD
def _squad_config(squad, out, **training) -> dict:
    _, train, dev, vocab, _ = squad
    cfg = load_config(ROOT / "configs/squad_tiny.json").model_dump(mode="json")
    cfg["model"].update(hidden_dropout=0.0, attention_dropout=0.0)
    merge_settings(cfg, **{"steps": 6, "warmup_steps": 2, "log_every": 1, "output_dir": str(out), **training})
    cfg["data"].update(train_file=str(train), dev_file=None, vocab_file=str(vocab.path))
    return cfg


@pytest.mark.slow
def test_two_replicas_fine_tune_as_one_process_with_twice_the_accumulation_in_one_run_directory(squad, tmp_path):
    one = fine_tune(config_from_dict(_squad_config(squad, tmp_path / "one", gradient_accumulation=2,
                                                  micro_batch_size=8)), progress=False)
    path = tmp_path / "two.json"
    path.write_text(json.dumps(_squad_config(squad, tmp_path / "two", micro_batch_size=8)))
    result = torchrun(2, "bert.py", "--config", str(path))
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two", "two.json"], "one run directory"
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two] == [r["step"] for r in one.metrics] == list(range(1, 7))
    for a, b in zip(one.metrics, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
    ours = (tmp_path / "one" / "checkpoint-final" / "weights.vg0.data").read_bytes()
    theirs = (tmp_path / "two" / "checkpoint-final" / "weights.vg0.data").read_bytes()
    a, b = np.frombuffer(ours, np.float32), np.frombuffer(theirs, np.float32)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), "the final weights"


def test_a_diverging_fine_tune_exits_3_and_keeps_its_checkpoint(squad, tmp_path, monkeypatch):
    path = tmp_path / "diverge.json"
    path.write_text(json.dumps(_squad_config(squad, tmp_path / "run", steps=40, learning_rate=1e4,
                                             checkpoint_every=1, warmup_steps=0)))
    written = {}
    save = bert.run.loop.TrainingSession.save

    def remember(self, directory, extra_state=None):  # each checkpoint's bytes when it is written
        out = save(self, directory, extra_state)
        written[Path(directory).name] = snapshot(Path(directory))
        return out

    monkeypatch.setattr(bert.run.loop.TrainingSession, "save", remember)
    assert bert_cli()(["--config", str(path)]) == 3
    assert written and not (tmp_path / "run" / "checkpoint-final").exists()
    for name, files in written.items():
        assert snapshot(tmp_path / "run" / name) == files, f"{name} changed after it was written"


@pytest.mark.slow
def test_sigterm_during_fine_tuning_writes_a_checkpoint(squad, tmp_path):
    path = tmp_path / "long.json"
    path.write_text(json.dumps(_squad_config(squad, tmp_path / "run", steps=100000)))
    code, stderr = signal_a_run(path, tmp_path / "run", signal.SIGTERM, ROOT)
    assert code == 143, stderr
    step = int(stderr.strip().splitlines()[-1].split(" at step ")[1].split(";")[0])
    checkpoints.verify(tmp_path / "run" / f"checkpoint-{step}", ("model.onnx", "session.json"))


@pytest.mark.slow
def test_eval_only_under_torchrun_scores_as_one_process_and_as_the_run(squad, tmp_path):
    _, _, dev, _, _ = squad
    cfg = _squad_config(squad, tmp_path / "run", steps=4)
    cfg["data"]["dev_file"] = str(dev)
    trained = fine_tune(config_from_dict(cfg), progress=False)
    path = tmp_path / "eval.json"
    cfg["training"]["output_dir"] = str(tmp_path / "eval")
    path.write_text(json.dumps(cfg))
    checkpoint = str(trained.checkpoint)
    result = torchrun(2, "bert.py", "eval", "--config", str(path), "--checkpoint-input", checkpoint)
    assert result.returncode == 0, result.stdout[-4000:]
    # The command named its output_dir: the scores go there (with the run's own config, into the run).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "eval.json", "run"], "one run directory"
    two = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    run = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    assert two == run and two["f1"] == round_figure(trained.evaluation["f1"])
    assert (tmp_path / "eval" / "predictions.json").read_text() == (tmp_path / "run" / "predictions.json").read_text()


def test_eval_of_a_run_scores_its_newest_checkpoint_beside_it_without_a_new_run_directory(squad, tmp_path, capsys):
    """`bert.py eval --checkpoint-input auto` (and the old `--eval-only`) scores the newest checkpoint
    of the config's run directory, writing the scores in that run (eval-<checkpoint>, a new one each
    time), not in a new run directory beside it; with no run there, one line says so."""
    _, _, dev, _, _ = squad
    cfg = _squad_config(squad, tmp_path / "run", steps=4, checkpoint_every=2)
    cfg["data"]["dev_file"] = str(dev)
    trained = fine_tune(config_from_dict(cfg), progress=False)
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(cfg))
    capsys.readouterr()
    for n, command in enumerate([["eval", "--config", str(path), "--checkpoint-input", "auto"],
                                 ["--eval-only", "--config", str(path), "--checkpoint-input", "auto"]]):
        assert bert_cli()(command) == 0
        assert f"scoring {tmp_path / 'run' / 'checkpoint-final'}, the newest checkpoint" in capsys.readouterr().out
        scored = tmp_path / "run" / ("eval-checkpoint-final" + (f".{n}" if n else ""))
        results = json.loads((scored / "eval_results.json").read_text())
        assert results["f1"] == round_figure(trained.evaluation["f1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "squad.json"], "no new run directory"
    assert bert_cli()(["eval", "--config", str(path), "--checkpoint-input", "auto",
                       "--training.output_dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --checkpoint-input auto scores the newest checkpoint of the run directory {tmp_path / 'none'} "
        "(training.output_dir), which does not exist: train first, or name a checkpoint directory with "
        "--checkpoint-input")
