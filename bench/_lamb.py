"""Fused LAMB benchmark: one optimizer step over BERT-base parameters.

Correctness first (small BERT-shaped model, a few steps): our fused `Lamb` against
the `torch._foreach_*` LAMB below (same semantics) and against torch-optimizer's
`Lamb` (different semantics: no bias correction by default, trust ratio on every
tensor, weight norm clamped at 10; compared where they coincide). Then the step is
timed on the real BERT-base shapes (110.1 M values in 206 tensors), with all threads
and with one, variants (and the copy) alternating within every repeat, medians:

  ours            session.optimizers.Lamb(fused=True): lamb_stage1 + lamb_stage2
  torch_optimizer torch_optimizer.Lamb: a per-tensor Python loop of eager ops
  foreach         LAMB from torch._foreach_* ops (multi-tensor, no custom kernel)
  floor           40 bytes per parameter (read g, m, v, p; write m, v, u; read p, u;
                  write p) at the bandwidth of a large copy (8 bytes per element)

Each CPU kernel level this machine runs (bench/_levels.py) is timed in a child process
with our kernels and torch's capped the same way. `run(level)` returns the dict that
bench/ops.py merges into bench/results/ops.json; `python bench/_lamb.py [--level L]
[--smoke]` prints the tables on their own (--smoke: a BERT of hidden 48, 2 layers, a
4 MiB copy, all threads only).
"""
from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _levels  # noqa: E402

from bert.model import no_weight_decay  # noqa: E402
from custom_ops import library_status, load_library  # noqa: E402
from session.optimizers import Lamb  # noqa: E402

REPEATS = 5
BYTES_PER_PARAM = 40  # fp32: stage 1 reads g, m, v, p and writes m, v, u; stage 2 reads p, u and writes p
HYPER = dict(lr=6e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)


def bert_shapes(vocab=30522, positions=512, hidden=768, layers=12, ffn=3072) -> list[tuple[str, tuple[int, ...]]]:
    """HuggingFace BertForPreTraining parameters (the MLM decoder weight is tied to the word embedding)."""
    h = hidden
    shapes = [
        ("bert.embeddings.word_embeddings.weight", (vocab, h)),
        ("bert.embeddings.position_embeddings.weight", (positions, h)),
        ("bert.embeddings.token_type_embeddings.weight", (2, h)),
        ("bert.embeddings.LayerNorm.weight", (h,)),
        ("bert.embeddings.LayerNorm.bias", (h,)),
    ]
    for i in range(layers):
        p = f"bert.encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            shapes += [(f"{p}.attention.self.{proj}.weight", (h, h)), (f"{p}.attention.self.{proj}.bias", (h,))]
        shapes += [
            (f"{p}.attention.output.dense.weight", (h, h)), (f"{p}.attention.output.dense.bias", (h,)),
            (f"{p}.attention.output.LayerNorm.weight", (h,)), (f"{p}.attention.output.LayerNorm.bias", (h,)),
            (f"{p}.intermediate.dense.weight", (ffn, h)), (f"{p}.intermediate.dense.bias", (ffn,)),
            (f"{p}.output.dense.weight", (h, ffn)), (f"{p}.output.dense.bias", (h,)),
            (f"{p}.output.LayerNorm.weight", (h,)), (f"{p}.output.LayerNorm.bias", (h,)),
        ]
    shapes += [
        ("bert.pooler.dense.weight", (h, h)), ("bert.pooler.dense.bias", (h,)),
        ("cls.predictions.bias", (vocab,)),
        ("cls.predictions.transform.dense.weight", (h, h)), ("cls.predictions.transform.dense.bias", (h,)),
        ("cls.predictions.transform.LayerNorm.weight", (h,)), ("cls.predictions.transform.LayerNorm.bias", (h,)),
        ("cls.seq_relationship.weight", (2, h)), ("cls.seq_relationship.bias", (2,)),
    ]
    return shapes


class ForeachLamb:
    """LAMB with the semantics of session.optimizers.Lamb, written with torch._foreach_* ops."""

    def __init__(self, named_params, lr, betas, eps, weight_decay):
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        named = list(named_params)
        self.decay = [p for n, p in named if not no_weight_decay(n)]
        self.plain = [p for n, p in named if no_weight_decay(n)]
        self.params = self.decay + self.plain
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        grads = [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, grads, 1 - b1)  # m ← β₁m + (1 − β₁)g
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, 1 - b2)
        denom = torch._foreach_div(self.v, 1 - b2**self.t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, self.eps)
        update = torch._foreach_div(self.m, denom)
        torch._foreach_div_(update, 1 - b1**self.t)
        k = len(self.decay)
        torch._foreach_add_(update[:k], self.decay, alpha=self.wd)
        p_norms = torch.stack(torch._foreach_norm(self.decay))
        u_norms = torch.stack(torch._foreach_norm(update[:k]))
        trust = torch.where((p_norms > 0) & (u_norms > 0), p_norms / u_norms, 1.0)
        scales = (-self.lr * trust).tolist() + [-self.lr] * len(self.plain)
        torch._foreach_mul_(update, scales)
        torch._foreach_add_(self.params, update)


def _named_params(shapes, seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        named.append((name, p))
    return named


def _clone(named) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for name, p in named:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append((name, q))
    return out


def _set_grads(named, grads) -> None:
    for (_, p), g in zip(named, grads):
        p.grad.copy_(g)


def _rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a.double() - e.double()).abs().max() / e.double().abs().max()).item()


SMALL_BERT = dict(vocab=301, positions=40, hidden=48, layers=2, ffn=192)


def _check() -> dict[str, float]:
    """Relative errors after 3 steps on a small BERT (hidden 48, 2 layers, vocab 301)."""
    shapes = bert_shapes(**SMALL_BERT)
    base = _named_params(shapes, seed=0)
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * i + j)) * 1e-3 for j, (_, s) in
              enumerate(shapes)] for i in range(3)]
    ours_p, foreach_p = _clone(base), _clone(base)
    ours = Lamb(ours_p, fused=True, **HYPER)
    foreach = ForeachLamb(foreach_p, **HYPER)
    for g in grads:
        _set_grads(ours_p, g)
        _set_grads(foreach_p, g)
        ours.step()
        foreach.step()
    errors = {"vs_foreach": max(_rel_err(a, e) for (_, a), (_, e) in zip(ours_p, foreach_p))}

    # torch-optimizer without bias correction or weight decay: its step is lr·‖p‖·a/‖a‖
    # with a = m/(√v + eps), ours the same with bias-corrected m, v: equal up to eps,
    # which is set to 0 here. Only tensors with a trust ratio in ours (it has no exclusions).
    hyper = dict(HYPER, weight_decay=0.0, eps=0.0)
    ours_p, theirs_p = _clone(base), _clone(base)
    ours = Lamb(ours_p, fused=True, **hyper)
    theirs = torch_optimizer.Lamb([p for _, p in theirs_p], debias=False, **hyper)
    _set_grads(ours_p, grads[0])
    _set_grads(theirs_p, grads[0])
    ours.step()
    theirs.step()
    errors["vs_torch_optimizer_step1_weights"] = max(
        _rel_err(a - p0.detach(), e - p0.detach())
        for (n, a), (_, e), (_, p0) in zip(ours_p, theirs_p, base) if not no_weight_decay(n)
    )
    if errors["vs_foreach"] > 1e-5 or errors["vs_torch_optimizer_step1_weights"] > 1e-4:
        raise AssertionError(f"fused LAMB disagrees with its peers: {errors}")
    return errors


def _time_variants(variants: dict, repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, alternating them per repeat."""
    for fn in variants.values():
        fn()  # warm-up: first-touch of the state buffers
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


COPY_NUMEL, SMOKE_COPY_NUMEL = 64 * 2**20, 2**20  # 256 MiB each way, far past the caches (smoke: 4 MiB)


def _time_all(shapes, threads: int, smoke: bool = False) -> tuple[dict[str, float], float]:
    """Median step times of the three LAMBs and of a large copy (alternating), and the copy's bytes/s."""
    base = _named_params(shapes, seed=0)
    ours_p, theirs_p = _clone(base), _clone(base)
    ours = Lamb(ours_p, fused=True, **HYPER)
    theirs = torch_optimizer.Lamb([p for _, p in theirs_p], **HYPER)
    foreach = ForeachLamb(base, **HYPER)
    copy_numel = SMOKE_COPY_NUMEL if smoke else COPY_NUMEL
    src = torch.randn(copy_numel)
    dst = torch.empty_like(src)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = _time_variants({"ours": ours.step, "torch_optimizer": theirs.step, "foreach": foreach.step,
                            "copy": lambda: dst.copy_(src)}, 2 if smoke else REPEATS)
    finally:
        torch.set_num_threads(previous)
    return t, 2 * 4 * copy_numel / t["copy"]  # the copy reads and writes 4 bytes per element


def run(level: str = _levels.NATIVE, smoke: bool = False) -> dict:
    """Checks, times and returns {"lamb_vs_torch_optimizer", "lamb_vs_foreach", "lamb_vs_floor", "lamb": details}
    at one kernel level, in a child process with that level's caps.

    Speed-ups are peer time / our time, `lamb_vs_floor` our time / floor time.
    """
    return _levels.run_child(Path(__file__), level, args=["--smoke"] if smoke else [])


def _run_here(level: str, smoke: bool = False) -> dict:
    if not load_library():
        raise RuntimeError(f"compiled fused LAMB unavailable ({library_status()}): run `make`")
    _levels.check_child_level(level)
    errors = _check()
    shapes = bert_shapes(**SMALL_BERT) if smoke else bert_shapes()
    n_params = sum(math.prod(s) for _, s in shapes)
    caps = " ".join(f"{k}={v}" for k, v in _levels.LEVEL_ENV[level].items()) or "nothing capped"
    print(f"\n=== LAMB step at level {level}{' (smoke: tiny sizes)' if smoke else ''} ({caps}; ours runs "
          f"{torch.ops.groupbert.cpu_capability()}; torch's ATen {torch.backends.cpu.get_cpu_capability()})")
    model = "small BERT" if smoke else "BERT-base"
    print(f"{model}: {n_params / 1e6:.1f} M parameters in {len(shapes)} tensors, fp32, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print("check (3 steps, small BERT): max relative error vs foreach "
          f"{errors['vs_foreach']:.1e}, vs torch-optimizer (step 1, weights) "
          f"{errors['vs_torch_optimizer_step1_weights']:.1e}")

    result: dict = {"lamb": {"level": level, "ours_level": torch.ops.groupbert.cpu_capability(), "params": n_params,
                             "tensors": len(shapes), "repeats": 2 if smoke else REPEATS, "max_rel_err": errors,
                             "smoke": smoke}}
    # All threads (how training runs, the headline), then one thread as well: on a
    # loaded machine the peers' thousands of short parallel regions stall on
    # descheduled threads, which inflates all-thread speed-ups; the 1-thread figures,
    # reported beside the headline, are free of that.
    default_threads = torch.get_num_threads()
    for threads in [default_threads] if smoke else dict.fromkeys([default_threads, 1]):
        t, copy_bps = _time_all(shapes, threads, smoke)
        gc.collect()
        floor = BYTES_PER_PARAM * n_params / copy_bps
        r = {
            "ours_ms": t["ours"] * 1e3, "torch_optimizer_ms": t["torch_optimizer"] * 1e3,
            "foreach_ms": t["foreach"] * 1e3, "floor_ms": floor * 1e3, "copy_gbps": copy_bps / 1e9,
            "ours_gbps_at_40_bytes": BYTES_PER_PARAM * n_params / t["ours"] / 1e9,
            "vs_torch_optimizer": t["torch_optimizer"] / t["ours"], "vs_foreach": t["foreach"] / t["ours"],
            "vs_floor": t["ours"] / floor, "load_average": os.getloadavg()[0],
        }
        result["lamb"][f"threads_{threads}"] = r
        print(f"\n{threads} thread(s), load average {r['load_average']:.2f}: copy {r['copy_gbps']:.1f} GB/s "
              f"-> floor = {BYTES_PER_PARAM} B x {n_params / 1e6:.1f} M / {r['copy_gbps']:.1f} GB/s = "
              f"{r['floor_ms']:.0f} ms")
        print(f"  ours (fused)     {r['ours_ms']:7.0f} ms  ({r['ours_gbps_at_40_bytes']:.1f} GB/s at 40 B/param, "
              f"x{r['vs_floor']:.2f} the floor)")
        print(f"  torch-optimizer  {r['torch_optimizer_ms']:7.0f} ms  -> ours is x{r['vs_torch_optimizer']:.2f} faster")
        print(f"  foreach          {r['foreach_ms']:7.0f} ms  -> ours is x{r['vs_foreach']:.2f} faster")
    headline = result["lamb"][f"threads_{default_threads}"]
    result["lamb_vs_torch_optimizer"] = headline["vs_torch_optimizer"]
    result["lamb_vs_foreach"] = headline["vs_foreach"]
    result["lamb_vs_floor"] = headline["vs_floor"]
    print(f"\nheadline ({default_threads} threads, the default): " + ", ".join(
        f"{k} {result[k]:.2f}" for k in ("lamb_vs_torch_optimizer", "lamb_vs_foreach", "lamb_vs_floor")))
    return result


if __name__ == "__main__":
    _levels.main(__doc__, _run_here, run, "lamb")
