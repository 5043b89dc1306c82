"""Every benchmark's --smoke mode runs (tiny sizes, seconds) and writes no results file, so a
broken import or a renamed key fails here rather than in the next full benchmark run."""
import subprocess
import sys

import pytest

from tests.tiny_runs import ROOT


def _results(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.json"))}


@pytest.mark.slow
def test_bench_squad_smoke(tmp_path):
    before = _results(ROOT / "bench/results")
    result = subprocess.run([sys.executable, str(ROOT / "bench/squad.py"), "--smoke", "--threads", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert "exact match: ours" in out and "F1: ours" in out and "within 2 points" in out, out[-2000:]
    assert "smoke: both sides trained 3 steps and were scored" in out
    assert _results(ROOT / "bench/results") == before, "--smoke writes no results file"
    assert not list(tmp_path.iterdir()), "--smoke leaves nothing behind"


def _smoke(script: str, tmp_path, *extra: str) -> str:
    """Run `bench/<script> --smoke` from an empty directory: its output, after checking that
    it exited 0, wrote no results file and left nothing behind."""
    before = _results(ROOT / "bench/results")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", *extra], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert "no results file written" in out, out[-2000:]
    assert _results(ROOT / "bench/results") == before, "--smoke writes no results file"
    assert not list(tmp_path.iterdir()), "--smoke leaves nothing behind"
    return out


@pytest.mark.slow
def test_bench_cross_entropy_smoke(tmp_path):
    out = _smoke("cross_entropy.py", tmp_path)
    for dtype in ("bf16", "fp32"):
        assert f"40 × 8192 {dtype}: check vs float64: ours loss" in out, dtype
    assert "the floor" in out and "BERT bf16 training step" in out and "cross_entropy=compiled" in out, out[-2000:]


@pytest.mark.slow
def test_bench_input_pipeline_smoke(tmp_path):
    out = _smoke("input_pipeline.py", tmp_path)
    assert "create_pretraining_data:" in out and "sentences/s" in out and "check: {'masked_share'" in out
    for mode in ("b256", "b32", "b256_dynamic_masking", "b256_packing", "peer_nvidia_style_b256"):
        assert f"loader {mode}: " in out, mode


@pytest.mark.slow
def test_bench_inference_smoke(tmp_path):
    out = _smoke("inference.py", tmp_path)
    for runtime in ("ort_fp32", "ort_int8", "session_fp32", "hf_fp32"):
        assert f"{runtime:13s} seq_per_s_b32" in out, runtime
    assert "hf_fp32 " in ("\n" + out).split("\nbert_base seq 128: check vs session:")[1].split("\n")[0], "BERT checked against HF"
    for key in ("ort_vs_session_seq128", "ort_vs_hf_seq128", "groupbert_ort_vs_session_seq128"):
        assert f" {key} " in out, key


@pytest.mark.slow
def test_bench_finetune_smoke(tmp_path):
    out = _smoke("finetune.py", tmp_path, "--threads", "1")
    assert "check: first-batch loss ours packed " in out and "smoke: all three runners trained" in out
    for runner in ("packed", "padded", "hf"):
        assert f"  {runner:7s} " in out and "sentences/s" in out, runner
    assert "packed vs HF dynamic padding: " in out


@pytest.mark.slow
def test_bench_finetune_parity_smoke(tmp_path):
    """Both sides fine-tune the tiny BERT on both demo sets at 2 seeds, are scored by the
    libraries, and the product's verdict and interval are printed for each task."""
    out = _smoke("finetune_parity.py", tmp_path, "--threads", "1")
    for task in ("classification", "tokens"):
        assert f"check: {task}: 3 steps at dropout 0 from the same head: losses " in out, task
        assert f"== {task}, 3 steps, 2 seeds per side" in out and out.count(f"{task} 3 steps seed ") == 2, task
    assert out.count("95 % Welch interval [") == 2 and out.count("   verdict: Ranked by the mean dev ") == 2
    assert "product behind transformers (Welch's t-test at 5 %): " in out


@pytest.mark.slow
def test_bench_packing_smoke(tmp_path):
    out = _smoke("packing.py", tmp_path)
    assert out.count("  check: loss ") == 2 and out.count("packed / padded = ") == 2
    assert "packed_vs_padded_tokens_per_s = min over the corpora" in out


@pytest.mark.slow
def test_bench_scaling_smoke(tmp_path):
    """The step-time part: torchrun with 1 and 2 processes (sharding off and on), each
    session inside session.distributed.launch, the losses equal to one process's."""
    out = _smoke("scaling.py", tmp_path)
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("measured")] == [
        ["measured", "1"], ["measured", "2"], ["measured", "2"]]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [r[:2] for r in rows] == [["1", "off"], ["2", "off"], ["2", "on"]], out
    assert float(rows[2][6]) == 0.5, "sharding halves the optimizer state per replica at 2 replicas"


@pytest.mark.slow
def test_bench_linear_smoke(tmp_path):
    out = _smoke("linear.py", tmp_path)
    assert out.count("\n    64 ") == 2, out  # both shapes checked against F.linear, then timed


@pytest.mark.slow
def test_bench_train_throughput_smoke(tmp_path):
    out = _smoke("train_throughput.py", tmp_path)
    # The loss checks ran and every headline ratio was measured, with its spread.
    assert "check fp32: BERT loss" in out and "check bf16: BERT loss" in out
    for key in ("bert_gemm_fraction_fp32", "bert_vs_hf_masked_fp32", "bert_vs_hf_masked_bound_fp32",
                "groupbert_vs_bert_fp32", "bert_vs_hf_masked_bf16"):
        assert f"\n  {key} " in out, f"{key} missing from:\n{out[-2000:]}"


@pytest.mark.slow
def test_bench_step_profile_smoke(tmp_path):
    out = _smoke("step_profile.py", tmp_path)
    for model in ("bert", "groupbert"):
        assert f"\n{model}: kernels (" in out
    for cls in ("GEMM", "attention", "conv", "normalisation and elementwise", "copies and fills", "optimizer",
                "framework overhead"):
        assert f"    {cls} " in out, f"class {cls!r} missing from:\n{out[-2000:]}"
    assert out.count("GEMM fraction = GEMMs alone / step") == 2


def test_train_throughput_ratios_read_as_tokens_per_s():
    """`a_vs_b` is a's tokens/s over b's; the GEMM fraction is the GEMMs' share of the step."""
    from tests.helpers import load_bench

    bench = load_bench("train_throughput")
    seconds = {"bert": [1.0, 2.0], "hf": [4.0, 6.0], "hf_masked": [1.5, 3.0], "groupbert": [2.0, 5.0],
               "gemms": [0.8, 1.0], "bert_compiled": [0.5, 1.0], "groupbert_compiled": [4.0, 5.0]}
    ratios = bench.ratios_per_repeat(seconds)
    assert ratios["bert_vs_hf"] == [4.0, 3.0] and ratios["bert_vs_hf_masked"] == [1.5, 1.5]
    assert ratios["hf_masked_vs_hf"] == [4.0 / 1.5, 2.0] and ratios["groupbert_vs_bert"] == [0.5, 0.4]
    assert ratios["bert_gemm_fraction"] == [0.8, 0.5] and ratios["bert_vs_hf_masked_bound"] == [1.5 / 0.8, 3.0]
    assert ratios["bert_compiled_vs_eager"] == [2.0, 2.0] and ratios["groupbert_compiled_vs_eager"] == [0.5, 1.0]


def _cpu_seconds(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    """The command's result and the CPU seconds it and its children took (user + system)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


@pytest.mark.slow
def test_bench_ops_smoke(tmp_path):
    # bench/ops.py: the compiled conv and LAMB against torch at every kernel level this CPU
    # runs, each level in a child process with both sides capped, the levels side by side.
    from custom_ops import library_status, load_library, supported_cpu_capabilities

    if not load_library():
        pytest.skip(f"compiled ops unavailable: {library_status()}")
    results = ROOT / "bench" / "results"
    before = {p.name: p.read_bytes() for p in sorted(results.glob("*.json"))}
    _, start_up = _cpu_seconds([sys.executable, "-c", "import torch"])
    done, cpu = _cpu_seconds([sys.executable, str(ROOT / "bench" / "ops.py"), "--smoke"], cwd=tmp_path, timeout=900)
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    # Seconds, not minutes: a smoke run's cost is its processes' start-up, one per level and
    # the parent (it took two per level, each importing torch._dynamo too: 20 to 30 times torch's import).
    levels = len(supported_cpu_capabilities()) + 1
    assert cpu < 4 * (levels + 1) * start_up, f"--smoke took {cpu:.1f} s of CPU; torch's import takes {start_up:.2f} s"
    table = out[out.rindex("bf16 kernel"):]
    for level in supported_cpu_capabilities() + ["native"]:
        assert f"\n{level} " in table, f"no row for level {level}:\n{table}"
        assert f"=== grouped_conv1d at level {level} (smoke" in out and f"=== LAMB step at level {level} (smoke" in out
    if "avx512_bf16" in supported_cpu_capabilities():
        row = next(line for line in table.splitlines() if line.startswith("avx512_bf16 "))
        assert row.endswith("avx512_bf16 dot products (vdpbf16ps)"), row
    assert "smoke run: no results file written" in out
    assert {p.name: p.read_bytes() for p in sorted(results.glob("*.json"))} == before, "--smoke wrote a results file"
    assert not list(tmp_path.iterdir()), "--smoke left files behind"


BENCHMARKS = sorted(p.name for p in (ROOT / "bench").glob("[!_]*.py"))


@pytest.mark.parametrize("script", BENCHMARKS)
def test_a_benchmark_starts_in_a_python_without_the_projects_packages(script, tmp_path):
    """`python -S` has no site-packages (no torch, no numpy): --help still prints the
    script's help, and a run ends in one line that says how to get the packages."""
    command = [sys.executable, "-S", str(ROOT / "bench" / script)]
    shown = subprocess.run([*command, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: "), shown.stdout + shown.stderr
    if script == "gpu_check.py":  # the standard library alone: it brings its own packages
        return
    ran = subprocess.run([*command, "--smoke"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 1 and len(lines) == 1, ran.stderr
    assert f"{script} needs the project's packages" in lines[0] and "lacks torch" in lines[0], lines[0]
    assert "make setup-dev" in lines[0] and not list(tmp_path.iterdir())


def test_a_benchmark_names_a_development_package_its_python_lacks(tmp_path):
    """A Python with torch and numpy but not a package one benchmark also imports (bench/ops.py:
    torch_optimizer, from make setup-dev): --help prints, a run ends in one line naming it."""
    script = tmp_path / "needs_more.py"
    script.write_text("import argparse, sys\n"
                      f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
                      "import _start\n"
                      "_start.check_packages(lambda: argparse.ArgumentParser(), 'groupbert_no_such_package')\n"
                      "print('ran on')\n")
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: "), shown.stdout + shown.stderr
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 1 and len(lines) == 1 and "ran on" not in ran.stdout, ran.stdout + ran.stderr
    assert "lacks groupbert_no_such_package" in lines[0] and "make setup-dev" in lines[0], lines[0]
