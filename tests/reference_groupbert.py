"""An independent eager-torch GroupBERT, written from the paper's description (Chelombiev et al. 2021).

It shares nothing with the builder or the lowering: it reads the weights by name from a
plain dict and computes with torch.nn.functional, so a bug in either side shows up.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def linear(w: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])


def norm(w: dict, name: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def attention(w, p, x, mask, heads):
    b, s, h = x.shape
    split = lambda t: t.view(b, s, heads, h // heads).transpose(1, 2)  # (B, A, S, D)
    q, k, v = (split(linear(w, f"{p}.self.{n}", x)) for n in ("query", "key", "value"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(h // heads)
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    return linear(w, f"{p}.output.dense", ctx)


def conv_module(w, p, x, mask, eps):
    values, gates = linear(w, f"{p}.glu", x).chunk(2, dim=-1)
    y = values * torch.sigmoid(gates) * mask[..., None]  # zero the padded positions
    weight = w[f"{p}.grouped_conv.weight"]  # (H, C, K)
    groups = x.shape[-1] // weight.shape[1]
    y = F.conv1d(y.transpose(1, 2), weight, w[f"{p}.grouped_conv.bias"], padding=weight.shape[-1] // 2, groups=groups)
    y = norm(w, f"{p}.conv_LayerNorm", y.transpose(1, 2), eps)
    return linear(w, f"{p}.output", F.silu(y))


def grouped_ffn(w, p, x):
    y = F.gelu(linear(w, f"{p}.intermediate", x))
    g, f_in, h_out = w[f"{p}.grouped.weight"].shape
    parts = y.split(f_in, dim=-1)  # block-diagonal down-projection: one matmul per group
    y = torch.cat([parts[i] @ w[f"{p}.grouped.weight"][i] for i in range(g)], dim=-1) + w[f"{p}.grouped.bias"]
    return linear(w, f"{p}.output", y)


def groupbert_encoder(w: dict, cfg, batch: dict) -> torch.Tensor:
    """The sequence output (B, S, H) of padded rows (input_ids, segment_ids, input_mask)."""
    ids, seg, mask = batch["input_ids"], batch["segment_ids"], batch["input_mask"].float()
    eps = cfg.layer_norm_eps
    e = "bert.embeddings"
    x = w[f"{e}.word_embeddings.weight"][ids] + w[f"{e}.position_embeddings.weight"][: ids.shape[1]]
    x = norm(w, f"{e}.LayerNorm", x + w[f"{e}.token_type_embeddings.weight"][seg], eps)
    for i in range(cfg.num_layers):
        p = f"bert.encoder.layer.{i}"
        x = x + conv_module(w, f"{p}.conv", norm(w, f"{p}.conv.LayerNorm", x, eps), mask, eps)
        x = x + grouped_ffn(w, f"{p}.ffn1", norm(w, f"{p}.ffn1.LayerNorm", x, eps))
        x = x + attention(w, f"{p}.attention", norm(w, f"{p}.attention.LayerNorm", x, eps), mask, cfg.num_heads)
        x = x + grouped_ffn(w, f"{p}.ffn2", norm(w, f"{p}.ffn2.LayerNorm", x, eps))
    return norm(w, "bert.encoder.LayerNorm", x, eps)


def groupbert_pretraining(w: dict, cfg, batch: dict) -> dict:
    eps = cfg.layer_norm_eps
    e = "bert.embeddings"
    x = groupbert_encoder(w, cfg, batch)
    pos = batch["masked_lm_positions"]
    picked = x[torch.arange(x.shape[0])[:, None], pos]  # (B, P, H)
    t = norm(w, "cls.predictions.transform.LayerNorm", F.gelu(linear(w, "cls.predictions.transform.dense", picked)), eps)
    mlm = t @ w[f"{e}.word_embeddings.weight"].T + w["cls.predictions.bias"]
    pooled = torch.tanh(linear(w, "bert.pooler.dense", x[:, 0]))
    nsp = linear(w, "cls.seq_relationship", pooled)
    labels = torch.where(pos == 0, -100, batch["masked_lm_ids"])
    loss = F.cross_entropy(mlm.reshape(-1, mlm.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss = loss + F.cross_entropy(nsp, batch["next_sentence_labels"])
    return {"mlm_logits": mlm, "nsp_logits": nsp, "loss": loss}
