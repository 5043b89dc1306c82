"""GroupBERT in transformers, computing what the GroupBERT project's ONNX graph computes
(its bert/model.py), for `AutoModel*.from_pretrained(DIR, trust_remote_code=True)`.

Remote code written by the project's `bert.py export-hf`: it imports only torch and
transformers. Every parameter's state-dict name is the graph's weight name
(`bert.encoder.layer.0.conv.glu.weight`, ...; BERT's names where BERT has the weight), so
the exported model.safetensors loads by name, and what `save_pretrained` writes imports
back into the project (`--checkpoint-input DIR`, `training.init_from`).

GroupBERT (Chelombiev et al. 2021, "GroupBERT: Enhanced Transformer Architecture with
Efficient Grouped Structures"): BERT's embeddings, then layers of four pre-norm residual
modules, x + dropout(module(LN(x))): convolution → grouped FFN → attention → grouped FFN,
and a final LayerNorm; BERT's pooler and heads. GELU is erf GELU; padding is masked by
BERT's additive -10000.

Letters: B batch, S sequence, H hidden, A heads, D head size (H / A), F FFN width, G FFN
groups, C channels per convolution group, K kernel, V vocab, L labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.modeling_outputs import (BaseModelOutputWithPooling, MaskedLMOutput, QuestionAnsweringModelOutput,
                                           SequenceClassifierOutput, TokenClassifierOutput)
from transformers.utils import ModelOutput

from .configuration_groupbert import GroupBertConfig

__all__ = ["GroupBertForMaskedLM", "GroupBertForPreTraining", "GroupBertForQuestionAnswering",
           "GroupBertForSequenceClassification", "GroupBertForTokenClassification", "GroupBertModel",
           "GroupBertPreTrainedModel"]


# ---------------------------------------------------------------- embeddings
class GroupBertEmbeddings(nn.Module):
    """Word + position + segment embeddings → LayerNorm → dropout: (B, S, H)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)  # (V, H), also the MLM decoder
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x + self.token_type_embeddings(token_type_ids)))


# ---------------------------------------------------------------- the four modules
class GroupBertConvolution(nn.Module):
    """LN → GLU → zero padded positions → grouped conv over S → LN → Swish → dense (GroupBERT §3.2)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        h, k = config.hidden_size, config.conv_kernel_size
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.glu = nn.Linear(h, 2 * h)  # values, then gates
        # weight (H, C, K), H / C groups; "same" zero padding (K odd).
        self.grouped_conv = nn.Conv1d(h, h, k, padding=k // 2, groups=h // config.conv_group_size)
        self.conv_LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.output = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        values, gates = self.glu(self.LayerNorm(x)).chunk(2, dim=-1)  # (B, S, H) each
        y = values * torch.sigmoid(gates) * keep[..., None]  # padded positions contribute nothing
        y = self.grouped_conv(y.transpose(1, 2)).transpose(1, 2)  # (B, S, H)
        return self.output(F.silu(self.conv_LayerNorm(y)))


class GroupedLinear(nn.Module):
    """Block-diagonal projection: G independent (F/G → H/G) blocks, weight (G, F/G, H/G), bias (H,)."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_features // groups, out_features // groups))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, i, _ = self.weight.shape
        y = torch.einsum("bsgi,gio->bsgo", x.unflatten(-1, (g, i)), self.weight)  # (B, S, G, H/G)
        return y.flatten(-2) + self.bias


class GroupBertFeedForward(nn.Module):
    """LN → dense H → F + GELU → grouped F → H → dense H → H mixer (GroupBERT §3.1)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(h, f)
        self.grouped = GroupedLinear(f, h, config.ffn_groups)
        self.output = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.grouped(F.gelu(self.intermediate(self.LayerNorm(x)))))


def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor, scaling: float, dropout: float = 0.0, **_
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention interface, written out: the context (B, S, A, D) and the weights."""
    scores = query @ key.transpose(-1, -2) * scaling + attention_mask  # (B, A, S, S)
    weights = F.dropout(scores.softmax(dim=-1), p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2), weights


class GroupBertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention with an additive mask: the context (B, S, H).

    The kernel is the one `config._attn_implementation` names in transformers' attention
    interface (`attn_implementation="sdpa"`, the default, or "eager", or one registered)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.heads = config.num_attention_heads
        self.scaling = (h // self.heads) ** -0.5
        self.is_causal = False  # read by the interface's kernels
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (self.query(x), self.key(x), self.value(x)))
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        context, _ = attend(self, q, k, v, bias, dropout=self.dropout.p if self.training else 0.0,
                            scaling=self.scaling)
        return context.reshape(b, s, h)


class GroupBertAttention(nn.Module):
    """LN → self-attention → output dense (BERT's names: `self.*`, `output.dense`)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self = GroupBertSelfAttention(config)
        self.output = nn.ModuleDict({"dense": nn.Linear(config.hidden_size, config.hidden_size)})

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output["dense"](self.self(self.LayerNorm(x), bias))


class GroupBertLayer(nn.Module):
    """Four pre-norm residual modules, each x + dropout(module(x)) (the module normalises its input)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.conv = GroupBertConvolution(config)
        self.ffn1 = GroupBertFeedForward(config)
        self.attention = GroupBertAttention(config)
        self.ffn2 = GroupBertFeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.conv(x, keep))
        x = x + self.dropout(self.ffn1(x))
        x = x + self.dropout(self.attention(x, bias))
        return x + self.dropout(self.ffn2(x))


class GroupBertEncoder(nn.Module):
    """The layers, then the final LayerNorm that pre-norm layers need."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.layer = nn.ModuleList(GroupBertLayer(config) for _ in range(config.num_hidden_layers))
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, keep, bias)
        return self.LayerNorm(x)


# ---------------------------------------------------------------- heads
class GroupBertPooler(nn.Module):
    """tanh(dense(·)) of the [CLS] token: (B, H)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class GroupBertPredictionTransform(nn.Module):
    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class GroupBertLMPredictionHead(nn.Module):
    """dense + GELU + LN, then the word embedding (tied: it is the decoder) and `bias`: (B, S, V)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__()
        self.transform = GroupBertPredictionTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        return self.transform(x) @ word.T + self.bias


# ---------------------------------------------------------------- models
class GroupBertPreTrainedModel(PreTrainedModel):
    """Weight initialisation as the project's (normal(initializer_range), zero biases, unit
    LayerNorms) for weights a checkpoint lacks, e.g. a new task head."""

    config_class = GroupBertConfig
    base_model_prefix = "bert"
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d, GroupedLinear)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, GroupBertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def _returned(self, output: ModelOutput, return_dict: Optional[bool]):
        """transformers' convention: the output, or its tuple when return_dict is False."""
        wanted = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return output if wanted else output.to_tuple()


class GroupBertModel(GroupBertPreTrainedModel):
    """The encoder: last_hidden_state (B, S, H) and, with the pooler, pooler_output (B, H)."""

    def __init__(self, config: GroupBertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = GroupBertEmbeddings(config)
        self.encoder = GroupBertEncoder(config)
        self.pooler = GroupBertPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)  # (S,)
        keep = attention_mask.to(self.embeddings.word_embeddings.weight.dtype)  # (B, S): 1 token, 0 padding
        bias = ((1.0 - keep) * -10000.0)[:, None, None, :]  # (B, 1, 1, S): BERT's additive mask
        x = self.encoder(self.embeddings(input_ids, token_type_ids, position_ids), keep, bias)
        pooled = self.pooler(x) if self.pooler is not None else None
        return self._returned(BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled), return_dict)


@dataclass
class GroupBertForPreTrainingOutput(ModelOutput):
    """BertForPreTraining's output: MLM logits (B, S, V), NSP logits (B, 2), their summed loss."""

    loss: Optional[torch.Tensor] = None
    prediction_logits: Optional[torch.Tensor] = None
    seq_relationship_logits: Optional[torch.Tensor] = None


class GroupBertForPreTraining(GroupBertPreTrainedModel):
    """The pre-training graph's heads: MLM (`cls.predictions`) and NSP (`cls.seq_relationship`)."""

    def __init__(self, config: GroupBertConfig):
        super().__init__(config)
        self.bert = GroupBertModel(config)
        self.cls = nn.ModuleDict({"predictions": GroupBertLMPredictionHead(config),
                                  "seq_relationship": nn.Linear(config.hidden_size, 2)})
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, next_sentence_label: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None):
        """labels (B, S): the masked tokens, -100 elsewhere; next_sentence_label (B,): 1 a random B."""
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, return_dict=True)
        mlm = self.cls["predictions"](out.last_hidden_state, self.bert.embeddings.word_embeddings.weight)
        nsp = self.cls["seq_relationship"](out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss = F.cross_entropy(mlm.flatten(0, 1), labels.flatten()) + F.cross_entropy(nsp, next_sentence_label)
        return self._returned(GroupBertForPreTrainingOutput(loss, mlm, nsp), return_dict)


class GroupBertForMaskedLM(GroupBertPreTrainedModel):
    """The MLM head alone, on every position; a pre-training export's pooler and NSP head are left unused."""

    _keys_to_ignore_on_load_unexpected = [r"bert\.pooler\.", r"cls\.seq_relationship\."]

    def __init__(self, config: GroupBertConfig):
        super().__init__(config)
        self.bert = GroupBertModel(config, add_pooling_layer=False)
        self.cls = nn.ModuleDict({"predictions": GroupBertLMPredictionHead(config)})
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, return_dict: Optional[bool] = None):
        """labels (B, S): the masked tokens, -100 elsewhere."""
        x = self.bert(input_ids, attention_mask, token_type_ids, position_ids, return_dict=True).last_hidden_state
        logits = self.cls["predictions"](x, self.bert.embeddings.word_embeddings.weight)  # (B, S, V)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
        return self._returned(MaskedLMOutput(loss=loss, logits=logits), return_dict)


class GroupBertForSequenceClassification(GroupBertPreTrainedModel):
    """Pooled [CLS] → dropout → `classifier`: logits (B, L). The loss is BertForSequenceClassification's:
    mean squared error for regression (num_labels 1), cross-entropy for single labels, BCE for multi-label."""

    def __init__(self, config: GroupBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = GroupBertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, return_dict: Optional[bool] = None):
        pooled = self.bert(input_ids, attention_mask, token_type_ids, position_ids, return_dict=True).pooler_output
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else self._loss(logits, labels)
        return self._returned(SequenceClassifierOutput(loss=loss, logits=logits), return_dict)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        problem = self.config.problem_type
        if problem is None:
            integer = labels.dtype in (torch.long, torch.int)
            problem = ("regression" if self.num_labels == 1 else
                       "single_label_classification" if integer else "multi_label_classification")
        if problem == "regression":
            shape = (-1,) if self.num_labels == 1 else logits.shape
            return F.mse_loss(logits.reshape(shape), labels.reshape(shape).to(logits.dtype))
        if problem == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class GroupBertForTokenClassification(GroupBertPreTrainedModel):
    """dropout → `classifier` on every position: logits (B, S, L); cross-entropy over labels not -100."""

    _keys_to_ignore_on_load_unexpected = [r"bert\.pooler\."]

    def __init__(self, config: GroupBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = GroupBertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, return_dict: Optional[bool] = None):
        x = self.bert(input_ids, attention_mask, token_type_ids, position_ids, return_dict=True).last_hidden_state
        logits = self.classifier(self.dropout(x))  # (B, S, L)
        loss = None if labels is None else F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return self._returned(TokenClassifierOutput(loss=loss, logits=logits), return_dict)


class GroupBertForQuestionAnswering(GroupBertPreTrainedModel):
    """`qa_outputs` on every position: start and end logits (B, S). The loss is
    BertForQuestionAnswering's: positions outside the sequence are ignored, the mean of both."""

    _keys_to_ignore_on_load_unexpected = [r"bert\.pooler\."]

    def __init__(self, config: GroupBertConfig):
        super().__init__(config)
        self.bert = GroupBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                start_positions: Optional[torch.Tensor] = None, end_positions: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None):
        x = self.bert(input_ids, attention_mask, token_type_ids, position_ids, return_dict=True).last_hidden_state
        start, end = self.qa_outputs(x).unbind(dim=-1)  # (B, S) each
        loss = None
        if start_positions is not None and end_positions is not None:
            outside = start.shape[1]
            loss = (F.cross_entropy(start, start_positions.view(-1).clamp(0, outside), ignore_index=outside)
                    + F.cross_entropy(end, end_positions.view(-1).clamp(0, outside), ignore_index=outside)) / 2
        return self._returned(QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end),
                              return_dict)
