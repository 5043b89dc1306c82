"""Every benchmark's `--smoke` mode runs (tiny sizes, seconds) and writes no results file,
so the benchmarks cannot rot."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, *args: str) -> str:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{script} --smoke failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


@pytest.mark.slow
def test_train_throughput_smoke(tmp_path):
    out = tmp_path / "train_throughput.json"
    stdout = _smoke("train_throughput.py", "--out", str(out))
    assert not out.exists(), "--smoke must write no results file"
    # The loss checks ran and every headline ratio was measured, with its spread.
    assert "check fp32: BERT loss" in stdout and "check bf16: BERT loss" in stdout
    for key in ("bert_gemm_fraction_fp32", "bert_vs_hf_masked_fp32", "bert_vs_hf_masked_bound_fp32",
                "groupbert_vs_bert_fp32", "bert_vs_hf_masked_bf16"):
        assert f"\n  {key} " in stdout, f"{key} missing from:\n{stdout[-2000:]}"


@pytest.mark.slow
def test_step_profile_smoke(tmp_path):
    out = tmp_path / "step_profile.json"
    stdout = _smoke("step_profile.py", "--out", str(out))
    assert not out.exists(), "--smoke must write no results file"
    for model in ("bert", "groupbert"):
        assert f"\n{model}: kernels (" in stdout
    for cls in ("GEMM", "attention", "conv", "normalisation and elementwise", "copies and fills", "optimizer",
                "framework overhead"):
        assert f"    {cls} " in stdout, f"class {cls!r} missing from:\n{stdout[-2000:]}"
    assert stdout.count("GEMM fraction = GEMMs alone / step") == 2


@pytest.mark.slow
def test_linear_smoke():
    stdout = _smoke("linear.py")
    assert stdout.count("\n    64 ") == 2, stdout  # both shapes checked against F.linear, then timed
