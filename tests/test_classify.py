"""Fine-tuning on labelled rows (bert/tasks/labelled.py) against HuggingFace's BertForSequenceClassification
and BertForTokenClassification: the same starting weights (an HF directory), the same files and
batches, AdamW on both sides; the losses of every step agree.
"""
import json
import re

import numpy as np
import pytest
import torch
import transformers

from bert.tasks.labelled import fine_tune
from bert.config import config_from_dict
from tests.tiny_runs import one_thread  # noqa: F401 (autouse)

WORDS = ("the a cat dog bird sat ran flew on under over mat tree house red green blue big small old new quick slow "
         "happy sad river town hill john mary paris london monday").split()
S = 16
STEPS = 5


def write_vocab(path):
    pieces = ["##s", "##ed", "##ing", "##er"]
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", *WORDS, *pieces]) + "\n")
    return path


def sentence(rng, low=3, high=12):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(low, high))))


def hf_directory(tmp_path, cls, labels):
    """A random tiny BERT with a task head, saved as HF saves it, with its vocab."""
    directory = tmp_path / "hf"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(WORDS) + 11, hidden_size=48, num_hidden_layers=2,
                                     num_attention_heads=3, intermediate_size=192, max_position_embeddings=40,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=len(labels),
                                     id2label=dict(enumerate(labels)), label2id={k: i for i, k in enumerate(labels)})
    cls(config).save_pretrained(directory)
    write_vocab(directory / "vocab.txt")
    return directory


def run_config(tmp_path, hf, task, data, **model):
    return config_from_dict({
        "version": 2, "name": task,
        "model": {"architecture": "bert", "task": task, "hidden_size": 48, "num_layers": 2, "num_heads": 3,
                  "sequence_length": S, "max_predictions": 5, **model},
        "data": data,
        "training": {"steps": STEPS, "init_from": str(hf), "output_dir": str(tmp_path / "run"), "log_every": 1},
        "optimizer": {"name": "adamw", "learning_rate": 2e-3, "weight_decay": 0.01},
        "schedule": {"decay": "constant"},
        "batch": {"micro_batch_size": 8},
    })


def hf_losses(model, batches):
    """Losses of STEPS AdamW steps of `model` (torch.optim.AdamW, no decay on biases and LayerNorm)."""
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=2e-3, betas=(0.9, 0.999), eps=1e-6)
    losses = []
    for step in range(STEPS):
        loss = model(**batches).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def our_losses(result):
    return [r["loss"] for r in result.metrics]


def check_hf_export(tmp_path, run, auto_class, batch, labels):
    """`bert.py export-hf` of the run's final checkpoint: transformers' Auto class loads it cleanly,
    with the labels in the head's order and the session's logits (InferenceSession of the
    checkpoint's own graph) to 1e-5; saved again by transformers, it imports with those labels."""
    from bert.io.sources import starting_point
    from session import InferenceSession
    from tests.tiny_runs import bert_cli

    out = tmp_path / "hf_export"
    assert bert_cli()(["export-hf", "--config", str(run / "config.json"), "--checkpoint-input",
                       str(run / "checkpoint-final"), "--output", str(out)]) == 0
    hf, info = auto_class.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not any(info.values()), info
    assert [hf.config.id2label[i] for i in range(len(labels))] == labels
    feeds = {"input_ids": batch["input_ids"].numpy(), "segment_ids": batch["token_type_ids"].numpy(),
             "input_mask": batch["attention_mask"].numpy(), "labels": batch["labels"].numpy()}  # a training graph
    want = InferenceSession(run / "checkpoint-final" / "model.onnx").run(feeds)["logits"]
    with torch.no_grad():
        got = hf.eval()(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                        attention_mask=batch["attention_mask"]).logits
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    hf.save_pretrained(tmp_path / "saved_by_hf")
    (tmp_path / "saved_by_hf" / "vocab.txt").write_text((out / "vocab.txt").read_text())
    config = config_from_dict(json.loads((run / "config.json").read_text()))
    config = config.model_copy(update={"model": config.model.model_copy(update={"labels": None, "num_labels": None})})
    assert starting_point(config, str(tmp_path / "saved_by_hf")).model.labels == tuple(labels)


def test_a_head_with_unnamed_labels_exports_and_serves_by_transformers_names(tmp_path, capsys):
    """A classifier fine-tuned in transformers without label names (id2label LABEL_0, ...) needed
    --model.num_labels to export, and its export then could not be served ("names no labels"):
    the head's width is its own, and the export names its outputs as transformers does."""
    import infer
    from session.export import metadata
    from tests.tiny_runs import ROOT, bert_cli

    hf = hf_directory(tmp_path, transformers.BertForSequenceClassification, ["LABEL_0", "LABEL_1", "LABEL_2"])
    model = tmp_path / "m.onnx"
    assert bert_cli()(["export", "--config", str(ROOT / "configs/classify_demo.json"), "--checkpoint-input", str(hf),
                       "--output", str(model)]) == 0
    assert "note: the labels of HuggingFace checkpoint" in capsys.readouterr().out
    assert json.loads(metadata(model)["labels"]) == ["LABEL_0", "LABEL_1", "LABEL_2"]
    assert infer.main(["--model", str(model), "--task", "classify", "--text", "the cat sat", "--no-progress"]) == 0
    assert sorted(label for label, _ in re.findall(r"(LABEL_\d) (\d\.\d+)", capsys.readouterr().out)) == \
        ["LABEL_0", "LABEL_1", "LABEL_2"]


PACKED = pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])


@PACKED
@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
def test_sequence_classification_trains_as_hf_bert_for_sequence_classification(tmp_path, monkeypatch, capsys, pairs,
                                                                             packed):
    """Padded, or packed (each micro-batch's rows packed; the same rows and mean loss). The
    log's model FLOP/s count the graph rows each step ran: fewer than its samples when packed."""
    from bert.run.budget import flops_per_row
    from session.training import TrainingSession

    ran, run = [], TrainingSession.run
    monkeypatch.setattr(TrainingSession, "run", lambda self, batch, *a: ran.append(len(batch["input_ids"])) or
                        run(self, batch, *a))
    labels = ["neg", "neutral", "pos"]
    rng = np.random.default_rng(1)
    rows = [(sentence(rng), sentence(rng, 6, 14), labels[i % 3]) for i in range(8)]
    columns = ["sentence1", "sentence2"] if pairs else ["sentence1"]
    train = tmp_path / "train.tsv"
    train.write_text("sentence1\tsentence2\tlabel\n" + "".join(f"{a}\t{b}\t{y}\n" for a, b, y in rows))
    hf = hf_directory(tmp_path, transformers.BertForSequenceClassification, labels)
    config = run_config(tmp_path, hf, "classification", {"train_file": str(train), "text_columns": columns,
                                                         "label_column": "label"}, packed=packed)
    result = fine_tune(config, progress=False)
    ours = our_losses(result)

    tokenizer = transformers.BertTokenizerFast(vocab=str(hf / "vocab.txt"), do_lower_case=True)
    texts = ([a for a, _, _ in rows], [b for _, b, _ in rows]) if pairs else ([a for a, _, _ in rows],)
    batch = tokenizer(*texts, truncation="longest_first", max_length=S, padding="max_length", return_tensors="pt")
    batch["labels"] = torch.tensor([labels.index(y) for _, _, y in rows])
    reference = hf_losses(transformers.BertForSequenceClassification.from_pretrained(hf), dict(batch))
    assert len(ours) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
    assert reference[-1] < reference[0], "the steps learnt nothing: the comparison would be weak"
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert saved["labels"] == labels and saved["num_labels"] == 3 and saved["packed"] is packed

    per_row = flops_per_row(config_from_dict(json.loads((tmp_path / "run" / "config.json").read_text())).model)
    # A pair of these sentences fills most of a row: packed, it still takes one.
    assert len(ran) == STEPS and (min(ran) < 8) == (packed and not pairs) and max(ran) <= 8, ran
    for rows, record in zip(ran, result.metrics):  # one step per record; its seconds: 8 samples / sequences_per_s
        assert record["tflops"] == pytest.approx(per_row * rows * record["sequences_per_s"] / 8 / 1e12, rel=2e-3)
    said = (f"model FLOPs: {per_row:.4g} per row, a step's rows as its micro-batches pack (global batch 8 samples); "
            if packed else f"model FLOPs: {per_row * 8:.4g} per step; ")
    assert said + "MFU against " in capsys.readouterr().out
    if not packed:  # the export's check runs the checkpoint's own (padded) training graph
        check_hf_export(tmp_path, tmp_path / "run", transformers.AutoModelForSequenceClassification, batch, labels)


@PACKED
def test_regression_trains_as_hf_with_mean_squared_error(tmp_path, packed):
    rng = np.random.default_rng(2)
    rows = [(sentence(rng), float(rng.uniform(0, 5))) for _ in range(8)]
    train = tmp_path / "train.csv"
    train.write_text("text,score\n" + "".join(f"{a},{y:.3f}\n" for a, y in rows))
    hf = hf_directory(tmp_path, transformers.BertForSequenceClassification, ["score"])
    config = run_config(tmp_path, hf, "regression", {"train_file": str(train), "text_columns": ["text"],
                                                     "label_column": "score"}, packed=packed)
    ours = our_losses(fine_tune(config, progress=False))

    tokenizer = transformers.BertTokenizerFast(vocab=str(hf / "vocab.txt"), do_lower_case=True)
    batch = tokenizer([a for a, _ in rows], truncation=True, max_length=S, padding="max_length", return_tensors="pt")
    batch["labels"] = torch.tensor([float(f"{y:.3f}") for _, y in rows])
    model = transformers.BertForSequenceClassification.from_pretrained(hf, problem_type="regression")
    np.testing.assert_allclose(ours, hf_losses(model, dict(batch)), rtol=1e-5)
    if not packed:
        check_hf_export(tmp_path, tmp_path / "run", transformers.AutoModelForSequenceClassification, batch, ["score"])


@PACKED
def test_token_classification_trains_as_hf_bert_for_token_classification(tmp_path, packed):
    tags = ["B-LOC", "B-PER", "I-PER", "O"]
    rng = np.random.default_rng(3)
    sentences = []
    for _ in range(8):
        words = list(rng.choice(WORDS, size=int(rng.integers(3, 14))))  # some longer than S: truncated
        sentences.append([(w, "B-PER" if w in ("john", "mary") else "B-LOC" if w in ("paris", "london") else "O")
                          for w in words])
        sentences[-1][0] = ("johns", "B-PER")  # a word of two sub-words: john ##s
        sentences[-1][1] = ("mary", "I-PER")
    train = tmp_path / "train.conll"
    train.write_text("-DOCSTART- -X- -X- O\n\n" + "\n\n".join(
        "\n".join(f"{w} NN B-NP {t}" for w, t in s) for s in sentences) + "\n")
    hf = hf_directory(tmp_path, transformers.BertForTokenClassification, tags)
    config = run_config(tmp_path, hf, "tokens", {"train_file": str(train)}, packed=packed)
    ours = our_losses(fine_tune(config, progress=False))

    # HF's run_ner labelling: the first sub-word of each word its tag, everything else -100.
    tokenizer = transformers.BertTokenizerFast(vocab=str(hf / "vocab.txt"), do_lower_case=True)
    batch = tokenizer([[w for w, _ in s] for s in sentences], is_split_into_words=True, truncation=True,
                      max_length=S, padding="max_length", return_tensors="pt")
    labels = torch.full((len(sentences), S), -100)
    for i, s in enumerate(sentences):
        previous = None
        for position, word in enumerate(batch.word_ids(i)):
            if word is not None and word != previous:
                labels[i, position] = tags.index(s[word][1])
            previous = word
    batch["labels"] = labels
    reference = hf_losses(transformers.BertForTokenClassification.from_pretrained(hf), dict(batch))
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
    if not packed:
        check_hf_export(tmp_path, tmp_path / "run", transformers.AutoModelForTokenClassification, batch, tags)


# ------------------------------------------------------- through bert.py, GroupBERT
def tiny_groupbert(tmp_path, task, train, dev=None, **data):
    """bert.py arguments of a tiny GroupBERT fine-tuning run from random weights."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    config = tmp_path / f"{task}.json"
    config.write_text(json.dumps({
        "version": 2, "name": task,
        "model": {"architecture": "groupbert", "task": task, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "vocab_size": 50, "sequence_length": S, "max_predictions": 5, "max_positions": 32},
        "data": {"train_file": str(train), "vocab_file": str(vocab), **({"dev_file": str(dev)} if dev else {}),
                 **data},
        "training": {"steps": 6, "output_dir": str(tmp_path / "run"), "log_every": 1},
        "optimizer": {"name": "adamw", "learning_rate": 3e-3},
        "batch": {"micro_batch_size": 4}, "checkpoint": {"every": 3}}))
    return ["train", "--config", str(config)]


def labelled_rows(rng, count, labels=("no", "yes")):
    """Rows whose label says whether the sentence names an animal: learnable, not trivial."""
    rows = []
    for i in range(count):
        text = sentence(rng)
        rows.append((text, labels[int(any(w in text.split() for w in ("cat", "dog", "bird")))]))
    return rows


def write_tsv(path, rows, header="sentence\tlabel"):
    path.write_text(header + "\n" + "".join(f"{a}\t{y}\n" for a, y in rows))
    return path


BAD = {
    "missing column": ("sentence\tlabel", "text_columns=[\"text\"]", "no column 'text'"),
    "unseen dev label": ("sentence\tlabel", "dev label maybe", "label 'maybe' is not among"),
    "broken row": ("sentence\tlabel", "train row with a tab", "3 fields where the header has 2"),
    "empty file": ("", "", "has no rows"),
    "labels beyond the head": ("sentence\tlabel", "model.num_labels=1", "more than the head's model.num_labels 1"),
    "one label": ("sentence\tlabel", "train labels yes", "has one label ('yes' in all 12 rows)"),
    "real-number labels": ("sentence\tlabel", "train labels 0.25 steps",
                           "numbers, 9 of them fractional (e.g. '0.25'): a classifier would make a class of each"),
    "header under indices": ("sentence\tlabel", "columns by index",
                             "line 1 looks like a header row (its label 'label' is found in no other row"),
    "line too long": ("sentence\tlabel", "data.max_line_bytes=16", "longer than data.max_line_bytes 16"),
    "a directory": ("sentence\tlabel", "train file a directory", "is a directory, not a data file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_labelled_files_are_one_error_line_and_write_nothing(tmp_path, capsys, case):
    from tests.tiny_runs import bert_cli

    header, change, expected = BAD[case]
    rng = np.random.default_rng(5)
    rows = labelled_rows(rng, 12)
    if change == "train labels yes":
        rows = [(text, "yes") for text, _ in rows]
    elif change == "train labels 0.25 steps":
        rows = [(text, str(i * 0.25)) for i, (text, _) in enumerate(rows)]
    train, dev = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    write_tsv(train, rows, header) if header else train.write_text("")
    dev_rows = rows[:4] + ([("a cat sat", "maybe")] if change == "dev label maybe" else [])
    write_tsv(dev, dev_rows)
    if change == "train row with a tab":
        train.write_text(train.read_text() + "a dog\tsat on the mat\tyes\n")
    columns = dict(text_columns=[0], label_column=1) if change == "columns by index" else \
        dict(text_columns=["sentence"], label_column="label")
    if change == "train file a directory":
        train = tmp_path / "corpus"
        train.mkdir()
    argv = tiny_groupbert(tmp_path, "classification", train, dev, **columns)
    if change.startswith("text_columns="):
        argv += ["--data." + change]
    elif change.startswith(("model.", "data.")):
        argv += ["--" + change]
    assert bert_cli()(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "run").exists(), "a rejected run writes nothing"


def test_a_token_file_without_iob_tags_is_one_error_line(tmp_path, capsys):
    from tests.tiny_runs import bert_cli

    train = tmp_path / "train.conll"
    train.write_text("John S-PER\nsat O\n\nMary S-PER\nran O\n")
    assert bert_cli()(tiny_groupbert(tmp_path, "tokens", train)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "line 1: tag 'S-PER' is not O, B-TYPE or I-TYPE" in err, err
    assert not (tmp_path / "run").exists()


@PACKED
def test_groupbert_classification_resumes_exactly_and_eval_scores_as_the_run(tmp_path, capsys, packed):
    """A tiny GroupBERT classifier, padded or packed: a run resumed from its middle checkpoint
    continues bit for bit; its dev figures are scikit-learn's on its own predictions file;
    `bert.py eval` of its final checkpoint gives the same figures."""
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    from tests.tiny_runs import bert_cli

    rng = np.random.default_rng(6)
    train = write_tsv(tmp_path / "train.tsv", labelled_rows(rng, 24))
    dev = write_tsv(tmp_path / "dev.tsv", labelled_rows(rng, 10))
    argv = tiny_groupbert(tmp_path, "classification", train, dev, text_columns=["sentence"], label_column="label")
    argv += ["--model.packed", "true" if packed else "false"]
    main = bert_cli()
    assert main(argv) == 0
    run = tmp_path / "run"
    figures = json.loads((run / "eval_results.json").read_text())
    predicted = [line.split("\t") for line in (run / "predictions.tsv").read_text().splitlines()[1:]]
    assert [int(p[0]) for p in predicted] == list(range(2, 12)), "each prediction names its dev file line"
    guess, gold = [p[1] for p in predicted], [p[2] for p in predicted]
    assert gold == [y for _, y in labelled_rows(np.random.default_rng(6), 34)[24:]]
    assert figures["accuracy"] == pytest.approx(accuracy_score(gold, guess), abs=1e-9)
    assert figures["f1"] == pytest.approx(f1_score(gold, guess, pos_label="yes", zero_division=0), abs=1e-9)
    assert figures["matthews_correlation"] == pytest.approx(matthews_corrcoef(gold, guess), abs=1e-9)

    assert main([*argv, "--training.output_dir", str(tmp_path / "resumed"),
                 "--checkpoint-input", str(run / "checkpoint-3")]) == 0
    for name in ("model.onnx",):
        assert (tmp_path / "resumed" / "checkpoint-final" / name).read_bytes() == \
            (run / "checkpoint-final" / name).read_bytes(), "a resumed run continues bit for bit"

    capsys.readouterr()
    assert main(["eval", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final")]) == 0
    scored = sorted(run.glob("eval-checkpoint-final*"))
    assert scored, capsys.readouterr().out
    assert json.loads((scored[0] / "eval_results.json").read_text()) == figures


def test_predicted_tags_map_first_sub_words_back_to_words(tmp_path):
    """Logits that put each word's gold tag first at its first sub-word (and anything elsewhere)
    predict the gold tags; words past the sequence are O."""
    from bert.tasks.labelled import Labelled, figures

    words = [["johns", "sat", "in", "paris"], ["mary", "ran"] * 9]  # the second is longer than S
    tags = [["B-PER", "O", "O", "B-LOC"], ["B-PER", "O"] * 9]
    train = tmp_path / "train.conll"
    train.write_text("\n\n".join("\n".join(f"{w} {t}" for w, t in zip(ws, ts)) for ws, ts in zip(words, tags)) + "\n")
    argv = tiny_groupbert(tmp_path, "tokens", train, train)
    config = config_from_dict(json.loads(open(argv[2]).read()))
    job = Labelled(config)
    labels = job.config.model.labels
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, S, len(labels)))
    first = job.dev.arrays["word_index"] >= 0
    logits[first, job.dev.arrays["labels"][first]] = 10.0
    found = figures(job.config.model, job.dev, logits)[1]  # the tags predicted (bert/tasks/targets.py Tags)
    assert found[0] == tags[0]
    kept = int(first[1].sum())
    assert kept < len(words[1]) and found[1] == tags[1][:kept] + ["O"] * (len(words[1]) - kept)


@pytest.mark.slow
def test_two_sharded_replicas_tag_as_one_process_with_twice_the_accumulation(tmp_path):
    """torchrun: two replicas with RTS train the tagger as one process with twice the
    accumulation, and score the dev file (each replica a share, gathered) alike."""
    from tests.test_distributed import torchrun
    from tests.tiny_runs import bert_cli

    rng = np.random.default_rng(7)
    for name, count in (("train", 16), ("dev", 7)):
        (tmp_path / f"{name}.conll").write_text("\n\n".join("\n".join(
            f"{w} {'B-PER' if w in ('john', 'mary') else 'B-LOC' if w in ('paris', 'london') else 'O'}"
            for w in rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(count)) + "\n")
    argv = tiny_groupbert(tmp_path, "tokens", tmp_path / "train.conll", tmp_path / "dev.conll")
    config = json.loads(open(argv[2]).read())
    config["training"]["output_dir"] = str(tmp_path / "one")
    config["batch"] = {"micro_batch_size": 2, "gradient_accumulation": 2}
    (tmp_path / "one.json").write_text(json.dumps(config))
    assert bert_cli()(["train", "--config", str(tmp_path / "one.json")]) == 0
    config["training"]["output_dir"] = str(tmp_path / "two")
    config["batch"] = {"micro_batch_size": 2}
    config["parallel"] = {"replicated_tensor_sharding": True}
    (tmp_path / "two.json").write_text(json.dumps(config))
    result = torchrun(2, "bert.py", "--config", str(tmp_path / "two.json"))
    assert result.returncode == 0, result.stdout[-4000:]
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    losses = [[r["loss"] for r in records if "loss" in r] for records in (one, two)]
    assert len(losses[0]) == 6
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    figures = [json.loads((tmp_path / run / "eval_results.json").read_text()) for run in ("one", "two")]
    assert figures[0] == figures[1]
    assert (tmp_path / "one" / "predictions.conll").read_text() == (tmp_path / "two" / "predictions.conll").read_text()


def test_the_packed_stream_trains_on_the_rows_the_padded_stream_takes():
    """bert/tasks/labelled.py PackedFeatures: each step (2 replicas, 2 micro-batches each) holds the
    rows Features gives it, each micro-batch packed on its own into fewer, equal-sized rows."""
    from bert.tasks.labelled import PackedFeatures
    from bert.tasks.rows import Features

    rng = np.random.default_rng(9)
    lengths = rng.integers(3, 12, 40)
    mask = (np.arange(16) < lengths[:, None]).astype(np.int64)
    arrays = {"input_ids": np.where(mask == 1, rng.integers(5, 99, mask.shape), 0), "segment_ids": 0 * mask,
              "input_mask": mask, "labels": rng.integers(0, 3, 40)}

    def sequences(batch, micro):
        """Each micro-batch's rows as sorted (label, tokens)."""
        out = []
        for part in np.split(np.arange(len(batch["input_ids"])), micro):
            found = []
            for r in part:
                index = batch["sequence_index"][r].numpy() if "sequence_index" in batch else batch["input_mask"][r].numpy()
                for k in range(1, int(index.max()) + 1):
                    label = batch["labels"][r, k - 1] if batch["labels"].dim() == 2 else batch["labels"][r]
                    found.append((int(label), tuple(batch["input_ids"][r][index == k].tolist())))
            out.append(sorted(found))
        return out

    for replica in (0, 1):
        padded = iter(Features(arrays, 8, seed=4, replica=replica, replicas=2))
        packed = iter(PackedFeatures(arrays, 4, 2, slots=16, seed=4, replica=replica, replicas=2))
        for _ in range(4):  # past an epoch's end
            want, got = next(padded), next(packed)
            assert sequences(got, 2) == sequences(want, 2)
            assert len(got["input_ids"]) < len(want["input_ids"]) and len(got["input_ids"]) % 2 == 0
            assert (got["cls_positions"] < 16).all()


def test_a_one_class_fine_tune_is_named_by_its_run_and_eval_and_not_ranked_by_a_comparison(tmp_path, capsys,
                                                                                         monkeypatch):
    """All 8 fine-tunes of a replay predicted one class for every dev row and were ranked "level".
    A tiny classifier trained on 11 'no' to 1 'yes' at a high rate predicts 'no' for every dev row:
    its run and `bert.py eval` say so, eval_results.json records it, and the comparison's
    downstream verdict names it and ranks the others without it."""
    import yaml

    from bert.compare import compare_from_dict
    from bert.compare.downstream import Tuned, _degenerate, downstream_verdict
    from tests.tiny_runs import ROOT, bert_cli

    rng = np.random.default_rng(5)
    rows = labelled_rows(rng, 24)
    train = write_tsv(tmp_path / "train.tsv", [(text, "no" if i % 12 else "yes") for i, (text, _) in enumerate(rows)])
    dev = write_tsv(tmp_path / "dev.tsv", labelled_rows(rng, 10))
    argv = tiny_groupbert(tmp_path, "classification", train, dev, text_columns=["sentence"], label_column="label")
    assert bert_cli()([*argv, "--optimizer.learning_rate", "3e-2"]) == 0
    said = "warning: the model predicts one class ('no') for all 10 dev rows: it has not learned the task"
    assert said in capsys.readouterr().out
    run = tmp_path / "run"
    gold = [line.split("\t")[2] for line in (run / "predictions.tsv").read_text().splitlines()[1:]]
    assert {line.split("\t")[1] for line in (run / "predictions.tsv").read_text().splitlines()[1:]} == {"no"}
    assert set(gold) == {"no", "yes"}, "the dev set has both classes: one class predicted is the model's doing"
    assert json.loads((run / "eval_results.json").read_text())["degenerate"] == \
        "predicts one class ('no') for all 10 dev rows"
    assert bert_cli()(["eval", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final")]) == 0
    assert said in capsys.readouterr().out

    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "configs/compare/tiny.yaml").read_text())
    raw.pop("squad", None)
    spec = compare_from_dict(raw, "c.yaml")
    scores = {"accuracy": 0.7, "f1": 0.0, "matthews_correlation": 0.0}
    found = {"classify": [Tuned("bert", 0, scores, 10, run, _degenerate(run)),
                          Tuned("bert", 1, dict(scores, accuracy=0.6), 10, tmp_path),
                          Tuned("groupbert", 0, dict(scores, accuracy=0.5), 10, tmp_path)]}
    lines = downstream_verdict(spec, found)
    assert lines[0] == "- classification (classify_demo): bert (seed 0) predicts one class ('no') for all 10 dev " \
                       "rows: not ranked", lines
    assert lines[1].endswith("1. bert 0.6, 2. groupbert 0.5."), lines[1]
