"""Packed rows (`model.packed`) against the same sequences run alone, each in a padded row.

Every sequence of a packed batch must give the MLM and NSP (or SQuAD span) logits it
gives alone, and the batch the loss and weight gradients of the same sequences
unpacked (the losses are means over all masked tokens and all sequences, so the two
batches have one loss). The references are independent of the graph: HuggingFace's
BERT and the eager GroupBERT of tests/reference_groupbert.py, run on the unpacked rows;
the GroupBERT convolution at every sequence boundary is part of what is compared.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
import transformers

from bert import Config, build_model
from bert.io.export import export_run
from session import LoweredGraph
from session.export import portable_model
from session.kernels import choose_kernels
from builder import attribute
from session.fusions import find_fusions
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, tiny_config
from tests.reference_groupbert import groupbert_encoder, groupbert_pretraining
from tests.test_bert_vs_hf import hf_model

# Sequence lengths per packed row of S = 23: padding at the end of three rows, a row of
# one full sequence, a sequence of 2 tokens with no masked position, 1 to 5 masks each.
S, P, N = 23, 5, 3
LAYOUT = [[7, 9, 5], [13, 4, 2], [11, 8], [23]]


@dataclass
class Sequence:
    ids: np.ndarray  # (L,)
    segments: np.ndarray  # (L,)
    masked: np.ndarray  # (m,) positions in 1 .. L-1
    labels: np.ndarray  # (m,)
    nsp: int
    span: tuple[int, int]  # SQuAD start and end (0, 0: no answer, the [CLS])


def make_sequences(cfg, seed: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    out = []
    for length in (n for row in LAYOUT for n in row):
        masks = min(P, max(0, (length - 2) // 3 + (length > 4)))
        masked = np.sort(rng.choice(np.arange(1, length), masks, replace=False))
        question = max(1, length // 3)  # [CLS] and the question: segment 0; the context: segment 1
        segments = (np.arange(length) >= question).astype(np.int64)
        start = int(rng.integers(question, length)) if length > 2 and rng.random() < 0.8 else 0
        end = min(length - 1, start + int(rng.integers(0, 3))) if start else 0
        out.append(Sequence(rng.integers(5, cfg.vocab_size, length), segments, masked,
                            rng.integers(5, cfg.vocab_size, masks), int(rng.integers(0, 2)), (start, end)))
    return out


def unpacked_batch(seqs: list[Sequence]) -> dict[str, torch.Tensor]:
    """One sequence per row, padded to S: each sequence alone."""
    n = len(seqs)
    b = {k: np.zeros((n, w), np.int64) for k, w in
         [("input_ids", S), ("segment_ids", S), ("input_mask", S), ("masked_lm_positions", P), ("masked_lm_ids", P)]}
    for i, q in enumerate(seqs):
        length, m = len(q.ids), len(q.masked)
        b["input_ids"][i, :length], b["segment_ids"][i, :length], b["input_mask"][i, :length] = q.ids, q.segments, 1
        b["masked_lm_positions"][i, :m], b["masked_lm_ids"][i, :m] = q.masked, q.labels
    b["next_sentence_labels"] = np.array([q.nsp for q in seqs], np.int64)
    b["start_positions"] = np.array([q.span[0] for q in seqs], np.int64)
    b["end_positions"] = np.array([q.span[1] for q in seqs], np.int64)
    return {k: torch.from_numpy(v) for k, v in b.items()}


def packed_batch(seqs: list[Sequence], slots: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int, int]]]:
    """The sequences packed by LAYOUT; also (row, slot, start, first mask slot) per sequence."""
    rows = len(LAYOUT)
    b = {k: np.zeros((rows, S), np.int64) for k in ("input_ids", "segment_ids", "sequence_index", "position_ids")}
    b.update({k: np.zeros((rows, slots), np.int64) for k in ("masked_lm_positions", "masked_lm_ids")})
    b.update({k: np.full((rows, N), -100, np.int64) for k in ("next_sentence_labels", "start_positions", "end_positions")})
    b["nsp_positions"] = np.zeros((rows, N), np.int64)
    where, it = [], iter(seqs)
    for r, lengths in enumerate(LAYOUT):
        start = mask_start = 0
        for k, length in enumerate(lengths):
            q = next(it)
            span = slice(start, start + length)
            b["input_ids"][r, span], b["segment_ids"][r, span] = q.ids, q.segments
            b["sequence_index"][r, span], b["position_ids"][r, span] = k + 1, np.arange(length)
            m = len(q.masked)
            b["masked_lm_positions"][r, mask_start : mask_start + m] = q.masked + start
            b["masked_lm_ids"][r, mask_start : mask_start + m] = q.labels
            b["next_sentence_labels"][r, k], b["nsp_positions"][r, k] = q.nsp, start
            b["start_positions"][r, k], b["end_positions"][r, k] = q.span[0] + start, q.span[1] + start
            where.append((r, k, start, mask_start))
            start, mask_start = start + length, mask_start + m
    return {k: torch.from_numpy(v) for k, v in b.items()}, where


def packed_config(architecture: str, task: str = "pretraining"):
    return tiny_config(architecture, task=task, sequence_length=S, max_predictions=P, packed=True,
                       max_sequences_per_pack=N)


def bert_pretraining_reference(cfg, weights: dict, batch: dict) -> dict:
    """HuggingFace BertForPreTraining with the graph's weights, on padded rows."""
    hf = hf_model(cfg)
    hf.load_state_dict(weights, strict=False)
    labels = torch.full(batch["input_ids"].shape, -100)
    for r in range(len(labels)):
        for pos, lab in zip(batch["masked_lm_positions"][r], batch["masked_lm_ids"][r]):
            if pos > 0:
                labels[r, pos] = lab
    out = hf(input_ids=batch["input_ids"], attention_mask=batch["input_mask"], token_type_ids=batch["segment_ids"],
             labels=labels, next_sentence_label=batch["next_sentence_labels"])
    mlm = torch.gather(out.prediction_logits, 1, batch["masked_lm_positions"][..., None].expand(-1, -1, cfg.vocab_size))
    return {"mlm_logits": mlm, "nsp_logits": out.seq_relationship_logits, "loss": out.loss,
            "params": dict(hf.named_parameters())}


def groupbert_pretraining_reference(cfg, weights: dict, batch: dict) -> dict:
    w = {n: v.clone().requires_grad_() for n, v in weights.items()}
    return {**groupbert_pretraining(w, cfg, batch), "params": w}


def assert_gradients_match(graph: LoweredGraph, params: dict, rtol: float, noise: float = 1e-8) -> None:
    # Key-bias gradients (and the span layer's bias gradient, SQuAD) are 0 in exact
    # arithmetic (softmax cancels them): allow rounding noise far below every real gradient.
    noise *= max(p.grad.abs().max().item() for p in params.values() if p.grad is not None)
    for name, p in graph.named_weights():
        assert p.grad is not None, f"{name} got no gradient"
        assert_close(p.grad, params[name].grad, rtol, f"grad {name}", atol=noise)


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_packed_pretraining_equals_each_sequence_alone(architecture):
    cfg = packed_config(architecture)
    seqs = make_sequences(cfg)
    packed, where = packed_batch(seqs, cfg.predictions_per_row)
    graph = LoweredGraph(build_model(cfg, seed=1).builder.model_proto())
    weights = graph.weights_state_dict()
    reference = bert_pretraining_reference if architecture == "bert" else groupbert_pretraining_reference
    ref = reference(cfg.unpacked(), weights, unpacked_batch(seqs))

    out = graph({k: packed[k] for k in graph.input_names})
    for i, (q, (r, k, _, mask_start)) in enumerate(zip(seqs, where)):
        m = len(q.masked)
        assert_close(out["mlm_logits"][r, mask_start : mask_start + m], ref["mlm_logits"][i, :m], 1e-5,
                     f"mlm_logits of sequence {i} (row {r}, slot {k})")
        assert_close(out["nsp_logits"][r, k], ref["nsp_logits"][i], 1e-5, f"nsp_logits of sequence {i}")
    assert_close(out["loss"], ref["loss"], 1e-5, "loss")
    out["loss"].backward()
    ref["loss"].backward()
    assert_gradients_match(graph, ref["params"], 1e-5)


def squad_reference(architecture: str, cfg, weights: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Start and end logits (B, S) of padded rows: HuggingFace's BertForQuestionAnswering,
    or the eager GroupBERT encoder and the span layer."""
    if architecture == "bert":
        hf = transformers.BertForQuestionAnswering(hf_model(cfg).config).eval()
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        out = hf(input_ids=batch["input_ids"], attention_mask=batch["input_mask"], token_type_ids=batch["segment_ids"])
        return out.start_logits, out.end_logits, dict(hf.named_parameters())
    w = {n: v.clone().requires_grad_() for n, v in weights.items()}
    logits = F.linear(groupbert_encoder(w, cfg, batch), w["qa_outputs.weight"], w["qa_outputs.bias"])
    return logits[..., 0], logits[..., 1], w


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_packed_squad_head_keeps_each_question_to_its_own_context(architecture):
    cfg = packed_config(architecture, task="squad")
    seqs = make_sequences(cfg, seed=4)
    packed, where = packed_batch(seqs, cfg.predictions_per_row)
    graph = LoweredGraph(build_model(cfg, seed=2).builder.model_proto())
    batch = unpacked_batch(seqs)
    ref_start, ref_end, params = squad_reference(architecture, cfg.unpacked(), graph.weights_state_dict(), batch)

    out = graph({k: packed[k] for k in graph.input_names})
    assert out["start_logits"].shape == (len(LAYOUT), N, S)
    losses = []
    for i, (q, (r, k, start, _)) in enumerate(zip(seqs, where)):
        length = len(q.ids)
        # Answerable: the sequence's own context (segment 1) and its own [CLS].
        allowed = torch.from_numpy((q.segments == 1) | (np.arange(length) == 0))
        for name, got, want, label in (("start", out["start_logits"], ref_start, q.span[0]),
                                       ("end", out["end_logits"], ref_end, q.span[1])):
            own = got[r, k, start : start + length]
            assert_close(own[allowed], want[i, :length][allowed], 1e-5, f"{name} logits of sequence {i}")
            outside = torch.ones(S, dtype=torch.bool)
            outside[start : start + length] = ~allowed
            assert (got[r, k][outside] < -5000).all(), f"{name} logits of sequence {i} reach outside its context"
            masked = torch.where(allowed, want[i, :length], torch.tensor(-torch.inf))
            losses.append(F.cross_entropy(masked[None], torch.tensor([label])))
    # The mean over questions of (start + end) / 2, each over its own answerable positions.
    ref_loss = torch.stack(losses).mean()
    assert_close(out["loss"], ref_loss, 1e-5, "loss")
    out["loss"].backward()
    ref_loss.backward()
    assert_gradients_match(graph, params, 1e-5, noise=1e-7)


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_packed_graph_is_valid_onnx_and_attention_still_fuses(architecture):
    cfg = packed_config(architecture)
    proto = build_model(cfg).builder.model_proto()
    onnx.checker.check_model(proto, full_check=True)
    names = [i.name for i in proto.graph.input]
    assert {"sequence_index", "position_ids", "nsp_positions"} <= set(names) and "input_mask" not in names
    constants = {n.output[0]: onnx.numpy_helper.to_array(attribute(n, "value"))
                 for n in proto.graph.node if n.op_type == "Constant"}
    fused, _ = find_fusions(proto.graph, constants, choose_kernels())
    attention = [f for f in fused.values() if len(f.inputs) == 4]  # (q, kᵀ, bias, v): scaled dot-product attention
    assert len(attention) == cfg.num_layers, "the (B, 1, S, S) packed bias must not stop the attention fusion"


def test_packed_weights_are_the_unpacked_weights():
    for architecture in ("bert", "groupbert"):
        for task in ("pretraining", "squad"):
            cfg = packed_config(architecture, task)
            packed = build_model(cfg).builder.weight_specs
            plain = build_model(cfg.unpacked()).builder.weight_specs
            assert {n: s.shape for n, s in packed.items()} == {n: s.shape for n, s in plain.items()}


@pytest.mark.parametrize("task", ["pretraining", "squad"])
def test_a_packed_checkpoint_exports_the_unpacked_serving_graph(tmp_path, task):
    # Trained on packed rows, served one sequence per row: bert.py --export writes the
    # unpacked graph with the checkpoint's weights, and onnxruntime on padded rows gives
    # every sequence the logits the packed training graph gives it.
    cfg = packed_config("groupbert", task)
    seqs = make_sequences(cfg, seed=6)
    packed, where = packed_batch(seqs, cfg.predictions_per_row)
    session = TrainingSession(build_model(cfg).builder.model_proto(),
                              optimizer=OptimizerSpec(schedule=Schedule(0.01, 0, 10, decay="constant")))
    for _ in range(2):
        session.run(packed)
    checkpoint = session.save(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="keeps packed sequences apart.*export the unpacked graph"):
        portable_model(checkpoint / "model.onnx")

    config = Config(name="packed", model=cfg, data={"source": "demo", "directory": str(tmp_path / "no-data")})
    path = export_run(config, str(tmp_path / "model.onnx"), checkpoint_input=str(checkpoint))
    exported = onnx.load(str(path))
    assert {i.name for i in exported.graph.input} >= {"input_ids", "segment_ids", "input_mask"}
    runtime = ort.InferenceSession(str(path))
    plain = unpacked_batch(seqs)
    served = dict(zip([o.name for o in runtime.get_outputs()],
                      runtime.run(None, {i.name: plain[i.name].numpy() for i in runtime.get_inputs()})))
    trained = LoweredGraph(onnx.load(str(checkpoint / "model.onnx")))
    with torch.no_grad():
        out = trained({k: packed[k] for k in trained.input_names})
    for i, (q, (r, k, start, mask_start)) in enumerate(zip(seqs, where)):
        length, m = len(q.ids), len(q.masked)
        if task == "pretraining":
            assert_close(served["mlm_logits"][i, :m], out["mlm_logits"][r, mask_start : mask_start + m], 1e-5,
                         f"exported mlm_logits of sequence {i}")
            assert_close(served["nsp_logits"][i], out["nsp_logits"][r, k], 1e-5, f"exported nsp_logits of sequence {i}")
        else:
            context = torch.from_numpy(q.segments == 1)
            assert_close(served["start_logits"][i, :length][context],
                         out["start_logits"][r, k, start : start + length][context], 1e-5,
                         f"exported start_logits of sequence {i}")


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("task", ["classification", "regression", "tokens"])
def test_packed_labelled_heads_equal_each_sequence_alone(architecture, task):
    """data/packing.py's pack_labelled_rows into the packed graph of a labelled task: each row's
    logits (read back by unpack_rows) are those of the unpacked graph with the same weights on
    padded rows (which tests/test_classify.py holds equal to HF's), and so are the loss, a mean
    over the rows (or labelled tokens), and every weight gradient."""
    from data.packing import pack_labelled_rows, unpack_rows

    cfg = tiny_config(architecture, task=task, sequence_length=S, packed=True, max_sequences_per_pack=N,
                      num_labels=1 if task == "regression" else 4)
    seqs = make_sequences(cfg, seed=7)
    plain = {k: v.numpy() for k, v in unpacked_batch(seqs).items() if k in ("input_ids", "segment_ids", "input_mask")}
    rng = np.random.default_rng(8)
    if task == "tokens":
        plain["labels"] = np.where((plain["input_mask"] == 1) & (rng.random(plain["input_ids"].shape) < 0.7),
                                   rng.integers(0, 4, plain["input_ids"].shape), -100)
    else:
        plain["labels"] = rng.normal(size=len(seqs)).astype(np.float32) if task == "regression" else \
            rng.integers(0, 4, len(seqs))
    packed = pack_labelled_rows(plain, N, per_token=task == "tokens")
    assert len(packed["input_ids"]) < len(seqs), "the rows must share packed rows for the check to mean anything"

    graph = LoweredGraph(build_model(cfg, seed=3).builder.model_proto())
    alone = LoweredGraph(build_model(cfg.unpacked(), seed=3).builder.model_proto())
    alone.load_weights(graph.weights_state_dict())
    out = graph({k: torch.from_numpy(packed[k]) for k in graph.input_names})
    want = alone({k: torch.from_numpy(plain[k]) for k in alone.input_names})
    got = unpack_rows(out["logits"].detach().numpy(), packed, len(seqs), per_token=task == "tokens")
    if task == "tokens":
        mask = plain["input_mask"] == 1
        assert_close(torch.from_numpy(got[mask]), want["logits"][torch.from_numpy(mask)], 1e-5, "token logits")
    else:
        assert_close(torch.from_numpy(got), want["logits"], 1e-5, "logits per row")
    assert_close(out["loss"], want["loss"], 1e-5, "loss")
    out["loss"].backward()
    want["loss"].backward()
    grads = dict(alone.named_weights())
    for name, p in graph.named_weights():
        assert_close(p.grad, grads[name].grad, 1e-4, f"grad {name}", atol=1e-8)
