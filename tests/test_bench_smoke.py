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


def test_train_throughput_ratios_read_as_tokens_per_s():
    """`a_vs_b` is a's tokens/s over b's; the GEMM fraction is the GEMMs' share of the step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_throughput", ROOT / "bench" / "train_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seconds = {"bert": [1.0, 2.0], "hf": [4.0, 6.0], "hf_masked": [1.5, 3.0], "groupbert": [2.0, 5.0],
               "gemms": [0.8, 1.0], "bert_compiled": [0.5, 1.0], "groupbert_compiled": [4.0, 5.0]}
    ratios = bench.ratios_per_repeat(seconds)
    assert ratios["bert_vs_hf"] == [4.0, 3.0] and ratios["bert_vs_hf_masked"] == [1.5, 1.5]
    assert ratios["hf_masked_vs_hf"] == [4.0 / 1.5, 2.0] and ratios["groupbert_vs_bert"] == [0.5, 0.4]
    assert ratios["bert_gemm_fraction"] == [0.8, 0.5] and ratios["bert_vs_hf_masked_bound"] == [1.5 / 0.8, 3.0]
    assert ratios["bert_compiled_vs_eager"] == [2.0, 2.0] and ratios["groupbert_compiled_vs_eager"] == [0.5, 1.0]
