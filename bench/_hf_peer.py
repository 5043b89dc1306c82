"""The HuggingFace peer of the training benchmarks (bench/train_throughput.py on the CPU,
bench/_gpu_bench.py on a GPU): a `BertForPreTraining` of our sizes and its loss, two ways."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bert_config(cfg, **extra):
    """transformers.BertConfig of a ModelConfig's sizes, without dropout."""
    import transformers

    return transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        layer_norm_eps=cfg.layer_norm_eps, **extra)


def pretraining_loss(model, batch, masked_only: bool) -> torch.Tensor:
    """MLM + NSP loss of `model` (a BertForPreTraining) on one of our batches.

    `masked_only=False`: as its users run it, the MLM head projects every position onto the
    vocabulary; `masked_only=True`: the same modules with the sequence output gathered at
    the masked positions before the MLM head, as NVIDIA's BERT does (the strongest eager peer)."""
    positions = batch["masked_lm_positions"]  # (B, P); 0 marks an unused slot
    labels = torch.where(positions > 0, batch["masked_lm_ids"], -100)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["input_mask"], token_type_ids=batch["segment_ids"])
    if not masked_only:
        full = torch.full_like(batch["input_ids"], -100)
        full.scatter_(1, positions, labels)
        return model(**inputs, labels=full, next_sentence_label=batch["next_sentence_labels"]).loss
    sequence, pooled = model.bert(**inputs)[:2]  # (B, S, H), (B, H)
    picked = sequence.gather(1, positions[..., None].expand(-1, -1, sequence.shape[-1]))  # (B, P, H)
    mlm, nsp = model.cls(picked, pooled)  # (B, P, V), (B, 2)
    return (F.cross_entropy(mlm.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            + F.cross_entropy(nsp.float(), batch["next_sentence_labels"]))
