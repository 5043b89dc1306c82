"""`bert.py export-hf` of a GroupBERT: transformers loads it with the shipped remote code
(bert/hf_groupbert/, `trust_remote_code=True`) and gives the session's logits; what
transformers saves after a training step there imports back into the project's graph.

For every head (pre-training: MLM and NSP; SQuAD; classification; regression; tokens), a tiny,
oddly sized GroupBERT with random weights (biases and LayerNorms too, so every module counts)
is exported; one subprocess, in a temporary directory and without the project on its path,
loads each export with `AutoModelFor*` and `AutoTokenizer`, computes the logits and the loss
on the same padded batch, takes one AdamW step, saves the model and tokenizer, and checks that
no module of this project was imported. Here the logits and losses are compared with the
session's on the exported weights, and the saved directories, imported as `--checkpoint-input`
is, with the HF logits after the step (≤ 1e-5, tensor-relative).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from bert import ModelConfig, build_model, load_config, with_overrides
from bert.io.hf import load_hf_checkpoint, model_config_from_hf
from bert.io.sources import build_with_weights, starting_point
from data.demo import generate_documents
from data.vocab import make_tokenizer, train_vocab
from session import InferenceSession
from tests.helpers import assert_close, random_weights
from tests.tiny_runs import ROOT, bert_cli, bert_script, one_thread  # noqa: F401 (an autouse fixture)

# Tiny and oddly sized (STYLE.md 9), with every GroupBERT size off its default: hidden 48, 3 heads,
# FFN 3H in 3 groups, kernel 5 over groups of 8 channels, 40 positions, eps 1e-7.
SIZES = {"hidden_size": 48, "num_layers": 2, "num_heads": 3, "ffn_multiplier": 3, "ffn_groups": 3, "conv_kernel": 5,
         "conv_group_size": 8, "vocab_size": 101, "max_positions": 40, "sequence_length": 24, "max_predictions": 5,
         "layer_norm_eps": 1e-7}
LABELS = {"classification": ["neg", "neutral", "pos"], "tokens": ["O", "B-PER", "I-PER", "B-LOC"]}
# Each task: the config it runs with here, and the transformers Auto class that loads its export.
TASKS = {"pretraining": ("groupbert_tiny.json", "AutoModelForPreTraining"),
         "squad": ("squad_groupbert_base.json", "AutoModelForQuestionAnswering"),
         "classification": ("classify_groupbert_base.json", "AutoModelForSequenceClassification"),
         "regression": ("classify_groupbert_base.json", "AutoModelForSequenceClassification"),
         "tokens": ("tokens_groupbert_base.json", "AutoModelForTokenClassification")}
PROJECT_PACKAGES = ("bert", "builder", "session", "custom_ops", "data", "fileio", "launch")
TEXTS = ["Anna Berg was born in Lund.", "The Café Company (founded 1901) makes BREAD."]
ROWS = 3  # row r holds 24 - 7r tokens, then padding

# Run in the subprocess: transformers and torch only. argv: the work directory (tasks.json lists
# the exports, their Auto class and inputs); writes result.json and <task>.npz there.
HF_SIDE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np, torch, transformers

    torch.set_num_threads(1)
    work = Path(sys.argv[1])
    result = {"tokenized": {}}
    for task, job in json.loads((work / "tasks.json").read_text()).items():
        out = Path(job["out"])
        t = {k: torch.from_numpy(v) for k, v in np.load(job["inputs"]).items()}
        encoder = dict(input_ids=t["input_ids"], token_type_ids=t["segment_ids"], attention_mask=t["input_mask"])
        auto = getattr(transformers, job["auto"])
        model, info = auto.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
        got, labels = {}, {k: t[k] for k in job["labels"]}
        model.eval()  # no dropout: the loss is the session's; backward works all the same
        output = model(**encoder, **labels)
        for name in job["logits"]:
            got[name] = output[name].detach().numpy()
        got["loss"] = output.loss.detach().numpy()
        if task == "pretraining":  # the MLM head alone, and the encoder
            mlm = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).eval()
            got["masked_lm_logits"] = mlm(**encoder).logits.detach().numpy()
        if task == "classification":
            base = transformers.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
            got["last_hidden_state"] = base(**encoder).last_hidden_state.detach().numpy()
            # Each attention kernel of transformers' interface, forward and backward.
            result["attention"] = {"default": model.config._attn_implementation}
            for kind in ("sdpa", "eager"):
                other = auto.from_pretrained(out, trust_remote_code=True, attn_implementation=kind).eval()
                result["attention"][kind] = other.config._attn_implementation
                said = other(**encoder, **labels)
                said.loss.backward()
                got[f"logits_{kind}"] = said.logits.detach().numpy()
                query = other.bert.encoder.layer[0].attention.self.query.weight
                got[f"query_grad_{kind}"] = query.grad.numpy()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        output.loss.backward()
        optimizer.step()
        with torch.no_grad():
            after = model(**encoder)
        for name in job["logits"]:
            got[f"{name}_after"] = after[name].numpy()
        saved = work / f"{task}-saved"
        model.save_pretrained(saved)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        tokenizer.save_pretrained(saved)
        np.savez(work / f"{task}.npz", **got)
        result[task] = {"class": type(model).__name__, "loading": {k: sorted(map(str, v)) for k, v in info.items()},
                        "saved": str(saved)}
        # Without trust_remote_code (transformers asks, stdin answers nothing): the same BertTokenizer.
        plain = transformers.AutoTokenizer.from_pretrained(out)
        result["tokenized"][task] = [type(plain).__name__, plain(job["texts"])["input_ids"],
                                  tokenizer(job["texts"])["input_ids"]]
    result["project_modules"] = sorted(m for m in sys.modules if m.split(".")[0] in job["project"])
    (work / "result.json").write_text(json.dumps(result))
""")


def _arguments(task: str) -> list[str]:
    config, _ = TASKS[task]
    args = ["--config", str(ROOT / "configs" / config), "--model.task", task]
    args += [a for key, value in SIZES.items() for a in (f"--model.{key}", str(value))]
    if task in LABELS:
        args += ["--model.labels", json.dumps(LABELS[task])]
    return args


def _config(task: str, sized: bool = True):
    """The run's config: the export's sizes and labels, or (sized=False, an import) the config
    file's, with only the task and the batch's shape: the rest must come from config.json."""
    overrides = _arguments(task)[2:] if sized else ["--model.task", task, "--model.sequence_length",
                                                     str(SIZES["sequence_length"]), "--model.max_predictions",
                                                     str(SIZES["max_predictions"])]
    return with_overrides(load_config(ROOT / "configs" / TASKS[task][0]), bert_script().parse_overrides(overrides))


def _inputs(task: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Padded rows (24, 17, 10 tokens; segment 1 from the middle) and the task's labels."""
    s = SIZES["sequence_length"]
    ids, mask, segments = (np.zeros((ROWS, s), np.int64) for _ in range(3))
    for r in range(ROWS):
        n = s - 7 * r
        ids[r, :n], mask[r, :n], segments[r, n // 2 : n] = rng.integers(5, SIZES["vocab_size"], n), 1, 1
    feeds = {"input_ids": ids, "segment_ids": segments, "input_mask": mask}
    if task == "pretraining":
        positions = np.stack([np.sort(rng.choice(np.arange(1, s - 7 * r), SIZES["max_predictions"], replace=False))
                              for r in range(ROWS)])
        feeds.update(masked_lm_positions=positions, masked_lm_ids=rng.integers(5, SIZES["vocab_size"], positions.shape),
                     next_sentence_labels=np.array([0, 1, 0]))
    elif task == "squad":
        feeds.update(start_positions=np.array([3, 15, 7]), end_positions=np.array([5, 16, 9]))
    elif task == "regression":
        feeds["labels"] = np.array([0.5, -1.25, 2.0], np.float32)
    elif task == "tokens":
        feeds["labels"] = np.where(mask == 1, rng.integers(0, len(LABELS["tokens"]), mask.shape), -100)
    else:
        feeds["labels"] = np.array([2, 0, 1])
    return feeds


def _hf_labels(task: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The labels as the BertFor* classes take them."""
    if task == "pretraining":  # (B, S): the masked token at its position, -100 elsewhere
        labels = np.full_like(feeds["input_ids"], -100)
        np.put_along_axis(labels, feeds["masked_lm_positions"], feeds["masked_lm_ids"], axis=1)
        return {"labels": labels, "next_sentence_label": feeds["next_sentence_labels"]}
    if task == "squad":
        return {k: feeds[k] for k in ("start_positions", "end_positions")}
    return {"labels": feeds["labels"]}


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    sentences = [s for doc in generate_documents(60, seed=3) for s in doc]
    return train_vocab(sentences, SIZES["vocab_size"], tmp_path_factory.mktemp("vocab") / "vocab.txt",
                       lower_case=False).path


@pytest.fixture(scope="module")
def exported(vocab, tmp_path_factory):
    """Per task: the session's outputs on the exported weights (with the loss), and what the HF
    side computed and saved; the subprocess's result.json."""
    work = tmp_path_factory.mktemp("groupbert_hf")
    rng = np.random.default_rng(7)
    sessions, jobs = {}, {}
    for task, (_, auto) in TASKS.items():
        config = _config(task)
        proto = build_model(config.model, with_loss=True).builder.model_proto()
        random_weights(proto, rng)
        source = work / f"{task}.onnx"
        source.write_bytes(proto.SerializeToString())
        out = work / f"{task}-hf"
        assert bert_cli()(["export-hf", *_arguments(task), "--training.init_from", str(source), "--data.vocab_file",
                           str(vocab), "--data.lower_case", "false", "--output", str(out)]) == 0
        feeds = _inputs(task, rng)
        sessions[task] = {k: v.numpy() for k, v in InferenceSession(proto).run(feeds).items()}
        np.savez(work / f"{task}-inputs.npz", **{**feeds, **_hf_labels(task, feeds)})
        logits = {"pretraining": ["prediction_logits", "seq_relationship_logits"],
                  "squad": ["start_logits", "end_logits"]}.get(task, ["logits"])
        jobs[task] = {"out": str(out), "auto": auto, "inputs": str(work / f"{task}-inputs.npz"), "logits": logits,
                      "labels": list(_hf_labels(task, feeds)), "texts": TEXTS, "project": PROJECT_PACKAGES}
    (work / "tasks.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, "-c", HF_SIDE, str(work)], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((work / "result.json").read_text())
    hf = {task: dict(np.load(work / f"{task}.npz")) for task in TASKS}
    return {"work": work, "sessions": sessions, "hf": hf, "result": result,
            "feeds": {task: dict(np.load(work / f"{task}-inputs.npz")) for task in TASKS}}


def _session_logits(task: str, outputs: dict) -> dict[str, np.ndarray]:
    """The session's logits under transformers' names (its MLM logits are at the masked positions
    only: HF's, at every position, are gathered there to compare)."""
    if task == "pretraining":
        return {"prediction_logits": outputs["mlm_logits"], "seq_relationship_logits": outputs["nsp_logits"]}
    if task == "squad":
        return {"start_logits": outputs["start_logits"], "end_logits": outputs["end_logits"]}
    return {"logits": outputs["logits"]}


def _at_masked(logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return np.take_along_axis(logits, positions[..., None], axis=1)  # (B, S, V) → (B, P, V)


def test_transformers_loads_the_code_alone(exported):
    result = exported["result"]
    assert result["project_modules"] == [], f"the remote code imported the project: {result['project_modules']}"
    for task, (_, auto) in TASKS.items():
        assert result[task]["loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                                           "error_msgs": []}, (task, result[task]["loading"])
        out = exported["work"] / f"{task}-hf"
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "groupbert" and config["architectures"] == [result[task]["class"]]
        assert config["auto_map"][auto].endswith(result[task]["class"])
        assert sorted(p.name for p in out.iterdir()) == [
            "config.json", "configuration_groupbert.py", "model.safetensors", "modeling_groupbert.py",
            "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]
        assert (out / "modeling_groupbert.py").read_text() == (
            ROOT / "bert" / "hf_groupbert" / "modeling_groupbert.py").read_text()
    assert json.loads((exported["work"] / "classification-hf" / "config.json").read_text())["id2label"] == {
        str(i): name for i, name in enumerate(LABELS["classification"])}


@pytest.mark.parametrize("task", list(TASKS))
def test_transformers_gives_the_sessions_logits_and_loss(exported, task):
    hf, session, feeds = exported["hf"][task], exported["sessions"][task], exported["feeds"][task]
    for name, want in _session_logits(task, session).items():
        got = _at_masked(hf[name], feeds["masked_lm_positions"]) if name == "prediction_logits" else hf[name]
        assert_close(got, want, 1e-5, f"{task}: transformers {name} vs the session's")
    assert_close(hf["loss"], session["loss"], 1e-5, f"{task}: transformers loss vs the session's")
    if task == "pretraining":
        assert_close(_at_masked(hf["masked_lm_logits"], feeds["masked_lm_positions"]), session["mlm_logits"], 1e-5,
                     "GroupBertForMaskedLM logits vs the session's")


def test_the_attention_kernels_of_transformers_interface_agree_forward_and_backward(exported):
    """The remote code calls the kernel `attn_implementation` names (sdpa by default, as
    transformers' own BERT): SDPA and the written-out eager attention give the session's
    logits and the same gradients."""
    assert exported["result"]["attention"] == {"default": "sdpa", "sdpa": "sdpa", "eager": "eager"}
    hf, session = exported["hf"]["classification"], exported["sessions"]["classification"]
    for kind in ("sdpa", "eager"):
        assert_close(hf[f"logits_{kind}"], session["logits"], 1e-5, f"{kind} attention's logits vs the session's")
    assert np.abs(hf["query_grad_eager"]).max() > 0
    assert_close(hf["query_grad_sdpa"], hf["query_grad_eager"], 1e-5, "the query weight's gradient, sdpa vs eager")


def test_auto_model_gives_the_sessions_sequence_output(exported):
    """The encoder's output (the final LayerNorm's), read from the classification graph."""
    proto = onnx.load(str(exported["work"] / "classification.onnx"))
    final = next(n.output[0] for n in proto.graph.node if "bert.encoder.LayerNorm.weight" in n.input)
    proto.graph.output.append(onnx.helper.make_tensor_value_info(final, onnx.TensorProto.FLOAT, None))
    feeds = exported["feeds"]["classification"]
    want = InferenceSession(proto).run(feeds)[final]
    assert_close(exported["hf"]["classification"]["last_hidden_state"], want, 1e-5,
                 "GroupBertModel last_hidden_state vs the session's")


@pytest.mark.parametrize("task", list(TASKS))
def test_what_transformers_saves_after_a_step_imports_back(exported, vocab, task):
    saved = Path(exported["result"][task]["saved"])
    assert (saved / "modeling_groupbert.py").is_file() and "auto_map" in json.loads((saved / "config.json").read_text())
    start = starting_point(_config(task, sized=False), str(saved))
    assert (start.vocab.text.split(), start.vocab.lower_case) == (vocab.read_text().split(), False)
    assert {k: getattr(start.model, k) for k in SIZES} == SIZES, "the sizes are config.json's"
    assert start.model.labels == (tuple(LABELS[task]) if task in LABELS else None), "the labels are id2label's"
    proto, missing = build_with_weights(start.model, start, with_loss=False)
    assert missing == []
    feeds = exported["feeds"][task]
    outputs = {k: v.numpy() for k, v in InferenceSession(proto).run(
        {k: feeds[k] for k in ("input_ids", "segment_ids", "input_mask", "masked_lm_positions") if k in feeds}).items()}
    hf = exported["hf"][task]
    for name, got in _session_logits(task, outputs).items():
        after = hf[f"{name}_after"]
        want = _at_masked(after, feeds["masked_lm_positions"]) if name == "prediction_logits" else after
        before = _at_masked(hf[name], feeds["masked_lm_positions"]) if name == "prediction_logits" else hf[name]
        assert np.abs(want - before).max() > 1e-3, f"{task}: the step did not move {name}"
        assert_close(got, want, 1e-5, f"{task}: the imported graph's {name} vs transformers' after its step")


def test_auto_tokenizer_tokenizes_as_this_project(exported, vocab):
    ours = [e.ids for e in make_tokenizer(vocab, lower_case=False).encode_batch(TEXTS)]
    for task, (name, plain, trusted) in exported["result"]["tokenized"].items():
        assert name.startswith("BertTokenizer"), (task, name)
        assert plain == ours and trusted == ours, f"{task}: AutoTokenizer tokenizes otherwise than this project"


def test_a_checkpoint_of_the_other_architecture_is_refused_in_one_line(exported, tmp_path, capsys):
    groupbert = exported["result"]["classification"]["saved"]
    code = bert_cli()(["export-hf", "--config", str(ROOT / "configs/bert_tiny.json"), "--checkpoint-input", groupbert,
                       "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "model_type is 'groupbert' and the run's model.architecture 'bert'" in err
    assert "--model.architecture groupbert" in err and not (tmp_path / "out").exists()
    # A BERT (model_type 'bert') into a GroupBERT run, and a model type neither imports.
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=1,
                                                   num_attention_heads=3, intermediate_size=96)).save_pretrained(
        tmp_path / "bert")
    (tmp_path / "bert" / "vocab.txt").write_text((exported["work"] / "classification-hf" / "vocab.txt").read_text())
    capsys.readouterr()  # transformers' progress bar
    code = bert_cli()(["export-hf", *_arguments("classification"), "--checkpoint-input", str(tmp_path / "bert"),
                       "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "model_type is 'bert' and the run's model.architecture 'groupbert'" in err
    base = ModelConfig(architecture="groupbert", hidden_size=48, num_layers=1, num_heads=3)
    hf = json.loads((Path(groupbert) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^x/config.json: model_type is 'roberta'; only BERT .* GroupBERT") as error:
        model_config_from_hf({**hf, "model_type": "roberta"}, base, where="x/config.json")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^x/config.json: conv_kernel_size is 'seven', not a whole number$"):
        model_config_from_hf({**hf, "conv_kernel_size": "seven"}, base, where="x/config.json")
    with pytest.raises(ValueError, match=r"^x/config.json: the weights' sizes do not fit .*conv_kernel 4 must be odd"):
        model_config_from_hf({**hf, "conv_kernel_size": 4}, base, where="x/config.json")
    # Saved without the tokenizer: no vocab to tokenize with.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((Path(groupbert) / name).read_bytes())
    with pytest.raises(ValueError, match="has no vocab.txt nor a WordPiece tokenizer.json .*tokenizer.save_pretrained"):
        load_hf_checkpoint(bare)
