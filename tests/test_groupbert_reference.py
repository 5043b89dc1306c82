"""GroupBERT mode against the independent eager-torch reference in tests/reference_groupbert.py."""
import torch

from bert import build_model
from session import LoweredGraph
from tests.helpers import assert_close, random_batch, tiny_config
from tests.reference_groupbert import groupbert_pretraining


def test_groupbert_matches_eager_reference_forward_and_backward():
    cfg = tiny_config("groupbert")
    ours = LoweredGraph(build_model(cfg).builder.model_proto())
    batch = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, pad_from=4).items()}
    ref_weights = {n: p.detach().clone().requires_grad_() for n, p in ours.named_weights()}

    out = ours(batch)
    ref = groupbert_pretraining(ref_weights, cfg, batch)
    for name in ("mlm_logits", "nsp_logits", "loss"):
        assert_close(out[name], ref[name], 1e-5, name)

    out["loss"].backward()
    ref["loss"].backward()
    noise = 1e-8 * max(w.grad.abs().max().item() for w in ref_weights.values())
    for name, p in ours.named_weights():
        assert_close(p.grad, ref_weights[name].grad, 1e-5, f"grad {name}", atol=noise)


def test_padded_positions_do_not_leak_through_the_convolution():
    """Changing padded tokens must not change any unpadded output (mask honoured in the conv)."""
    cfg = tiny_config("groupbert")
    ours = LoweredGraph(build_model(cfg).builder.model_proto()).eval()
    batch = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 2, pad_from=6).items()}
    other = dict(batch, input_ids=torch.where(batch["input_mask"] == 0, 7, batch["input_ids"]))
    with torch.no_grad():
        a, b = ours(batch), ours(other)
    assert_close(a["mlm_logits"], b["mlm_logits"], 1e-6, "mlm_logits with other padding tokens")


def test_bf16_grouped_ffn_path_matches_the_fp32_reference():
    """Under bf16 autocast the lowering takes other kernels (block-diagonal matmul, plain
    attention); the model must still agree with the fp32 reference to bf16 accuracy."""
    cfg = tiny_config("groupbert")
    ours = LoweredGraph(build_model(cfg).builder.model_proto())
    batch = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, pad_from=4).items()}
    weights = {n: p.detach().clone().requires_grad_() for n, p in ours.named_weights()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(batch)
    ref = groupbert_pretraining(weights, cfg, batch)
    assert_close(out["mlm_logits"].float(), ref["mlm_logits"], 3e-2, "bf16 mlm_logits")
    out["loss"].backward()
    ref["loss"].backward()
    for name in ("bert.encoder.layer.0.ffn1.grouped.weight", "bert.encoder.layer.1.ffn2.grouped.weight"):
        grad = dict(ours.named_weights())[name].grad
        assert_close(grad, weights[name].grad, 5e-2, f"bf16 grad {name}")
