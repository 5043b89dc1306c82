"""Run-to-run determinism of the fp32 CPU step (README: "bit for bit").

With several threads, every reduction whose order could follow the threads' timing must
not: the grouped convolution's weight gradient (summed per chunk of work items, the
chunks fixed by their count, whichever thread takes each) was the one that did, so two
identical runs drifted apart by ~1e-7. GEMMs, torch's reductions and the fused LAMB
split their work statically: the same for a given thread count, not across counts.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from custom_ops import library_status
from custom_ops.grouped_conv1d import compiled_available, grouped_conv1d

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not compiled_available(),
                    reason=f"compiled grouped_conv1d unavailable: {library_status()}")
@pytest.mark.usefixtures("cpu_level")
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_grouped_conv_gradients_are_the_same_run_to_run_at_any_thread_count(threads):
    """The demo's convolution (H 128, 16 channels per group, kernel 7) over 16 × 131 rows: enough
    work for every thread to take part, each call's gradients identical to the first's, at
    every kernel level."""
    level = torch.ops.groupbert.cpu_capability()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        x = torch.randn(16, 131, 128, generator=gen, requires_grad=True)
        w = (0.1 * torch.randn(128, 16, 7, generator=gen)).requires_grad_()
        mask = (torch.rand(16, 131, generator=gen) > 0.2).float()
        grad_out = torch.randn(16, 131, 128, generator=gen)
        first = None
        for call in range(24):
            x.grad = w.grad = None
            grouped_conv1d(x, w, mask, implementation="compiled").backward(grad_out)
            if first is None:
                first = (x.grad.clone(), w.grad.clone())
                continue
            for name, got, want in (("input", x.grad, first[0]), ("weight", w.grad, first[1])):
                worst = (got - want).abs().max().item()
                assert torch.equal(got, want), f"{level}, {threads} threads, call {call}: the {name} gradient " \
                                               f"differs from the first call's by up to {worst:.3g}"
    finally:
        torch.set_num_threads(previous)


def _demo_run(out: Path, data: Path, *args: str) -> subprocess.CompletedProcess:
    """configs/demo.json as `make train` runs it (2 threads), shortened: 6 steps of 8 sequences,
    a checkpoint every 3 steps and an evaluation of 64 held-out sequences every 2."""
    command = [sys.executable, "bert.py", "--config", "configs/demo.json", "--training.steps", "6",
               "--batch.micro_batch_size", "8", "--schedule.warmup_steps", "2", "--training.log_every", "1",
               "--checkpoint.every", "3", "--evaluation.every", "2", "--data.eval_samples", "64",
               "--data.directory", str(data), "--training.output_dir", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _logged(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = ("load_average", "tflops", "mfu")  # the pace, not the run's figures
    return [{k: v for k, v in r.items() if not k.endswith("_per_s") and k not in timed} for r in records]


def _assert_same_files(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir() if p.name.endswith((".data", ".safetensors")))
    assert files, f"{a} holds no weights"
    for file in files:
        digests = [hashlib.sha256((run / file).read_bytes()).hexdigest() for run in (a, b)]
        assert digests[0] == digests[1], f"{a.name}/{file} differs between {a.parent.name} and {b.parent.name}"


@pytest.mark.slow
def test_two_fresh_demo_runs_with_two_threads_are_equal_bit_for_bit(tmp_path):
    """Every figure logged (losses every step, evaluations) and every checkpoint file (weights,
    optimizer state) of two identical fresh runs are identical, and so are those of a third
    run resumed from the first's checkpoint at step 3."""
    runs = []
    for name in ("first", "second"):
        result = _demo_run(tmp_path / name, tmp_path / "demo_data")
        assert result.returncode == 0, result.stderr[-4000:]
        runs.append(tmp_path / name)
    first, second = (_logged(run) for run in runs)
    assert [r["step"] for r in first if "loss" in r] == list(range(1, 7))
    assert len([r for r in first if "eval_loss" in r]) >= 3
    for a, b in zip(first, second, strict=True):
        assert a == b, f"step {a['step']}: {a} != {b}"
    for checkpoint in ("checkpoint-3", "checkpoint-final"):
        _assert_same_files(runs[0] / checkpoint, runs[1] / checkpoint)
    result = _demo_run(tmp_path / "resumed", tmp_path / "demo_data", "--checkpoint-input", str(runs[0] / "checkpoint-3"))
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = _logged(tmp_path / "resumed")
    after = [r for r in first if r["step"] > 3]
    assert [r for r in resumed if r["step"] > 3] == after and after
    _assert_same_files(runs[0] / "checkpoint-final", tmp_path / "resumed" / "checkpoint-final")
