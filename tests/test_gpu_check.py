"""The GPU check (bench/gpu_check.py, `make gpu-check`): its dry run end to end on the CPU, as
docs/gpu.md writes it, and the machinery that must work the first time it runs on a GPU (wheels
from .whl into a private directory, time caps, failures recorded, results rewritten after
every step, docs/gpu.md rendered from the record)."""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, load_bench, normalise_name, read_pins

# Loaded from its file, under a name of its own (tests/helpers.py, `load_bench`).
gpu_check = load_bench("gpu_check")

STEPS = ["environment", "wheels", "build", "tests", "cpu-isa", "run", "peaks", "bert", "groupbert", "conv", "lamb", "norm",
         "profile", "compile", "batch", "equal-time"]


def _snapshot(path: Path):
    return path.read_bytes() if path.exists() else None


@pytest.mark.slow
def test_the_dry_run_passes_as_docs_gpu_md_writes_it(tmp_path):
    command = "make gpu-check DRY_RUN=1"
    assert f"\n    {command}\n" in (ROOT / "docs" / "gpu.md").read_text(), "docs/gpu.md no longer shows the command"
    before = {p: _snapshot(p) for p in (gpu_check.RESULTS, gpu_check.DOC)}
    env = dict(os.environ, TMPDIR=str(tmp_path))  # its temporary directory lands here
    start = time.monotonic()
    proc = subprocess.run(command.split(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    json_path = Path(re.search(r"results -> (\S+/gpu\.json)", proc.stdout).group(1))
    assert json_path.parent.parent == tmp_path, json_path
    record = json.loads(json_path.read_text())

    # Every step ran and passed, in order, on the CPU.
    assert record["mode"].startswith("dry-run")
    assert list(record["steps"]) == STEPS
    assert {name: s["status"] for name, s in record["steps"].items()} == dict.fromkeys(STEPS, "ok")
    steps = {name: s.get("results", {}) for name, s in record["steps"].items()}
    assert steps["environment"]["cuda_available"] in (False, True) and steps["environment"]["torch"]
    assert steps["build"]["cpu_capability"], steps["build"]
    tests = steps["tests"]
    assert tests["passed"] >= 20 and tests["failures"] == tests["errors"] == 0, tests
    isa = steps["cpu-isa"]
    assert isa["level"] == steps["build"]["cpu_capability"] and isa["passed"] >= 5 and isa["failures"] == 0, isa
    assert isa["amx"] == "hardware" or any(r.startswith("AMX tiles off") for r in isa["skip_reasons"]), isa
    run = steps["run"]
    assert [s["step"] for s in run["steps"]] == [1, 2] and all(math.isfinite(s["loss"]) for s in run["steps"])
    assert "configs/groupbert_large.json" in run["command"] and "--precision.dtype bf16" in run["command"]
    # The benchmarks' figures, checked before timed: each loss check within its bound.
    for arch in ("bert", "groupbert"):
        r = steps[arch]
        assert r["hf_attention"] == "sdpa" and all(err <= 2e-2 for err in r["check_rel_err"].values()), r
        assert r["ours_seq_per_s"] > 0 and r["hf_seq_per_s"] > 0 and r["flops_per_step"] > 0
    assert steps["conv"]["bf16"]["max_rel_err"]["grad_w"] <= 1e-2 and steps["conv"]["conv_vs_cudnn_fp32"] > 0
    assert steps["lamb"]["check_rel_err"] <= 1e-5 and steps["lamb"]["lamb_vs_floor"] > 0
    assert steps["norm"]["timed"] is False and "TRITON_INTERPRET" in steps["norm"]["why"]  # no interpreter here
    assert steps["compile"]["backend"] == "eager" and steps["compile"]["compiled_vs_eager"] > 0
    equal = steps["equal-time"]  # bert.py compare at equal seconds: both configs ran and were reported
    assert "configs/compare/gpu_equal_time.yaml" in (ROOT / "bench" / "gpu_check.py").read_text()
    assert set(equal["eval_mlm_loss"]) == {"bert", "groupbert"} and "| groupbert |" in equal["final_comparison"]
    fitted = steps["batch"]["runs"]  # batch.micro_batch_size auto: what fits the limit, timed against today's
    assert set(fitted) == {"bert_phase1", "bert_phase2", "groupbert_phase1"}, fitted
    for run in fitted.values():
        assert run["predicted_peak_gib"] <= run["limit_gib"] and run["micro_batch"] == 8 and run["today"] == 4, run
        assert run["b8"]["seq_per_s"] > 0 and run["chosen_vs_b64"] > 0
    profiled = steps["profile"]
    assert set(profiled) >= {"ours_bert", "ours_groupbert", "hf_bert_masked_only"}, profiled
    for name in ("ours_bert", "ours_groupbert", "hf_bert_masked_only"):
        prof = profiled[name]
        assert 0 < prof["busy_ms"] <= prof["wall_ms"] * 1.05 and prof["ops"], (name, prof)
    headline = record["headline"]
    for key in ("cuda_tests", "cpu_isa", "run_2step_losses", "gemm_tflops_bf16", "copy_gbps", "bert_ours_vs_hf",
                "groupbert_ours_vs_hf", "conv_vs_cudnn_bf16", "lamb_vs_adamw_fused", "lamb_vs_floor",
                "compile_vs_eager", "profile_ours_bert_device_busy", "equal_time_eval_mlm_loss",
                "auto_batch_bert_phase2"):
        assert key in headline, key

    doc = (json_path.parent / "gpu.md").read_text()
    assert doc == gpu_check.render(record) and "DRY RUN on the CPU" in doc
    # The project's own results are never written by a dry run.
    assert {p: _snapshot(p) for p in before} == before
    print(f"dry run: {seconds:.0f} s")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check would run")
def test_the_real_check_refuses_without_a_gpu_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--out-dir", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees no CUDA device" in proc.stderr and "make gpu-check DRY_RUN=1" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_docs_gpu_md_is_the_rendered_record():
    """docs/gpu.md is what the check writes: with no GPU run recorded, the page that says so."""
    results = gpu_check.RESULTS
    record = json.loads(results.read_text()) if results.exists() else None
    assert gpu_check.DOC.read_text() == gpu_check.render(record), (
        "docs/gpu.md differs from bench/gpu_check.render(...): regenerate it with "
        "python -c 'import json, sys; sys.path.insert(0, \"bench\"); import gpu_check; "
        "r = gpu_check.RESULTS; gpu_check.DOC.write_text(gpu_check.render(json.loads(r.read_text()) "
        "if r.exists() else None))'")
    if record is None:
        assert "No GPU figures have been measured yet" in gpu_check.DOC.read_text()
    else:
        assert record["mode"] == "gpu", "bench/results/gpu.json must come from a GPU run, never a dry run"


def test_requirements_gpu_pins_what_requirements_lock_pins():
    pins = dict(gpu_check.read_requirements(gpu_check.REQUIREMENTS))
    assert "pydantic" in pins, "bert/config/ imports pydantic at module level; the GPU image has none"
    locked = read_pins(ROOT / "requirements.lock")
    for name, version in pins.items():
        want = locked.get(normalise_name(name))
        assert version == want, f"requirements-gpu.txt pins {name}=={version}, requirements.lock {want}"


def _fake_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel: one module that knows its version."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.slow
def test_wheels_install_only_what_is_missing_into_a_private_directory(tmp_path, monkeypatch):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _fake_wheel(wheels, "gpu_check_probe", "1.2.0")
    _fake_wheel(wheels, "gpu_check_probe", "1.1.0")  # another version beside it is left alone
    present = importlib.metadata.version("pytest")
    requirements = tmp_path / "requirements-gpu.txt"
    requirements.write_text(f"# comment\ngpu-check-probe==1.2.0\npytest=={present}  # already here\n")
    site = tmp_path / "site"
    monkeypatch.setattr(gpu_check, "REQUIREMENTS", requirements)
    monkeypatch.setattr(gpu_check, "WHEELS", wheels)
    monkeypatch.setattr(gpu_check, "SITE", site)
    monkeypatch.setattr(gpu_check, "PROBE_IMPORTS", ("gpu_check_probe",))
    check = gpu_check.Check(True, tmp_path / "out", None, 300)
    out = gpu_check.step_wheels(check, 120)
    assert out["installed"] == {"gpu-check-probe": "1.2.0"} and out["site"] == str(site)
    assert (site / "gpu_check_probe.py").read_text() == "VERSION = '1.2.0'\n"
    assert check.env["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    assert out["versions_seen"] == {"gpu-check-probe": "1.2.0", "pytest": present}
    assert not any(site.glob("pytest*")), "a package already present was installed again"

    # A missing wheel is a failure that says what to do.
    requirements.write_text("gpu-check-probe==9.9\n")
    with pytest.raises(gpu_check.StepFailed, match=r"no wheel for gpu-check-probe==9\.9 .*make gpu-wheels"):
        gpu_check.step_wheels(gpu_check.Check(True, tmp_path / "out", None, 300), 120)


def test_a_failing_step_is_recorded_the_next_runs_and_the_results_are_rewritten(tmp_path):
    check = gpu_check.Check(True, tmp_path, tmp_path / "copy", 300)
    calls = []

    def fails(check, timeout):
        calls.append("fails")
        raise gpu_check.StepFailed("the build broke: see its output")

    def crashes(check, timeout):
        calls.append("crashes")
        return {}["no such key"]

    def passes(check, timeout):
        calls.append("passes")
        assert timeout <= 7
        return {"figure": 1.5}

    gpu_check.run_step(check, gpu_check.Step("alpha", 60, 1, "x"), fails)
    assert json.loads((tmp_path / "gpu.json").read_text())["steps"]["alpha"]["status"] == "failed"
    gpu_check.run_step(check, gpu_check.Step("beta", 60, 1, "x"), crashes)
    gpu_check.run_step(check, gpu_check.Step("gamma", 7, 1, "x"), passes)
    check.deadline = time.monotonic() + 5  # 5 s left: a step needing 10 is skipped, never started
    gpu_check.run_step(check, gpu_check.Step("delta", 60, 10, "x"), passes)
    assert calls == ["fails", "crashes", "passes"]
    record = json.loads((tmp_path / "gpu.json").read_text())
    steps = record["steps"]
    assert steps["alpha"] == {"status": "failed", "error": "the build broke: see its output",
                              "seconds": steps["alpha"]["seconds"]}
    assert steps["beta"]["status"] == "failed" and "KeyError" in steps["beta"]["error"]
    assert steps["gamma"]["status"] == "ok" and steps["gamma"]["results"] == {"figure": 1.5}
    assert steps["delta"]["status"] == "skipped" and "needs 10 s" in steps["delta"]["error"]
    assert (tmp_path / "copy" / "gpu.json").read_text() == (tmp_path / "gpu.json").read_text()
    assert (tmp_path / "gpu.md").read_text() == gpu_check.render(record)

    # A step whose results lack what the page reads costs neither the record nor the run.
    gpu_check.run_step(check, gpu_check.Step("run", 60, 1, "x"), passes)
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["steps"]["run"]["results"] == {"figure": 1.5} and "error" in record["headline"]
    assert "could not be rendered" in (tmp_path / "gpu.md").read_text()


@pytest.mark.slow
def test_a_child_past_its_cap_is_ended_with_its_process_group(tmp_path):
    check = gpu_check.Check(True, tmp_path, None, 300)
    marker = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(marker)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
              "time.sleep(60); print('slept', flush=True)")
    code, tail = check.run("sleeper", [sys.executable, "-c", script], timeout=3)
    assert code is None and "started" in tail and "slept" not in tail, "ended at its cap, not waited for"
    grandchild = int(marker.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the child's own child {grandchild} outlived the cap")


def test_helpers_read_pins_wheel_names_versions_and_junit(tmp_path):
    requirements = tmp_path / "r.txt"
    requirements.write_text("a-b==1.0\n\n# c\n")
    assert gpu_check.read_requirements(requirements) == [("a-b", "1.0")]
    requirements.write_text("a-b>=1.0\n")
    with pytest.raises(ValueError, match=r"'a-b>=1\.0' is not an exact pin"):
        gpu_check.read_requirements(requirements)
    (tmp_path / "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    assert gpu_check.find_wheel(tmp_path, "pydantic-core", "2.46.4").name.startswith("pydantic_core-2.46.4")
    assert gpu_check.find_wheel(tmp_path, "pydantic-core", "2.46.5") is None
    assert gpu_check._older("4.12.2", "4.16.0") and not gpu_check._older("4.16.0", "4.16.0")
    assert not gpu_check._older("10.0", "9.9")
    junit = tmp_path / "t.xml"
    junit.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                     '<testcase classname="tests.test_cuda" name="test_a"><failure/></testcase>'
                     '<testcase classname="tests.test_cuda" name="test_b"/></testsuite></testsuites>')
    counts = gpu_check.junit_counts(junit)
    assert counts["passed"] == 2 and counts["failed_tests"] == ["tests.test_cuda::test_a"]


def _record(date: str, gpu: str, steps: dict[str, float], command: str = "make gpu-check") -> dict:
    return {"schema": gpu_check.SCHEMA, "mode": "gpu", "command": command, "date": date, "budget_s": 540,
            "elapsed_s": 1.0, "headline": {},
            "steps": {name: {"status": "ok", "seconds": 1.0,
                             "results": {"gpu": gpu} if name == "environment" else {"figure": figure}}
                      for name, figure in steps.items()}}


def test_a_rerun_replaces_its_steps_in_the_record_it_reruns():
    base = _record("d0", "H200", {"environment": 0, "wheels": 0, "build": 0, "conv": 1.0, "lamb": 0.0})
    base["steps"]["lamb"] = {"status": "failed", "error": "RuntimeError: x", "seconds": 0.0}
    lamb = _record("d1", "H200", {"environment": 0, "wheels": 0, "build": 0, "lamb": 2.0}, "make gpu-check ONLY=lamb")
    merged = gpu_check.merge(base, lamb)
    assert list(merged["steps"]) == ["environment", "wheels", "build", "conv", "lamb"]  # the order of STEPS
    assert merged["steps"]["lamb"]["results"] == {"figure": 2.0} and merged["steps"]["lamb"]["rerun_date"] == "d1"
    assert merged["steps"]["conv"] == base["steps"]["conv"] and merged["date"] == "d0"
    assert [r["command"] for r in merged["reruns"]] == ["make gpu-check ONLY=lamb"]
    assert base["steps"]["lamb"]["status"] == "failed", "the base record is left as it was"

    # A later rerun of a new step adds to the list; one of the same step supersedes the earlier.
    profile = _record("d2", "H200", {"environment": 0, "wheels": 0, "build": 0, "profile": 3.0})
    merged = gpu_check.merge(merged, profile)
    assert list(merged["steps"])[-1] == "profile" and [r["date"] for r in merged["reruns"]] == ["d1", "d2"]
    again = gpu_check.merge(merged, _record("d3", "H200", {"environment": 0, "wheels": 0, "build": 0, "lamb": 4.0}))
    assert [r["date"] for r in again["reruns"]] == ["d2", "d3"] and again["steps"]["lamb"]["rerun_date"] == "d3"
    page = gpu_check.render(dict(again, steps={k: v for k, v in again["steps"].items() if k in ("environment", "build")}))
    assert "Rerun by `make gpu-check` on d3" in page and "| build | ok | 1.0 | rerun d3 |" in page

    # Figures from another GPU never share a record.
    other = gpu_check.merge(base, _record("d4", "H100", {"environment": 0, "lamb": 5.0}))
    assert list(other["steps"]) == ["environment", "lamb"] and "on H100" in other["merge_refused"]


def test_only_runs_the_named_steps_after_their_prerequisites(tmp_path, capsys):
    names = [step.name for step, _ in gpu_check.plan(False, ["lamb", "conv"])]
    assert names == ["environment", "wheels", "build", "conv", "lamb"]
    assert [step.name for step, _ in gpu_check.plan(True, ["tests"])] == ["environment", "wheels", "build", "tests"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "lamb,nonesuch"])
    assert "--only: no step named nonesuch" in capsys.readouterr().err

    # A rerun of the dry run's record in the same directory merges into it.
    (tmp_path / "gpu.json").write_text(json.dumps(dict(_record("d0", "cpu", {"environment": 0, "conv": 1.0}),
                                                       mode="dry-run (cpu, tiny sizes)")))
    check = gpu_check.Check(True, tmp_path, None, 300, only=["tests"])
    assert check.base["date"] == "d0" and check.record["command"] == "make gpu-check DRY_RUN=1 ONLY=tests"


def test_a_runner_timed_in_two_steps_is_recorded_with_its_spread():
    """The figures disagreed with themselves unnoticed (our eager BERT step 72.8, 53.2 and 67.3 ms
    in three steps of one check): each runner timed in more than one step is recorded with its
    times, the spread and whether it is within 5 %; a step that failed or did not time it
    counts for nothing."""
    def ok(results):
        return {"status": "ok", "results": results}

    record = {"steps": {"bert": ok({"ours_step_ms": 72.8, "hf_step_ms": 74.6, "hf_masked_step_ms": 60.0}),
                        "groupbert": ok({"hf_step_ms": 72.0, "hf_masked_step_ms": 61.0}),
                        "profile": ok({"ours_bert": {"wall_ms": 53.2}, "hf_bert_masked_only": {"wall_ms": 62.0}}),
                        "compile": {"status": "failed", "results": {"eager_step_ms": 10.0}}}}
    found = gpu_check.agreement(record)
    ours = found["our BERT-Large eager step"]
    assert ours["ms"] == {"bert": 72.8, "profile": 53.2} and ours["spread"] == pytest.approx(72.8 / 53.2 - 1)
    assert not ours["within"]
    assert found["HF BERT-Large, all positions"]["within"] and found["HF BERT-Large, masked positions only"]["within"]
    del record["steps"]["profile"]
    assert "our BERT-Large eager step" not in gpu_check.agreement(record), "timed once: nothing to agree with"
    page = "\n".join(gpu_check._render_steps({"steps": {}, "headline": {"agreement": {"ours": ours}}}))
    assert "- ours: 72.8 ms (bert), 53.2 ms (profile); spread 36.8 %, **not within** 5%" in page, page
