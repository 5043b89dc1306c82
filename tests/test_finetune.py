"""SQuAD fine-tuning through `bert.py` (configs/squad_tiny.json) on a small generated SQuAD file:
it learns (F1 rises), writes its predictions and scores, resumes exactly, exports, and
onnxruntime (infer.py) answers the dev file with the same score."""
import json

import pytest

import infer
from bert import build_model, load_config, with_overrides
from bert.finetune import squad_scores
from data.squad import convert_examples_to_features, read_squad
from data.vocab import make_tokenizer
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)
from tests.squad_data import write_tiny_squad







@pytest.fixture(scope="module")
def squad(tmp_path_factory):
    d = tmp_path_factory.mktemp("squad")
    train, dev, vocab = write_tiny_squad(d)
    overrides = ["--data.train_file", str(train), "--data.dev_file", str(dev), "--data.vocab_file", str(vocab.path)]
    return d, train, dev, vocab, overrides


@pytest.mark.slow
def test_fine_tuning_raises_f1_and_onnxruntime_agrees(squad, tmp_path):
    d, train, dev, vocab, overrides = squad
    config = load_config(ROOT / "configs/squad_tiny.json")
    # Before training: the run's initial weights (drawn from (seed, name)) on the dev file.
    examples = read_squad(dev)
    features = convert_examples_to_features(examples, make_tokenizer(vocab.path), max_seq_length=64, doc_stride=24,
                                            max_query_length=16)
    untrained = build_model(config.model, with_loss=False, seed=config.training.seed).builder.model_proto()
    before = squad_scores(untrained, examples, features, 32)[0]

    run = tmp_path / "run"
    assert bert_cli()(["--config", str(ROOT / "configs/squad_tiny.json"), *overrides, "--training.output_dir", str(run)]) == 0
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

    # The exported fine-tuned model in onnxruntime gives the run's answers.
    exported = tmp_path / "squad.onnx"
    assert bert_cli()(["--config", str(ROOT / "configs/squad_tiny.json"), *overrides,
                   "--checkpoint-input", str(run / "checkpoint-final"), "--export", str(exported)]) == 0
    model = infer.OnnxModel(exported)
    scores, ort_predictions, _, _ = infer.answer_squad(model, str(dev))
    agree = sum(ort_predictions[q] == predictions[q] for q in predictions) / len(predictions)
    assert agree >= 0.97 and abs(scores["f1"] - results["f1"]) < 2.0, (scores, results, agree)
    # int8: quantized in onnxruntime, scored on the same file (figure recorded in docs/inference.md).
    int8 = infer.quantize(exported, tmp_path / "squad.int8.onnx")
    int8_scores, _, _, _ = infer.answer_squad(infer.OnnxModel(int8), str(dev))
    print(f"tiny SQuAD dev F1: before {before['f1']:.2f}, after {results['f1']:.2f}, onnxruntime {scores['f1']:.2f}, "
          f"int8 {int8_scores['f1']:.2f}")
    assert int8_scores["f1"] > before["f1"] + 10


def test_fine_tuning_resumes_exactly(squad, tmp_path):
    d, train, dev, vocab, overrides = squad
    base = with_overrides(load_config(ROOT / "configs/squad_tiny.json"), {
        "data.train_file": str(train), "data.vocab_file": str(vocab.path), "data.dev_file": None,
        "training.steps": 6, "training.warmup_steps": 2, "training.checkpoint_every": 3, "training.log_every": 1,
    })
    from bert.finetune import finetune

    whole = finetune(base.model_copy(update={"training": base.training.model_copy(
        update={"output_dir": str(tmp_path / "whole")})}), progress=False)
    first = [m["loss"] for m in whole.metrics]
    resumed = finetune(base.model_copy(update={"training": base.training.model_copy(
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
