"""BERT mode against HuggingFace `transformers.BertForPreTraining` (an independent reference).

The graph's random weights are copied into the HF model by name (no mapping code:
the names are HF's), then logits, losses and every parameter gradient are compared.
"""
import pytest
import torch
import transformers

from bert import build_model
from session import LoweredGraph
from tests.helpers import assert_close, random_batch, tiny_config


def hf_model(cfg):
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions, type_vocab_size=cfg.type_vocab_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=cfg.layer_norm_eps,
        hidden_act="gelu", attn_implementation="eager",
    )
    return transformers.BertForPreTraining(hf_cfg).eval()


def compare(cfg, batch_size, rtol):
    torch.manual_seed(0)
    model = build_model(cfg)
    ours = LoweredGraph(model.builder.model_proto())
    hf = hf_model(cfg)
    weights = ours.weights_state_dict()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    # Only the tied decoder (= word embeddings and cls.predictions.bias) is not a graph weight.
    assert set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, missing
    assert not unexpected, unexpected
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()

    batch = random_batch(cfg, batch_size, pad_from=3)
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    out = ours(t)
    out["loss"].backward()

    labels = torch.full(t["input_ids"].shape, -100)
    for r in range(batch_size):
        for pos, lab in zip(t["masked_lm_positions"][r], t["masked_lm_ids"][r]):
            if pos > 0:
                labels[r, pos] = lab
    ref = hf(
        input_ids=t["input_ids"], attention_mask=t["input_mask"], token_type_ids=t["segment_ids"],
        labels=labels, next_sentence_label=t["next_sentence_labels"],
    )
    hf_mlm = torch.gather(
        ref.prediction_logits, 1, t["masked_lm_positions"][..., None].expand(-1, -1, cfg.vocab_size)
    )
    used = t["masked_lm_positions"] > 0
    assert_close(out["mlm_logits"][used], hf_mlm[used], rtol, "mlm_logits")
    assert_close(out["nsp_logits"], ref.seq_relationship_logits, rtol, "nsp_logits")
    assert_close(out["loss"], ref.loss, rtol, "loss")
    ref.loss.backward()
    hf_params = dict(hf.named_parameters())
    # Key-bias gradients are 0 in exact arithmetic (softmax cancels them): allow rounding
    # noise far below every real gradient.
    noise = 1e-8 * max(p.grad.abs().max().item() for p in hf_params.values() if p.grad is not None)
    for name, p in ours.named_weights():
        assert p.grad is not None, f"{name} got no gradient"
        assert_close(p.grad, hf_params[name].grad, rtol, f"grad {name}", atol=noise)


def test_tiny_odd_config_matches_hf():
    compare(tiny_config("bert"), batch_size=3, rtol=1e-5)


@pytest.mark.slow
def test_bert_base_shapes_match_hf():
    cfg = tiny_config(
        "bert", vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, sequence_length=128,
        max_predictions=20, max_positions=512,
    )
    compare(cfg, batch_size=2, rtol=1e-5)
