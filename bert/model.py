"""BERT and GroupBERT as ONNX, written with the builder, read top to bottom.

Letters: B batch, S sequence, H hidden, A heads, D head size (H / A), F FFN width
(4H), G groups, C channels per conv group, K conv kernel, P masked predictions, V vocab,
N packed sequences per row (max_sequences_per_pack), L labels.

Weight names are HuggingFace `BertForPreTraining` state-dict names wherever BERT has a
counterpart, so `transformers` weights load by name with no mapping code. Dense weights
are stored (out, in) as `torch.nn.Linear` stores them and applied as x @ Wᵀ.

GroupBERT (Chelombiev et al. 2021, "GroupBERT: Enhanced Transformer Architecture with
Efficient Grouped Structures") replaces each post-norm BERT layer with four pre-norm
residual modules: convolution → grouped FFN → attention → grouped FFN, and adds a final
LayerNorm. No placement or device choices live here: `bert/placement.py` applies them.

Packed rows (`model.packed`, after Graphcore's packed BERT, Krell et al. 2021, "Efficient
Sequence Packing without Cross-contamination"): a row holds up to N sequences, named by
`sequence_index` (1, 2, ... per sequence, 0 on padding), with `position_ids` restarting
at 0 in each. Attention cannot cross sequences (a block-diagonal bias), the grouped
convolution treats every boundary as zero padding, MLM predicts at the row's masked
positions as before, and NSP, the SQuAD span head and the sequence classifier work per
sequence (the token classifier per position, as unpacked). Every sequence
then computes exactly what it computes alone in a padded row (tests/test_packing.py),
with the same weights: `ModelConfig.unpacked()` gives the serving graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from bert.config import Architecture, ModelConfig
from bert.placement import Placement
from builder import FLOAT, INT64, Builder, Tensor, normal, ones, zeros
from custom_ops import DOMAIN, DOMAIN_VERSION
from custom_ops.schema import RULES as CUSTOM_RULES

IGNORE_INDEX = -100  # label of prediction slots that carry no masked token


def no_weight_decay(name: str, shape: tuple[int, ...] = ()) -> bool:
    """Biases and LayerNorm weights take no weight decay and no LAMB trust ratio (BERT's and
    PopART's LambNoBias rule, by HuggingFace names; the optimizer's `no_decay`)."""
    return name == "bias" or name.endswith(".bias") or "LayerNorm" in name


@dataclass(frozen=True)
class Model:
    """A built graph (its inputs and outputs are the graph's own) and its config."""

    builder: Builder
    config: ModelConfig


# ---------------------------------------------------------------- primitives
def dense(b: Builder, x: Tensor, features: int, name: str, std: float) -> Tensor:
    """x @ Wᵀ + bias with W (out, in), as torch.nn.Linear."""
    with b.name_scope(name):
        w = b.weight("weight", (features, x.shape[-1]), normal(std))  # (out, in)
        bias = b.weight("bias", (features,), zeros)
    return b.onnx.Add(b.onnx.MatMul(x, b.onnx.Transpose(w, perm=[1, 0])), bias)


def layer_norm(b: Builder, x: Tensor, name: str, eps: float) -> Tensor:
    with b.name_scope(name):
        gamma = b.weight("weight", x.shape[-1:], ones)
        beta = b.weight("bias", x.shape[-1:], zeros)
    return b.onnx.LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)


def dropout(b: Builder, x: Tensor, ratio: float) -> Tensor:
    """Dropout is active only when the session trains; ratio 0 emits no node."""
    if ratio == 0:
        return x
    return b.onnx.Dropout(x, b.constant(np.float32(ratio)))


def gelu(b: Builder, x: Tensor) -> Tensor:
    return b.onnx.Gelu(x, approximate="none")  # BERT's erf GELU


def swish(b: Builder, x: Tensor) -> Tensor:
    return b.onnx.Mul(x, b.onnx.Sigmoid(x))


# ---------------------------------------------------------------- embeddings
def embeddings(b: Builder, cfg: ModelConfig, input_ids: Tensor, segment_ids: Tensor,
               position_ids: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Word + position + segment embeddings → LayerNorm. Returns (x (B, S, H), word table (V, H)).
    Positions are 0 .. S-1, or `position_ids` (B, S) restarting in each packed sequence."""
    h, s = cfg.hidden_size, input_ids.shape[1]
    std = cfg.init_std
    with b.name_scope("embeddings"):
        word = b.weight("word_embeddings.weight", (cfg.vocab_size, h), normal(std))  # (V, H)
        position = b.weight("position_embeddings.weight", (cfg.max_positions, h), normal(std))
        segment = b.weight("token_type_embeddings.weight", (cfg.type_vocab_size, h), normal(std))
        positions = position_ids if position_ids is not None else b.constant(np.arange(s, dtype=np.int64))  # (S,)
        x = b.onnx.Add(b.onnx.Gather(word, input_ids), b.onnx.Gather(position, positions))  # (B, S, H)
        x = b.onnx.Add(x, b.onnx.Gather(segment, segment_ids))
        x = layer_norm(b, x, "LayerNorm", cfg.layer_norm_eps)
    return dropout(b, x, cfg.hidden_dropout), word


def additive_bias(b: Builder, keep: Tensor) -> Tensor:
    """1.0/0.0 → additive bias: 0 where kept, -10000 elsewhere (BERT's mask value)."""
    return b.onnx.Mul(b.onnx.Sub(b.constant(np.float32(1.0)), keep), b.constant(np.float32(-10000.0)))


@dataclass(frozen=True)
class Rows:
    """Where the tokens of each row are, built once from the inputs and read by every layer:
    one sequence and its padding (`keep`), or packed sequences (`sequence_index`)."""

    attention_bias: Tensor  # (B, 1, 1, S) padded, (B, 1, S, S) packed: added to the scores
    keep: Optional[Tensor] = None  # (B, S) 1.0 on tokens, 0.0 on padding: the convolution's mask
    sequence_index: Optional[Tensor] = None  # (B, S) int64, 0 on padding: the convolution's boundaries


def padded_rows(b: Builder, input_mask: Tensor) -> Rows:
    """(B, S) 1/0 mask: attention sees every token of the row and no padding. The bias is
    written Unsqueeze → Unsqueeze → Cast → Sub → Mul, the form in which onnxruntime's
    transformer optimizer recognises BERT's attention mask and fuses the attention."""
    rows = b.onnx.Unsqueeze(b.onnx.Unsqueeze(input_mask, b.constant(np.array([1], np.int64))),
                            b.constant(np.array([2], np.int64)))  # (B, 1, 1, S)
    return Rows(additive_bias(b, b.onnx.Cast(rows, to=FLOAT)), keep=b.onnx.Cast(input_mask, to=FLOAT))


def packed_rows(b: Builder, sequence_index: Tensor) -> Rows:
    """(B, S) sequence ids: a query attends to the keys of its own sequence only (the
    block-diagonal mask of Graphcore's packed BERT); padding keys (id 0) to none."""
    query = b.onnx.Unsqueeze(sequence_index, b.constant(np.array([2], np.int64)))  # (B, S, 1)
    key = b.onnx.Unsqueeze(sequence_index, b.constant(np.array([1], np.int64)))  # (B, 1, S)
    same = b.onnx.And(b.onnx.Equal(query, key), b.onnx.Not(b.onnx.Equal(key, b.constant(np.int64(0)))))  # (B, S, S)
    bias = additive_bias(b, b.onnx.Cast(same, to=FLOAT))
    return Rows(b.onnx.Unsqueeze(bias, b.constant(np.array([1], np.int64))), sequence_index=sequence_index)  # (B, 1, S, S)


# ----------------------------------------------------------------- attention
def self_attention(b: Builder, cfg: ModelConfig, x: Tensor, bias: Tensor) -> Tensor:
    """Multi-head attention; returns the output projection (before dropout/residual)."""
    a, d = cfg.num_heads, cfg.head_size
    heads = b.constant(np.array([0, 0, a, d], np.int64))
    with b.name_scope("self"):
        q = b.onnx.Reshape(dense(b, x, cfg.hidden_size, "query", cfg.init_std), heads)  # (B, S, A, D)
        k = b.onnx.Reshape(dense(b, x, cfg.hidden_size, "key", cfg.init_std), heads)
        v = b.onnx.Reshape(dense(b, x, cfg.hidden_size, "value", cfg.init_std), heads)
        q = b.onnx.Transpose(q, perm=[0, 2, 1, 3])  # (B, A, S, D)
        k = b.onnx.Transpose(k, perm=[0, 2, 3, 1])  # (B, A, D, S)
        v = b.onnx.Transpose(v, perm=[0, 2, 1, 3])  # (B, A, S, D)
        # Div by √d, as HF's BertSelfAttention writes it: with the mask's form (padded_rows) the
        # pattern onnxruntime's transformer optimizer fuses into one Attention node.
        scores = b.onnx.Div(b.onnx.MatMul(q, k), b.constant(np.float32(math.sqrt(d))))  # (B, A, S, S)
        probs = dropout(b, b.onnx.Softmax(b.onnx.Add(scores, bias), axis=-1), cfg.attention_dropout)
        context = b.onnx.Transpose(b.onnx.MatMul(probs, v), perm=[0, 2, 1, 3])  # (B, S, A, D)
        context = b.onnx.Reshape(context, b.constant(np.array([0, 0, cfg.hidden_size], np.int64)))  # (B, S, H)
    with b.name_scope("output"):
        return dense(b, context, cfg.hidden_size, "dense", cfg.init_std)


# ----------------------------------------------------- GroupBERT convolution
def convolution_module(b: Builder, cfg: ModelConfig, x: Tensor, rows: Rows) -> Tensor:
    """GLU → zero padding → grouped conv over S → LayerNorm → Swish → dense (GroupBERT §3.2).
    Packed, every sequence boundary is zero padding: a sequence convolves as if alone."""
    h = cfg.hidden_size
    values, gates = b.onnx.Split(
        dense(b, x, 2 * h, "glu", cfg.init_std), b.constant(np.array([h, h], np.int64)), axis=-1
    )  # (B, S, H) each
    glu = b.onnx.Mul(values, b.onnx.Sigmoid(gates))
    with b.name_scope("grouped_conv"):
        # (H, C, K): torch conv1d's weight layout with H / C groups.
        w = b.weight("weight", (h, cfg.conv_group_size, cfg.conv_kernel), normal(cfg.init_std))
        bias = b.weight("bias", (h,), zeros)
    custom = b.custom(DOMAIN, DOMAIN_VERSION, CUSTOM_RULES)
    y = b.onnx.Add(custom.GroupedConv1d(glu, w, rows.keep, rows.sequence_index), bias)  # (B, S, H)
    y = swish(b, layer_norm(b, y, "conv_LayerNorm", cfg.layer_norm_eps))
    return dense(b, y, h, "output", cfg.init_std)


# --------------------------------------------------------------------- FFNs
def feed_forward(b: Builder, cfg: ModelConfig, x: Tensor) -> Tensor:
    """BERT's dense FFN: H → F, GELU, F → H (before dropout/residual)."""
    with b.name_scope("intermediate"):
        y = gelu(b, dense(b, x, cfg.intermediate_size, "dense", cfg.init_std))
    with b.name_scope("output"):
        return dense(b, y, cfg.hidden_size, "dense", cfg.init_std)


def grouped_feed_forward(b: Builder, cfg: ModelConfig, x: Tensor) -> Tensor:
    """H → F dense + GELU, block-diagonal F → H with G groups, H → H mixer (GroupBERT §3.1)."""
    h, f, g = cfg.hidden_size, cfg.intermediate_size, cfg.ffn_groups
    y = gelu(b, dense(b, x, f, "intermediate", cfg.init_std))  # (B, S, F)
    y = b.onnx.Reshape(y, b.constant(np.array([0, 0, g, f // g], np.int64)))  # (B, S, G, F/G)
    with b.name_scope("grouped"):
        w = b.weight("weight", (g, f // g, h // g), normal(cfg.init_std))  # (G, F/G, H/G)
        bias = b.weight("bias", (h,), zeros)
    y = b.onnx.Einsum(y, w, equation="bsgi,gio->bsgo")  # (B, S, G, H/G)
    y = b.onnx.Add(b.onnx.Reshape(y, b.constant(np.array([0, 0, h], np.int64))), bias)  # (B, S, H)
    return dense(b, y, h, "output", cfg.init_std)


# ------------------------------------------------------------------- layers
def bert_layer(b: Builder, cfg: ModelConfig, x: Tensor, rows: Rows) -> Tensor:
    """Post-norm: x = LN(x + attn(x)); x = LN(x + FFN(x))."""
    eps, p = cfg.layer_norm_eps, cfg.hidden_dropout
    with b.name_scope("attention"):
        y = self_attention(b, cfg, x, rows.attention_bias)
        x = layer_norm(b, b.onnx.Add(x, dropout(b, y, p)), "output.LayerNorm", eps)
    y = feed_forward(b, cfg, x)
    return layer_norm(b, b.onnx.Add(x, dropout(b, y, p)), "output.LayerNorm", eps)


def groupbert_layer(b: Builder, cfg: ModelConfig, x: Tensor, rows: Rows) -> Tensor:
    """Four pre-norm residual modules, each x + dropout(branch(LN(x)))."""
    modules = (
        ("conv", lambda y: convolution_module(b, cfg, y, rows)),
        ("ffn1", lambda y: grouped_feed_forward(b, cfg, y)),
        ("attention", lambda y: self_attention(b, cfg, y, rows.attention_bias)),
        ("ffn2", lambda y: grouped_feed_forward(b, cfg, y)),
    )
    for name, branch in modules:
        with b.name_scope(name):
            x = b.onnx.Add(x, dropout(b, branch(layer_norm(b, x, "LayerNorm", cfg.layer_norm_eps)), cfg.hidden_dropout))
    return x


# -------------------------------------------------------------------- heads
def gather_positions(b: Builder, x: Tensor, positions: Tensor) -> Tensor:
    """x (B, S, H) at positions (B, P) of each row → (B, P, H)."""
    return b.onnx.GatherND(x, b.onnx.Unsqueeze(positions, b.constant(np.array([-1], np.int64))), batch_dims=1)


def masked_lm_head(b: Builder, cfg: ModelConfig, x: Tensor, positions: Tensor, word: Tensor) -> Tensor:
    """Gather the P masked positions first, then project onto the tied vocab: (B, P, V)."""
    picked = gather_positions(b, x, positions)  # (B, P, H)
    with b.name_scope("predictions"):
        with b.name_scope("transform"):
            y = gelu(b, dense(b, picked, cfg.hidden_size, "dense", cfg.init_std))
            y = layer_norm(b, y, "LayerNorm", cfg.layer_norm_eps)
        bias = b.weight("bias", (cfg.vocab_size,), zeros)
        return b.onnx.Add(b.onnx.MatMul(y, b.onnx.Transpose(word, perm=[1, 0])), bias)  # (B, P, V)


def pooler(b: Builder, cfg: ModelConfig, cls: Tensor) -> Tensor:
    """tanh(dense(·)) of the [CLS] tokens: (B, H), or (B, N, H) for packed sequences."""
    with b.name_scope("pooler"):
        return b.onnx.Tanh(dense(b, cls, cfg.hidden_size, "dense", cfg.init_std))


def slot_members(b: Builder, cfg: ModelConfig, sequence_index: Tensor) -> Tensor:
    """(B, N, S) float: 1 where position s holds the sequence of slot n, else 0."""
    slots = b.constant(np.arange(1, cfg.pack_slots + 1, dtype=np.int64).reshape(1, -1, 1))  # (1, N, 1)
    return b.onnx.Cast(b.onnx.Equal(b.onnx.Unsqueeze(sequence_index, b.constant(np.array([1], np.int64))), slots),
                       to=FLOAT)


def packed_span_bias(b: Builder, cfg: ModelConfig, sequence_index: Tensor, segment_ids: Tensor,
                     position_ids: Tensor) -> Tensor:
    """(B, N, S) additive bias of the span logits of each packed question: 0 on its own
    context (segment 1) and its own [CLS] (position 0: "no answer"), -10000 elsewhere,
    so no question can pick a span in another question's context."""
    own = slot_members(b, cfg, sequence_index)  # (B, N, S)
    context = b.onnx.Cast(b.onnx.Equal(segment_ids, b.constant(np.int64(1))), to=FLOAT)  # (B, S)
    cls = b.onnx.Cast(b.onnx.Equal(position_ids, b.constant(np.int64(0))), to=FLOAT)
    answerable = b.onnx.Unsqueeze(b.onnx.Max(context, cls), b.constant(np.array([1], np.int64)))  # (B, 1, S)
    return additive_bias(b, b.onnx.Mul(own, answerable))


def cross_entropy(b: Builder, logits: Tensor, labels: Tensor) -> Tensor:
    """Mean softmax cross-entropy over the labels that are not IGNORE_INDEX."""
    return b.onnx.SoftmaxCrossEntropyLoss(logits, labels, reduction="mean", ignore_index=IGNORE_INDEX)


def accuracy(b: Builder, logits: Tensor, labels: Tensor, weights: Optional[Tensor]) -> Tensor:
    """Share of argmax predictions equal to the labels, counting rows where weights is 1."""
    hits = b.onnx.Cast(b.onnx.Equal(b.onnx.ArgMax(logits, axis=-1, keepdims=0), labels), to=FLOAT)
    if weights is None:
        return b.onnx.ReduceMean(hits, keepdims=0)
    count = b.onnx.Max(b.onnx.ReduceSum(weights, keepdims=0), b.constant(np.float32(1.0)))
    return b.onnx.Div(b.onnx.ReduceSum(b.onnx.Mul(hits, weights), keepdims=0), count)


# -------------------------------------------------------------------- model
def encoder(b: Builder, cfg: ModelConfig, place: Placement, input_ids: Tensor, segment_ids: Tensor, *,
            input_mask: Optional[Tensor] = None, sequence_index: Optional[Tensor] = None,
            position_ids: Optional[Tensor] = None):
    """Embeddings and the layers; returns (sequence output (B, S, H), word table). Rows are
    one padded sequence each (input_mask), or packed (sequence_index, position_ids)."""
    with place.embeddings(), b.name_scope("bert"):
        x, word = embeddings(b, cfg, input_ids, segment_ids, position_ids)
        rows = packed_rows(b, sequence_index) if sequence_index is not None else padded_rows(b, input_mask)
    with b.name_scope("bert", "encoder"):
        for i in range(cfg.num_layers):
            with place.layer(i), b.name_scope("layer", i):
                if cfg.architecture is Architecture.GROUPBERT:
                    x = groupbert_layer(b, cfg, x, rows)
                else:
                    x = bert_layer(b, cfg, x, rows)
                x = place.checkpoint(x)
        if cfg.architecture is Architecture.GROUPBERT:
            with place.layer(cfg.num_layers - 1):
                x = layer_norm(b, x, "LayerNorm", cfg.layer_norm_eps)
    return x, word


def flatten(b: Builder, t: Tensor, trailing: tuple[int, ...] = ()) -> Tensor:
    """Merge the leading axes: (B, N, *trailing) → (B·N, *trailing)."""
    return b.onnx.Reshape(t, b.constant(np.array([-1, *trailing], np.int64)))


def pretraining_heads(b: Builder, cfg: ModelConfig, x: Tensor, word: Tensor, with_loss: bool) -> None:
    """MLM at the masked positions; NSP from the [CLS] of each row, or of each packed
    sequence (`nsp_positions` (B, N), labels (B, N) with -100 in unused slots)."""
    p, n = cfg.predictions_per_row, cfg.pack_slots
    positions = b.input("masked_lm_positions", ["batch", p], INT64)
    with b.name_scope("cls"):
        mlm = b.output(masked_lm_head(b, cfg, x, positions, word), "mlm_logits")  # (B, P, V)
    with b.name_scope("bert"):
        if cfg.packed:
            cls = gather_positions(b, x, b.input("nsp_positions", ["batch", n], INT64))  # (B, N, H)
        else:
            cls = b.onnx.Gather(x, b.constant(np.int64(0)), axis=1)  # (B, H): the [CLS] token
        pooled = pooler(b, cfg, cls)
    with b.name_scope("cls"):
        nsp = b.output(dense(b, pooled, 2, "seq_relationship", cfg.init_std), "nsp_logits")  # (B, 2) or (B, N, 2)
    if not with_loss:
        return
    ids = b.input("masked_lm_ids", ["batch", p], INT64)
    nsp_labels = b.input("next_sentence_labels", ["batch", n] if cfg.packed else ["batch"], INT64)
    # Position 0 is [CLS], never masked: it marks an unused prediction slot.
    unused = b.onnx.Equal(positions, b.constant(np.int64(0)))
    labels = b.onnx.Where(unused, b.constant(np.int64(IGNORE_INDEX)), ids)  # (B, P)
    # Means over every masked token and every sequence of the batch, packed or not: a
    # packed batch has the loss of the same sequences unpacked.
    mlm_loss = cross_entropy(b, flatten(b, mlm, (cfg.vocab_size,)), flatten(b, labels))
    nsp_weights = None
    if cfg.packed:
        nsp, nsp_labels = flatten(b, nsp, (2,)), flatten(b, nsp_labels)  # (B·N, 2), (B·N)
        nsp_weights = b.onnx.Cast(b.onnx.Not(b.onnx.Equal(nsp_labels, b.constant(np.int64(IGNORE_INDEX)))),
                                  to=FLOAT)
    nsp_loss = cross_entropy(b, nsp, nsp_labels)
    b.output(b.onnx.Add(mlm_loss, nsp_loss), "loss")
    b.output(mlm_loss, "mlm_loss")
    b.output(nsp_loss, "nsp_loss")
    # Accuracies in the graph, as PopART's BERT computed them: scalars are cheap anchors.
    valid = b.onnx.Cast(b.onnx.Not(unused), to=FLOAT)
    b.output(accuracy(b, mlm, ids, valid), "mlm_accuracy")
    b.output(accuracy(b, nsp, nsp_labels, nsp_weights), "nsp_accuracy")


def squad_head(b: Builder, cfg: ModelConfig, x: Tensor, with_loss: bool, span_bias: Optional[Tensor]) -> None:
    """Start and end logits over the row, (B, S); packed, per question (B, N, S) with
    `span_bias` keeping each to its own context, and labels (B, N) (-100: unused slot)."""
    logits = dense(b, x, 2, "qa_outputs", cfg.init_std)  # (B, S, 2)
    start, end = b.onnx.Split(logits, b.constant(np.array([1, 1], np.int64)), axis=-1)
    if span_bias is None:
        squeeze = b.constant(np.array([-1], np.int64))
        start, end = b.onnx.Squeeze(start, squeeze), b.onnx.Squeeze(end, squeeze)  # (B, S)
    else:
        start = b.onnx.Add(b.onnx.Transpose(start, perm=[0, 2, 1]), span_bias)  # (B, N, S)
        end = b.onnx.Add(b.onnx.Transpose(end, perm=[0, 2, 1]), span_bias)
    start = b.output(start, "start_logits")
    end = b.output(end, "end_logits")
    if not with_loss:
        return
    label_shape = ["batch", cfg.pack_slots] if span_bias is not None else ["batch"]
    start_pos = b.input("start_positions", label_shape, INT64)
    end_pos = b.input("end_positions", label_shape, INT64)
    if span_bias is not None:
        s = cfg.sequence_length
        start, end = flatten(b, start, (s,)), flatten(b, end, (s,))  # (B·N, S)
        start_pos, end_pos = flatten(b, start_pos), flatten(b, end_pos)
    total = b.onnx.Add(cross_entropy(b, start, start_pos), cross_entropy(b, end, end_pos))
    b.output(b.onnx.Mul(total, b.constant(np.float32(0.5))), "loss")


def classification_head(b: Builder, cfg: ModelConfig, x: Tensor, with_loss: bool,
                        sequence_index: Optional[Tensor]) -> None:
    """HF's BertForSequenceClassification: the pooled [CLS] token, dropout, `classifier`:
    logits (B, L), and the labels and loss of the task's targets (bert/tasks/targets.py).
    Packed, per sequence: its [CLS] at `cls_positions` (B, N) (0 in an unused slot),
    logits (B, N, L), labels per slot (-100 in an unused slot, or left out by the mask of
    the slots that hold a sequence); the loss is the mean over the sequences."""
    with b.name_scope("bert"):
        if cfg.packed:
            cls = gather_positions(b, x, b.input("cls_positions", ["batch", cfg.pack_slots], INT64))  # (B, N, H)
        else:
            cls = b.onnx.Gather(x, b.constant(np.int64(0)), axis=1)  # (B, H)
        pooled = pooler(b, cfg, cls)
    logits = b.output(dense(b, dropout(b, pooled, cfg.hidden_dropout), cfg.outputs, "classifier", cfg.init_std),
                      "logits")  # (B, L) or (B, N, L)
    if not with_loss:
        return

    def used() -> Tensor:  # (B·N,) 1: a sequence in the slot
        tokens = b.onnx.ReduceSum(slot_members(b, cfg, sequence_index), b.constant(np.array([2], np.int64)), keepdims=0)
        return flatten(b, b.onnx.Min(tokens, b.constant(np.float32(1.0))))

    shape = ["batch", cfg.pack_slots] if cfg.packed else ["batch"]
    b.output(cfg.task.spec.targets.loss(b, cfg, logits, shape, used), "loss")


def token_head(b: Builder, cfg: ModelConfig, x: Tensor, with_loss: bool) -> None:
    """HF's BertForTokenClassification: dropout and `classifier` on every position, logits
    (B, S, L); the loss is the mean over labelled positions (-100: not labelled)."""
    logits = b.output(dense(b, dropout(b, x, cfg.hidden_dropout), cfg.outputs, "classifier", cfg.init_std), "logits")
    if with_loss:
        b.output(cfg.task.spec.targets.loss(b, cfg, logits, ["batch", cfg.sequence_length], lambda: None), "loss")


def build_model(cfg: ModelConfig, *, with_loss: bool = True, seed: int = 0) -> Model:
    """The whole graph for cfg.task; with_loss adds the labels as inputs and the losses."""
    if cfg.task.labelled and cfg.outputs is None:
        raise ValueError(f"model.task {cfg.task.value!r} needs the head's width: set model.num_labels or model.labels "
                         "(a fine-tuning run reads them from its training file)")
    b = Builder(seed=seed)
    place = Placement(b, cfg)
    s = cfg.sequence_length
    input_ids = b.input("input_ids", ["batch", s], INT64)
    segment_ids = b.input("segment_ids", ["batch", s], INT64)
    if cfg.packed:
        sequence_index = b.input("sequence_index", ["batch", s], INT64)
        position_ids = b.input("position_ids", ["batch", s], INT64)
        x, word = encoder(b, cfg, place, input_ids, segment_ids, sequence_index=sequence_index,
                          position_ids=position_ids)
    else:
        input_mask = b.input("input_mask", ["batch", s], INT64)
        x, word = encoder(b, cfg, place, input_ids, segment_ids, input_mask=input_mask)

    head = cfg.task.spec.head
    with place.heads():
        if head == "pretraining":
            pretraining_heads(b, cfg, x, word, with_loss)
        elif head == "token":
            token_head(b, cfg, x, with_loss)
        elif head == "sequence":
            classification_head(b, cfg, x, with_loss, sequence_index if cfg.packed else None)
        else:  # "span"
            span_bias = packed_span_bias(b, cfg, sequence_index, segment_ids, position_ids) if cfg.packed else None
            squad_head(b, cfg, x, with_loss, span_bias)
    return Model(b, cfg)
