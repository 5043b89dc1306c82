#!/usr/bin/env python3
"""The GPU check: everything that needs a GPU, in one command within a time budget.

    make gpu-check [BUDGET_S=S] [COPY_TO=DIR]   python bench/gpu_check.py [--budget-s S] [--copy-to DIR]
    make gpu-check DRY_RUN=1         python bench/gpu_check.py --dry-run [--out-dir DIR]

On an NVIDIA machine as it comes, network or none (docs/gpu.md says how), in order:

  environment  Python, torch, CUDA, the GPU, the driver, nvcc, the host
  wheels       what requirements-gpu.txt lists and the machine lacks (or has older),
               installed from the wheels carried in .whl/ into a private directory
               (pip --target --no-index) that every later step finds on PYTHONPATH; the
               system's packages, torch among them, are never touched
  build        the custom ops with CUDA against the installed torch (the CMake build of
               `make ops`, for this GPU's architecture), then loaded, CUDA kernels checked
  tests        the CUDA tests (pytest -m gpu: tests/test_cuda.py and the CUDA tests of
               tests/test_grouped_conv1d.py, tests/test_fused_lamb.py, tests/test_step_casts.py and
               tests/test_weight_shadow.py)
  run          a 2-step GroupBERT-large bf16 pre-training run through `bert.py` on the GPU
               (configs/groupbert_large.json, synthetic data)
  peaks, bert, groupbert, conv, lamb, norm, profile, compile, batch
               the GPU benchmarks of bench/_gpu_bench.py, one process each
  equal-time   GroupBERT-Base against BERT-Base at 45 training seconds each, two seeds:
               `bert.py compare configs/compare/gpu_equal_time.yaml` on the GPU

Every step has a time cap inside one overall budget (--budget-s, for a machine that runs a
command for a limited time); a step that fails, crashes or runs out of time is recorded with why
and the next one runs. The figures go to bench/results/gpu.json and docs/gpu.md, both
rewritten after every step (and copied to --copy-to), so a cut-off run still leaves what
it measured. Exit status 0 when every step passed, 1 otherwise, 2 when there is no GPU
(without --dry-run).

`--dry-run` is the same script on the CPU at tiny sizes: nothing to install where the
packages are present, the CPU build of the ops (`make ops`'s, a no-op when it is up to
date), the CPU counterparts of the CUDA tests (pytest -m "not gpu" tests/test_cuda.py),
the 2-step run, every benchmark and a comparison of a few seconds on the CPU, the benchmarks
in one process; its
figures go to a temporary directory (or --out-dir), never to bench/results/gpu.json or
docs/gpu.md. tests/test_gpu_check.py runs it, so it cannot rot.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements-gpu.txt"
WHEELS = ROOT / ".whl"
RESULTS = ROOT / "bench" / "results" / "gpu.json"
DOC = ROOT / "docs" / "gpu.md"
SITE = Path(tempfile.gettempdir()) / "groupbert-gpu-site"  # the private install directory
BENCH_PARTS = ("peaks", "bert", "groupbert", "conv", "lamb", "norm", "profile", "compile", "batch")
SCHEMA = 1
PROBE_IMPORTS = ("pydantic",)  # imported after the install, with the children's PYTHONPATH
TAIL = 4000  # characters of each step's output kept in the JSON


@dataclass(frozen=True)
class Step:
    """One step of the check: its cap in seconds (GPU run) and the least time worth starting it with."""

    name: str
    cap_s: float
    min_s: float
    what: str


# In priority order: the budget runs out at the end of the list, never at its start.
STEPS = (
    Step("environment", 60, 5, "Python, torch, CUDA, GPU, driver, nvcc, host"),
    Step("wheels", 90, 10, "missing packages from .whl/ into a private PYTHONPATH directory"),
    Step("build", 300, 60, "custom ops with CUDA (CMake), loaded, CUDA kernels registered"),
    # 330 s: the 42 tests of 2026-11-27 (36 s), the Triton convolution's 10, whose kernels compile on first
    # use, and the graph choice and CUDA graphs', which compile the tiny model four times.
    Step("tests", 330, 30, "pytest -m gpu: tests/test_cuda.py, CUDA tests of the conv (compiled, Triton), LAMB and "
                           "the step's weight casts and copy"),
    Step("cpu-isa", 90, 20, "the host CPU's paths whose tests skip elsewhere (AMX tiles, AVX512-BF16): their tests "
                            "and known-answer runs"),
    Step("run", 180, 60, "2-step GroupBERT-large bf16 run: bert.py train --config configs/groupbert_large.json"),
    Step("peaks", 60, 15, "bf16 and fp32 GEMM peaks, copy bandwidth"),
    Step("bert", 150, 45, "BERT-Large bf16 training: ours vs HF BertForPreTraining, MFU"),
    Step("groupbert", 150, 45, "GroupBERT-Large bf16 training: ours vs HF BERT-Large, MFU"),
    Step("conv", 60, 15, "GroupedConv1d fwd+bwd vs cuDNN conv1d(groups)"),
    Step("lamb", 90, 20, "fused LAMB step vs torch fused AdamW and the HBM floor"),
    Step("norm", 45, 15, "fused residual add + layer norm (Triton, norm=triton) vs torch's, fwd+bwd, and the floor"),
    Step("profile", 120, 30, "where a step's time goes: ours (BERT-, GroupBERT-Large) and HF (torch.profiler)"),
    Step("compile", 240, 60, "BERT-Large step with torch.compile vs eager, ours and HF's (masked-only head)"),
    Step("batch", 150, 60, "batch.micro_batch_size auto: the micro batch that fits, BERT-Large at seq 128 and 512 and "
                           "GroupBERT-Large at 128, timed against batch 64"),
    Step("equal-time", 330, 240, "GroupBERT-Base vs BERT-Base at 45 training seconds each, 2 seeds: bert.py compare "
                                 "configs/compare/gpu_equal_time.yaml"),
)
GPU_BUDGET_S = 540  # fits a 10-minute command limit with room for Python's start and a timed-out step's end (≤ 30 s)
DRY_BUDGET_S = 900


class Check:
    """The state of one check run: where results go, the children's environment, the clock."""

    def __init__(self, dry_run: bool, out_dir: Optional[Path], copy_to: Optional[Path], budget_s: float,
                 only: Optional[list[str]] = None):
        self.dry_run = dry_run
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        if out_dir is None and dry_run:
            out_dir = Path(tempfile.mkdtemp(prefix="gpu-check-dry-run-"))
        self.json_path = out_dir / "gpu.json" if out_dir else RESULTS
        self.doc_path = out_dir / "gpu.md" if out_dir else DOC
        self.copy_to = copy_to
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if dry_run:
            self.env["OMP_NUM_THREADS"] = "1"  # a shared 2-core machine: see bench/_gpu_bench.py
        self.cuda_arch: Optional[str] = None
        self.torch_prefix: Optional[str] = None
        self.record: dict = {
            "schema": SCHEMA, "mode": "dry-run (cpu, tiny sizes)" if dry_run else "gpu",
            "command": ("make gpu-check" + (" DRY_RUN=1" if dry_run else "")
                        + (f" ONLY={','.join(only)}" if only else "")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s, "steps": {}, "headline": {},
        }
        # A rerun of some steps (--only) goes into the record it reruns: this directory's, else
        # the committed one, where it is of the same mode.
        self.base: Optional[dict] = None
        if only:
            for path in (self.json_path, RESULTS):
                if path.is_file():
                    base = json.loads(path.read_text())
                    if base.get("mode") == self.record["mode"]:
                        self.base = base
                        break

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @functools.cached_property
    def work(self) -> Path:
        """A scratch directory for the steps' files (the 2-step run's checkpoint, JUnit XML), made on
        first use and removed at the end."""
        return Path(tempfile.mkdtemp(prefix="gpu-check-work-"))

    # ------------------------------------------------------------ children

    def run(self, name: str, cmd: list[str], timeout: float, cwd: Path = ROOT) -> tuple[Optional[int], str]:
        """Runs `cmd`, its output passed through to ours line by line; (exit status or None
        on timeout, the tail of its output). A timed-out child's process group is ended."""
        print(f"[{name}] $ {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace")
        tail: list[str] = []
        size = [0]

        def pump() -> None:
            for line in proc.stdout:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()
                tail.append(line)
                size[0] += len(line)
                while size[0] > TAIL and len(tail) > 1:
                    size[0] -= len(tail.pop(0))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: Optional[int] = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            code = None
            _end_group(proc)
        reader.join(timeout=10)
        return code, "".join(tail)[-TAIL:]

    # ------------------------------------------------------------ results

    def save(self) -> None:
        """Writes the JSON and the markdown (atomically), a rerun merged into the record it
        reruns, and copies both to --copy-to."""
        self.record["elapsed_s"] = round(time.monotonic() - self.start, 1)
        record = merge(self.base, self.record) if self.base else self.record
        # A figure missing from a step's results must never cost the record: no exception leaves here.
        try:
            record["headline"] = headline(record)
        except Exception as e:  # noqa: BLE001
            record["headline"] = {"error": f"{type(e).__name__}: {e}"}
        try:
            page = render(record)
        except Exception as e:  # noqa: BLE001
            page = render_unreadable(record, f"{type(e).__name__}: {e}")
        for path, text in ((self.json_path, json.dumps(record, indent=1) + "\n"), (self.doc_path, page)):
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(text)
            partial.replace(path)
            if self.copy_to is not None:
                self.copy_to.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, self.copy_to / path.name)


def merge(base: dict, rerun: dict) -> dict:
    """`base`, a whole check's record, with the steps `rerun` ran (a check with --only) in
    place of its own, each marked with the rerun's date, in the order of STEPS; `rerun`
    alone where it ran on another GPU than `base` (figures of two GPUs never share a page)."""
    gpu = _results(rerun, "environment").get("gpu")
    if gpu is not None and gpu != _results(base, "environment").get("gpu"):
        return dict(rerun, merge_refused=f"the rerun ran on {gpu}, the record it reruns on "
                                         f"{_results(base, 'environment').get('gpu')}")
    steps = dict(base["steps"])
    for name, entry in rerun["steps"].items():
        steps[name] = dict(entry, rerun_date=rerun["date"])
    order = [s.name for s in STEPS]
    merged = dict(base, steps=dict(sorted(steps.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order
                                          else len(order))))
    # An earlier rerun stays listed while a step of its own (past the prerequisites) stands.
    reruns = [r for r in base.get("reruns", []) if r["date"] != rerun["date"]
              and set(r["steps"]) - set(PREREQUISITES) - set(rerun["steps"])]
    merged["reruns"] = reruns + [{"date": rerun["date"], "command": rerun["command"], "steps": list(rerun["steps"]),
                                  "elapsed_s": rerun.get("elapsed_s")}]
    return merged


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's own process group (it was started in a session of its own),
    SIGKILL if it is still there 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class StepFailed(Exception):
    """A step's failure, with what to record."""


# ---------------------------------------------------------------- the steps


def step_environment(check: Check, timeout: float) -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                  "host": platform.node(), "cpu": _cpu_model(), "cpus": os.cpu_count()}
    import torch  # the machine's own torch: never installed or replaced by this check

    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    check.torch_prefix = torch.utils.cmake_prefix_path
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        check.cuda_arch = f"{props.major}{props.minor}"
    info["nvidia_smi"] = _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"])
    info["nvcc"] = _first_line([_nvcc() or "nvcc", "--version"], last=True)
    info["cmake"] = _first_line(["cmake", "--version"])
    if not check.dry_run and not torch.cuda.is_available():
        raise NoGPU(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda = {torch.version.cuda}); "
                    "on a machine without a GPU run `make gpu-check DRY_RUN=1`")
    return info


class NoGPU(Exception):
    """The real check was started where torch sees no GPU: nothing is written."""


def step_wheels(check: Check, timeout: float) -> dict:
    """Installs the pinned packages the machine lacks (or has older) from .whl into SITE."""
    import importlib.metadata as metadata

    pins = read_requirements(REQUIREMENTS)
    found = {}
    for name, version in pins:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    missing = [(n, v) for n, v in pins if found[n] is None or _older(found[n], v)]
    out: dict = {"pins": dict(pins), "found": found, "installed": {}, "site": None}
    if missing:
        files = []
        for name, version in missing:
            wheel = find_wheel(WHEELS, name, version)
            if wheel is None:
                raise StepFailed(f"no wheel for {name}=={version} in {WHEELS}: run `make gpu-wheels` where pip reaches "
                                 "PyPI, and carry .whl (docs/gpu.md)")
            files.append(str(wheel))
        SITE.mkdir(parents=True, exist_ok=True)
        code, tail = check.run("wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                          "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                                          *files], timeout)
        if code != 0:
            raise StepFailed(f"pip install --target {SITE} failed (exit {code}): {tail[-500:]}")
        out.update(installed=dict(missing), site=str(SITE))
        check.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), check.env.get("PYTHONPATH")) if p)
    # What every later step will import, in a child that sees the same PYTHONPATH.
    probe = (f"import importlib, importlib.metadata as m, json; "
             f"[importlib.import_module(x) for x in {PROBE_IMPORTS!r}]; "
             f"print(json.dumps({{n: m.version(n) for n in {[n for n, _ in pins]!r}}}))")
    code, tail = check.run("wheels", [sys.executable, "-c", probe], min(timeout, 60))
    if code != 0:
        raise StepFailed(f"the packages do not import after the install: {tail[-500:]}")
    out["versions_seen"] = json.loads(tail.strip().splitlines()[-1])
    return out


def step_build(check: Check, timeout: float) -> dict:
    """`make ops`'s CMake build, with CUDA for this GPU's architecture on the GPU."""
    if check.torch_prefix is None:
        raise StepFailed("the environment step did not find torch")
    build_dir = ROOT / "build"
    configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DGROUPBERT_OPS_OUTPUT_DIR={ROOT / 'custom_ops' / 'lib'}",
                 f"-DPython_EXECUTABLE={shutil.which('python3') if check.dry_run else sys.executable}",
                 f"-DCMAKE_PREFIX_PATH={check.torch_prefix}"]
    if not check.dry_run:
        configure += cuda_configure_args(check)
    t0 = time.monotonic()
    code, tail = check.run("build", configure, timeout)
    if code != 0:
        raise StepFailed(f"cmake configure failed (exit {code}): {tail[-1500:]}")
    code, tail = check.run("build", ["cmake", "--build", str(build_dir), "--parallel", str(os.cpu_count() or 2)],
                           timeout - (time.monotonic() - t0))
    if code != 0:
        raise StepFailed(f"cmake --build failed (exit {code}): {tail[-1500:]}")
    probe = ("import json, torch, custom_ops; custom_ops.load_library(required=True); "
             "has = lambda op: torch._C._dispatch_has_kernel_for_dispatch_key(f'groupbert::{op}', 'CUDA'); "
             "print(json.dumps({'cpu_capability': custom_ops.cpu_capability(), "
             "'cuda_kernels': {op: has(op) for op in ('grouped_conv1d', 'grouped_conv1d_backward', 'lamb_stage1', "
             "'lamb_stage2', 'lamb_sq_norms')}}))")
    code, tail = check.run("build", [sys.executable, "-c", probe], 120)
    if code != 0:
        raise StepFailed(f"the built library does not load: {tail[-1500:]}")
    out = json.loads(tail.strip().splitlines()[-1])
    out.update(seconds_to_build=round(time.monotonic() - t0, 1), cuda_arch=check.cuda_arch)
    if not check.dry_run and not all(out["cuda_kernels"].values()):
        raise StepFailed(f"libgroupbert_ops.so was built without CUDA kernels: {out['cuda_kernels']}")
    return out


def step_tests(check: Check, timeout: float) -> dict:
    junit = check.work / "tests.xml"
    if check.dry_run:
        selection = ["tests/test_cuda.py", "-m", "not gpu"]
    else:
        selection = ["tests/test_cuda.py", "tests/test_grouped_conv1d.py", "tests/test_fused_lamb.py",
                     "tests/test_step_casts.py", "tests/test_weight_shadow.py", "-m", "gpu"]
    code, tail = check.run("tests", [sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider",
                                     f"--junitxml={junit}"], timeout)
    if code is None:
        raise StepFailed(f"pytest ran out of its {timeout:.0f} s: {tail[-1500:]}")
    out = junit_counts(junit) if junit.exists() else {}
    out["selection"] = " ".join(selection)
    if code != 0 or not out.get("passed"):
        raise StepFailed(f"pytest exit {code}, {out}: {tail[-1500:]}")
    return out


# The tests of the CPU paths that need instructions most development machines lack: the AMX
# tiles and the AVX512-BF16 dot products (docs/custom_ops.md, "A path runs on its hardware").
CPU_ISA_TESTS = ["tests/test_grouped_conv1d.py", "tests/test_kernel_check.py", "-k",
                 "amx or bf16 or tile_configuration or kernel_check"]
CPU_ISA_DRY_RUN_TESTS = ["tests/test_grouped_conv1d.py", "-k", "amx or tile_configuration"]  # seconds: the step runs
CPU_ISA_PROBE = ("import json, torch, custom_ops; custom_ops.load_library(required=True); "
                 "print(json.dumps({'level': custom_ops.cpu_capability(), 'features': torch.ops.groupbert.cpu_features(), "
                 "'amx': torch.ops.groupbert.amx_state(), 'checks': list(torch.ops.groupbert.kernel_checks())}))")


def step_cpu_isa(check: Check, timeout: float) -> dict:
    """The host CPU's instruction-set paths: what it offers and what ran, the AMX tiles above all
    (GPU hosts are Xeons, most development machines have no AMX)."""
    code, tail = check.run("cpu-isa", [sys.executable, "-c", CPU_ISA_PROBE], min(timeout, 60))
    if code != 0:
        raise StepFailed(f"the CPU probe failed (exit {code}): {tail[-1500:]}")
    out: dict = json.loads(tail.strip().splitlines()[-1])
    out["cpu"] = _cpu_model()
    junit = check.work / "cpu-isa.xml"
    selection = CPU_ISA_DRY_RUN_TESTS if check.dry_run else CPU_ISA_TESTS
    code, tail = check.run("cpu-isa", [sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider",
                                       "-rs", f"--junitxml={junit}"], timeout - 5)
    if code is None:
        raise StepFailed(f"pytest ran out of its time: {tail[-1500:]}")
    out.update(junit_counts(junit) if junit.exists() else {})
    out["selection"] = " ".join(selection)
    out["skip_reasons"] = sorted({line.split(": ", 1)[-1].strip() for line in tail.splitlines()
                                  if line.startswith("SKIPPED")})
    if code != 0 or not out.get("passed"):
        raise StepFailed(f"pytest exit {code}, {out}: {tail[-1500:]}")
    return out


def step_run(check: Check, timeout: float) -> dict:
    """`bert.py` itself: the shipped GroupBERT-large config, synthetic data, 2 steps, bf16."""
    output_dir = check.work / "run"
    cmd = [sys.executable, "bert.py", "train", "--config", "configs/groupbert_large.json", "--data.source", "synthetic",
           "--data.files", "[]", "--data.eval_files", "[]", "--data.eval_samples", "0",
           "--training.device", "cpu" if check.dry_run else "cuda", "--precision.dtype", "bf16",
           "--training.steps", "2", "--schedule.warmup_steps", "0", "--batch.gradient_accumulation", "1",
           "--training.log_every", "1", "--training.output_dir", str(output_dir)]
    if check.dry_run:  # tiny sizes on the CPU: the same entry and config file
        cmd += ["--batch.micro_batch_size", "2", "--model.hidden_size", "64", "--model.num_layers", "2",
                "--model.num_heads", "2", "--model.layers_per_stage", "[1, 1]"]
    t0 = time.monotonic()
    code, tail = check.run("run", cmd, timeout)
    seconds = time.monotonic() - t0
    metrics = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    shutil.rmtree(output_dir, ignore_errors=True)  # GroupBERT-large's checkpoint: 6 GB of weights and moments
    if code != 0:
        raise StepFailed(f"bert.py exit {code}: {tail[-1500:]}")
    losses = [r.get("loss") for r in records]
    if [r.get("step") for r in records] != [1, 2] or not all(isinstance(x, float) and x == x for x in losses):
        raise StepFailed(f"expected metrics of steps 1 and 2 with finite losses, got {records}")
    return {"command": " ".join(["python3", *cmd[1:]]).replace(str(output_dir), "<tmp>/run"), "seconds": seconds,
            "steps": records, "kernels": _line_with(tail, "kernels ("), "batch": _line_with(tail, "global batch")}


EQUAL_TIME = ROOT / "configs" / "compare" / "gpu_equal_time.yaml"
# The dry run's comparison: the same file at a few seconds a run, sizes cut on the command line.
EQUAL_TIME_DRY = {r"\n  seconds: 45\n": "\n  seconds: 2\n", r"\neval_every: 100 ": "\neval_every: 10 ",
                  r"\nseeds: \[0, 1\]\n": "\nseeds: [0]\n"}
EQUAL_TIME_DRY_OVERRIDES = ["--model.hidden_size", "64", "--model.num_layers", "2", "--model.num_heads", "2",
                            "--batch.micro_batch_size", "4", "--data.eval_samples", "16", "--precision.dtype", "fp32"]


def _section(markdown: str, heading: str) -> str:
    """The text under `## heading` up to the next heading of that level ('' when absent)."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
    return found.group(1).strip() if found else ""


def step_equal_time(check: Check, timeout: float) -> dict:
    """Issue 54, item 8: `bert.py compare` of GroupBERT-Base and BERT-Base at equal training
    seconds on this device; the report's final comparison and reach tables, and every run."""
    spec, out_dir = EQUAL_TIME, check.work / "equal-time"
    cmd_tail = ["--training.device", "cpu" if check.dry_run else "cuda", "--output-dir", str(out_dir)]
    if check.dry_run:
        text = EQUAL_TIME.read_text()
        for pattern, replacement in EQUAL_TIME_DRY.items():
            text, count = re.subn(pattern, replacement, text)
            if count != 1:
                raise StepFailed(f"{EQUAL_TIME.name} no longer holds {pattern!r}: update EQUAL_TIME_DRY")
        spec = check.work / EQUAL_TIME.name
        spec.write_text(text)
        cmd_tail += EQUAL_TIME_DRY_OVERRIDES
    cmd = [sys.executable, "bert.py", "compare", str(spec), *cmd_tail]
    t0 = time.monotonic()
    code, tail = check.run("equal-time", cmd, timeout)
    seconds = time.monotonic() - t0
    report = out_dir / "report.md"
    if code != 0 or not report.exists():
        raise StepFailed(f"bert.py compare exit {code}: {tail[-1500:]}")
    markdown = report.read_text()
    runs = (out_dir / "runs.csv").read_text().splitlines()
    shutil.rmtree(out_dir, ignore_errors=True)  # the checkpoints of four Base-sized runs
    command = " ".join(["python3", *cmd[1:]]).replace(str(check.work), "<tmp>")
    finals: dict[str, list[float]] = {}
    for row in csv.DictReader(runs):
        if row["state"] == "finished" and row["metric"] == "eval_mlm_loss":
            finals.setdefault(row["config"], []).append(float(row["value"]))
    return {"command": command, "seconds": seconds, "final_comparison": _section(markdown, "Final comparison"),
            "to_reach": _section(markdown, "To reach another config's final eval_mlm_loss"), "runs_csv": runs,
            "eval_mlm_loss": finals}


def step_bench(parts: list[str]) -> Callable[[Check, float], dict]:
    """One or more parts of bench/_gpu_bench.py in one child; their records by part."""

    def run(check: Check, timeout: float) -> dict:
        out = check.work / f"bench-{'-'.join(parts)}.json"
        cmd = [sys.executable, "bench/_gpu_bench.py", ",".join(parts), "--json-out", str(out)]
        if check.dry_run:
            cmd += ["--dry-run", "--compile-backend", "eager"]
        code, tail = check.run(",".join(parts), cmd, timeout)
        record = json.loads(out.read_text()) if out.exists() else {}
        for part in parts:
            if part not in record:
                record[part] = {"status": "timeout" if code is None else "failed",
                                "error": (f"ran out of its {timeout:.0f} s" if code is None else
                                          f"the process ended (exit {code}) before this part"),
                                "log_tail": tail}
        return {"parts": record}

    return run


STEP_FUNCTIONS: dict[str, Callable[[Check, float], dict]] = {
    "environment": step_environment, "wheels": step_wheels, "build": step_build, "tests": step_tests,
    "cpu-isa": step_cpu_isa, "run": step_run, **{part: step_bench([part]) for part in BENCH_PARTS},
    "equal-time": step_equal_time,
}


PREREQUISITES = ("environment", "wheels", "build")


def plan(dry_run: bool, only: Optional[list[str]] = None) -> list[tuple[Step, Callable[[Check, float], dict]]]:
    """The steps in order with their functions; with `only`, those steps after the ones every
    step needs (to rerun what failed). The dry run times every benchmark in one process (at
    tiny sizes the interpreter's start is most of a part's time)."""
    wanted = None if only is None else set(PREREQUISITES) | set(only)
    parts = [p for p in BENCH_PARTS if wanted is None or p in wanted]
    steps = []
    for s in STEPS:
        if dry_run and s.name in BENCH_PARTS:  # one step in the place of the first
            if parts and s.name == parts[0]:
                steps.append((Step("bench", DRY_BUDGET_S, 0, "the benchmarks at tiny sizes on the CPU, one process"),
                              step_bench(parts)))
        elif wanted is None or s.name in wanted:
            steps.append((s, STEP_FUNCTIONS[s.name]))
    return steps


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes, results in a temporary directory")
    parser.add_argument("--out-dir", type=Path, help="write gpu.json and gpu.md here instead")
    parser.add_argument("--copy-to", type=Path, help="also copy gpu.json and gpu.md here after every step ($OUT)")
    parser.add_argument("--budget-s", type=float, help=f"overall seconds (default {GPU_BUDGET_S}; dry run "
                        f"{DRY_BUDGET_S})")
    parser.add_argument("--only", type=lambda text: text.split(","), metavar="STEP[,STEP]",
                        help=f"run only these steps (after {', '.join(PREREQUISITES)}), e.g. to rerun what failed; "
                        f"steps: {', '.join(STEP_FUNCTIONS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(STEP_FUNCTIONS))
    if unknown:
        parser.error(f"--only: no step named {', '.join(unknown)}; the steps are {', '.join(STEP_FUNCTIONS)}")
    check = Check(args.dry_run, args.out_dir, args.copy_to,
                  args.budget_s or (DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S), args.only)
    print(f"gpu-check ({check.record['mode']}): budget {check.remaining():.0f} s; results -> {check.json_path}, "
          f"{check.doc_path}", flush=True)
    try:
        for step, function in plan(args.dry_run, args.only):
            run_step(check, step, function)
    except NoGPU as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if "work" in vars(check):
            shutil.rmtree(check.work, ignore_errors=True)
    statuses = {name: entry["status"] for name, entry in check.record["steps"].items()}
    print(f"\ngpu-check: {json.dumps(statuses)}; {check.record['elapsed_s']:.0f} s; wrote {check.json_path} and "
          f"{check.doc_path}")
    print(json.dumps(check.record["headline"], indent=1))
    return 0 if all(status == "ok" for status in statuses.values()) else 1


def run_step(check: Check, step: Step, function: Callable[[Check, float], dict]) -> None:
    """Runs one step within what is left of the budget, records it (a bench step's parts each
    under its own name) and saves the results."""
    remaining, t0 = check.remaining(), time.monotonic()
    if remaining < step.min_s:
        entry: dict = {"status": "skipped", "error": f"{remaining:.0f} s of the budget left, the step needs "
                                                     f"{step.min_s:.0f} s at least"}
    else:
        timeout = min(step.cap_s, remaining)
        print(f"\n=== {step.name}: {step.what} (up to {timeout:.0f} s)", flush=True)
        try:
            entry = {"status": "ok", "results": function(check, timeout)}
        except NoGPU:
            raise
        except StepFailed as e:
            entry = {"status": "failed", "error": str(e)}
        except Exception as e:  # a bug in a step is recorded too, and the next step runs
            entry = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    entry["seconds"] = round(time.monotonic() - t0, 1)
    parts = entry.get("results", {}).get("parts") if entry["status"] == "ok" else None
    for name, rec in (parts or {step.name: entry}).items():
        check.record["steps"][name] = rec
        print(f"=== {name}: {rec['status']} ({rec.get('seconds', 0):.0f} s)"
              + (f": {rec['error']}" if rec.get("error") else ""), flush=True)
    check.save()


# ----------------------------------------------------------------- helpers


def read_requirements(path: Path) -> list[tuple[str, str]]:
    """(name, version) of every `name==version` line; comments and blank lines skipped."""
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if match is None:
            raise ValueError(f"{path}: {line!r} is not an exact pin (name==version)")
        pins.append((match.group(1), match.group(2)))
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(directory: Path, name: str, version: str) -> Optional[Path]:
    """The wheel of name==version in `directory` (wheel file names: name-version-...whl)."""
    for wheel in sorted(directory.glob("*.whl")):
        parts = wheel.name.split("-")
        if len(parts) >= 5 and _normalise(parts[0]) == _normalise(name) and parts[1] == version:
            return wheel
    return None


def _older(found: str, pinned: str) -> bool:
    """found < pinned, comparing the leading numeric release parts."""
    def release(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.match(r"[0-9]+(?:\.[0-9]+)*", v).group(0).split("."))

    try:
        return release(found) < release(pinned)
    except AttributeError:
        return found != pinned


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    total["failed_tests"] = failed
    return total


def cuda_toolkit() -> Optional[Path]:
    """The CUDA toolkit's root: $CUDA_HOME, /usr/local/cuda, or where the nvcc on PATH lives;
    the first that holds bin/nvcc and include/cuda_runtime.h (an nvcc on PATH may be a wrapper
    script, from whose location torch's CMake files would not find the headers)."""
    candidates = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append(Path("/usr/local/cuda"))
    if shutil.which("nvcc"):
        candidates.append(Path(os.path.realpath(shutil.which("nvcc"))).parent.parent)
    return next((root for root in candidates
                 if (root / "bin" / "nvcc").exists() and (root / "include" / "cuda_runtime.h").exists()), None)


def nvrtc_outside(root: Path) -> Optional[Path]:
    """libnvrtc from the nvidia-* wheels torch runs with, where the toolkit at `root` has none.
    torch's CMake files link it into every extension (TORCH_CUDA_LIBRARIES) and stop with
    CUDA_nvrtc_LIBRARY NOTFOUND without it; torch itself preloads the same file at import."""
    for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if any((root / lib).glob("libnvrtc.so*")):
            return None
    for entry in sys.path:
        found = sorted(Path(entry).glob("nvidia/*/lib/libnvrtc.so.*[0-9]")) if entry else []
        if found:
            return found[0]
    return None


def cuda_configure_args(check: Check) -> list[str]:
    """CMake arguments of the CUDA build for this GPU (and the compiler in the children's environment)."""
    root = cuda_toolkit()
    if root is None:
        raise StepFailed("no CUDA toolkit found (bin/nvcc and include/cuda_runtime.h under $CUDA_HOME, "
                         "/usr/local/cuda or beside the nvcc on PATH): the CUDA kernels cannot be built")
    if check.cuda_arch is None:
        raise StepFailed("the environment step found no GPU to build for")
    # torch's CMake files pick their own -gencode flags from TORCH_CUDA_ARCH_LIST: the same GPU.
    major, minor = check.cuda_arch[:-1], check.cuda_arch[-1]
    check.env.update(CUDACXX=str(root / "bin" / "nvcc"), TORCH_CUDA_ARCH_LIST=f"{major}.{minor}")
    args = [f"-DCMAKE_CUDA_ARCHITECTURES={check.cuda_arch}", f"-DCUDA_TOOLKIT_ROOT_DIR={root}",
            f"-DCUDAToolkit_ROOT={root}"]
    nvrtc = nvrtc_outside(root)
    if nvrtc is not None:
        args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc}")
    return args


def _nvcc() -> Optional[str]:
    root = cuda_toolkit()
    return str(root / "bin" / "nvcc") if root else shutil.which("nvcc")


def _first_line(cmd: list[str], last: bool = False) -> Optional[str]:
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = text.splitlines()
    return (lines[-1] if last else lines[0]) if lines else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _line_with(text: str, needle: str) -> Optional[str]:
    return next((line.strip() for line in text.splitlines() if needle in line), None)


# ------------------------------------------------------------- the record


def _results(record: dict, step: str) -> dict:
    entry = record["steps"].get(step, {})
    return entry.get("results", {}) if entry.get("status") == "ok" else {}


def headline(record: dict) -> dict:
    """The figures the issue asks for, by name, from the steps that passed (absent otherwise)."""
    out: dict = {}
    tests = _results(record, "tests")
    if tests:
        out["cuda_tests"] = f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, " \
                            f"{tests['skipped']} skipped"
    isa = _results(record, "cpu-isa")
    if isa:
        out["cpu_isa"] = (f"{isa['cpu']}: level {isa['level']}, AMX {isa['amx']}; {isa['passed']} passed, "
                          f"{isa['failures'] + isa['errors']} failed, {isa['skipped']} skipped")
    run = _results(record, "run")
    if run:
        out["run_2step_losses"] = [s["loss"] for s in run["steps"]]
        out["run_2step_tokens_per_s"] = run["steps"][-1].get("tokens_per_s")
    peaks = _results(record, "peaks")
    for key in ("gemm_tflops_bf16", "gemm_tflops_fp32_no_tf32", "copy_gbps", "datasheet_tflops_bf16"):
        if key in peaks:
            out[key] = peaks[key]
    for arch in ("bert", "groupbert"):
        r = _results(record, arch)
        for key in ("ours_seq_per_s", "hf_seq_per_s", "ours_vs_hf", "ours_vs_hf_masked", "ours_mfu",
                    "ours_of_gemm_peak", "shadow_vs_autocast"):
            if key in r:
                out[f"{arch}_{key}"] = r[key]
    conv = _results(record, "conv")
    for key in ("conv_vs_cudnn_fp32", "conv_vs_cudnn_bf16", "conv_triton_vs_cudnn_fp32", "conv_triton_vs_cudnn_bf16"):
        if key in conv:
            out[key] = conv[key]
    lamb = _results(record, "lamb")
    for key in ("lamb_vs_adamw_fused", "lamb_vs_floor", "adamw_vs_floor"):
        if key in lamb:
            out[key] = lamb[key]
    norm = _results(record, "norm")
    for key in ("fused_vs_unfused", "fused_vs_floor"):
        if key in norm:
            out[f"add_norm_{key}"] = norm[key]
    for runner, prof in _results(record, "profile").items():
        if isinstance(prof, dict) and "busy_fraction" in prof:
            out[f"profile_{runner}_device_busy"] = prof["busy_fraction"]
    equal = _results(record, "equal-time")
    if equal:
        out["equal_time_eval_mlm_loss"] = equal["eval_mlm_loss"]
    compiled = _results(record, "compile")
    if "compiled_vs_eager" in compiled:
        out["compile_vs_eager"] = compiled["compiled_vs_eager"]
    for key in ("hf_compiled_vs_eager", "ours_compiled_vs_hf_compiled"):
        if key in compiled:
            out[key] = compiled[key]
    for name, run in _results(record, "batch").get("runs", {}).items():
        out[f"auto_batch_{name}"] = {"micro_batch": run["micro_batch"], "chosen_vs_b64": run["chosen_vs_b64"],
                                     "mfu": run[f"b{run['micro_batch']}"].get("ours_mfu")}
    agreeing = agreement(record)
    if agreeing:
        out["agreement"] = agreeing
    return out


AGREEMENT = 0.05  # the same runner timed in two steps of one check: a speed-up smaller than their spread is noise
# Where each runner is timed more than once in a check: (step, the figure of its step time in ms).
SAME_RUNNER = {
    "our BERT-Large eager step": (("bert", "ours_step_ms"), ("profile", "ours_bert.wall_ms"),
                                  ("compile", "eager_step_ms")),
    "HF BERT-Large, all positions": (("bert", "hf_step_ms"), ("groupbert", "hf_step_ms")),
    "HF BERT-Large, masked positions only": (("bert", "hf_masked_step_ms"), ("groupbert", "hf_masked_step_ms"),
                                             ("profile", "hf_bert_masked_only.wall_ms")),
}


def agreement(record: dict) -> dict:
    """Per runner timed in two or more steps: its step times, the spread (slowest / fastest - 1)
    and whether that is within AGREEMENT; runners timed once are left out."""
    out = {}
    for runner, places in SAME_RUNNER.items():
        times = {}
        for step, key in places:
            value = _results(record, step)
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                times[step] = value
        if len(times) >= 2:
            spread = max(times.values()) / min(times.values()) - 1
            out[runner] = {"ms": times, "spread": spread, "within": spread <= AGREEMENT}
    return out


def _f(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _kernel_name(name: str) -> str:
    """A kernel's name short enough for a table: no return type, anonymous namespace or
    at::native:: prefix, the start of its template arguments."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("at::native::", "")
    return name.split("(")[0][:56]


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


HOW_TO = """\
## How to run it

On a machine with an NVIDIA GPU and a CUDA build of torch, nvcc, CMake and ninja (e.g. an
image with Python 3.12, torch 2.11 + CUDA 13 and the usual ML packages), with or without
network: the check brings the few packages the project needs beyond such an image as
wheels, builds the ops for that GPU and runs everything in one command within a time
budget you give it.

1. Where pip reaches PyPI, in the checkout, download the wheels `requirements-gpu.txt`
   lists (for CPython 3.12, manylinux x86-64, a few MB; `GPU_PYTHON=3.11` for another Python) into `.whl/`, which git ignores, and
   take the checkout with its `.whl/` to the GPU machine:

       make gpu-wheels

2. On the GPU machine, in the checkout (`DIR`: where the results should also be copied,
   e.g. a folder that outlives the machine):

       make gpu-check BUDGET_S={budget} COPY_TO=DIR 2>&1 | tee gpu-check.log

   Without make: `python3 bench/gpu_check.py --budget-s {budget} --copy-to DIR`. `BUDGET_S` is
   the whole check's seconds (default {budget}): under a hard limit on the command (a
   scheduler's wall time), set it about a minute below that limit. Each step has its own
   cap within it; a step that fails or runs out of time is recorded with why and the next
   one runs, and the budget runs out at the end of the list (the benchmarks), never at the
   build or the tests.

3. The results: `bench/results/gpu.json` (every step: status, seconds, figures, the tail of
   its output) and `docs/gpu.md` (this page with the figures), both rewritten after every
   step and copied to `COPY_TO`, so a run cut off still leaves what it measured. Commit
   them with the host and date they name.

4. A step that failed, once fixed, is rerun alone into the committed record (after the
   environment, the wheels and the build, about 80 s on a fresh machine); the page lists
   each rerun with its date, and a rerun on another GPU stands alone rather than mixing
   two GPUs' figures:

       make gpu-check ONLY=lamb COPY_TO=DIR 2>&1 | tee gpu-check.log

Without a GPU, the same script runs on the CPU at tiny sizes into a temporary directory
(it never writes `bench/results/gpu.json` or this page); tests/test_gpu_check.py runs it
in the suite:

    make gpu-check DRY_RUN=1

`make cuda-check` compiles every `.cu` file with nvcc alone (no GPU, no CUDA torch), and every Triton kernel variant for sm_90 with Triton's own compiler (`python -m custom_ops.triton_check`).
"""


def render(record: Optional[dict]) -> str:
    """docs/gpu.md: what the check does, how to run it, and the figures of `record` (None: none yet)."""
    lines = ["# The GPU check (`make gpu-check`)", ""]
    if record is None:
        lines += ["**No GPU figures have been measured yet.** No GPU has run this check so far: "
                  "every CUDA kernel compiles (`make cuda-check`) and this check runs end to end on the CPU "
                  "(`make gpu-check DRY_RUN=1`, part of the test suite), but none of it has run on a GPU. The "
                  "first GPU machine runs it as below; its `gpu.json` and this page, rewritten with the "
                  "figures, replace `bench/results/gpu.json` (absent until then) and this file.", ""]
    else:
        env = _results(record, "environment")
        if record["mode"] != "gpu":
            lines += ["**DRY RUN on the CPU at tiny sizes: not GPU figures.** It checks that every step of the "
                      "check runs; the numbers below only show where each figure goes.", ""]
        lines += [f"Produced by `{record['command']}` on {record['date']}, {record['elapsed_s']:.0f} s of a "
                  f"{record['budget_s']:.0f} s budget."
                  + "".join(f" Rerun by `{r['command']}` on {r['date']} (a machine of its own, the same GPU): "
                            f"{', '.join(s for s in r['steps'] if s not in PREREQUISITES)}."
                            for r in record.get("reruns", [])), "",
                  f"- GPU: {env.get('gpu', '–')} ({env.get('gpu_memory_gib', '–')} GiB, "
                  f"{env.get('multiprocessors', '–')} SMs, compute capability {env.get('capability', '–')}); "
                  f"nvidia-smi: {env.get('nvidia_smi') or '–'}",
                  f"- host: {env.get('host', '–')}, {env.get('cpu', '–')}, {env.get('cpus', '–')} CPUs; "
                  f"{env.get('platform', '–')}",
                  f"- Python {env.get('python', '–')}, torch {env.get('torch', '–')} (CUDA "
                  f"{env.get('torch_cuda') or '–'}), nvcc: {env.get('nvcc') or '–'}", ""]
        lines += _render_steps(record)
    lines += ["## What it does", "",
              "`bench/gpu_check.py` (`make gpu-check`) runs these steps in order inside one budget, each with a "
              "time cap and (after the environment's probe) in processes of its own; each records its status, "
              "its time and its figures in `bench/results/gpu.json`:", "",
              "| step | what | cap |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {s.what} | {s.cap_s:.0f} s |" for s in STEPS]
    lines += ["", "The benchmarks (`bench/_gpu_bench.py`) check correctness first (losses against HuggingFace or "
              "an independent eager GroupBERT, the convolution against float64, the LAMB step against the CPU "
              "kernels), then time the runners alternately (2 × 4 warm-up steps, then 5 × 4 timed with CUDA events: the "
              "median of the 5, their fastest and slowest recorded) and set each figure against a peer and a "
              "roofline measured in the same process: model FLOPs per step (3 × forward, `bert/summary.py`) / "
              "step time against the datasheet's dense bf16 peak (MFU, the peak named in the JSON) and against a "
              "bf16 GEMM timed in the same run; the convolution against cuDNN's `F.conv1d(groups=G)` and the fp32 "
              "CUDA-core GEMM peak; the LAMB step against torch's fused AdamW and the HBM floor (44 bytes per "
              "parameter for LAMB with its gradient norm, 28 for AdamW, over the measured copy bandwidth). A runner "
              f"timed in two steps (our eager BERT step in `bert`, `profile` and `compile`; HF BERT in `bert` and "
              f"`groupbert`) is recorded with its spread, and said to agree when within {AGREEMENT:.0%}.", ""]
    lines += HOW_TO.format(budget=GPU_BUDGET_S).splitlines()
    return "\n".join(lines) + "\n"


def render_unreadable(record: dict, error: str) -> str:
    """The page when a step's results lack what `render` reads: the statuses, and where the figures are."""
    lines = ["# The GPU check (`make gpu-check`)", "",
             f"The record of `{record['command']}` on {record['date']} ({record['mode']}) could not be rendered "
             f"({error}); bench/results/gpu.json holds every step's figures.", "",
             "| step | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {name} | {entry.get('status')} | {entry.get('seconds')} |" for name, entry in record["steps"].items()]
    return "\n".join(lines + ["", *HOW_TO.format(budget=GPU_BUDGET_S).splitlines()]) + "\n"


def _render_steps(record: dict) -> list[str]:
    lines = ["## Steps", "", "| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, entry in record["steps"].items():
        note = entry.get("error", "") if entry.get("status") != "ok" else ""
        note = " ".join(note.split())[:160].replace("|", "/")
        if "rerun_date" in entry:
            note = f"rerun {entry['rerun_date']}" + (f"; {note}" if note else "")
        lines.append(f"| {name} | {entry.get('status')} | {_f(entry.get('seconds'), 1)} | {note} |")
    lines.append("")
    h = record["headline"]
    if "cuda_tests" in h:
        lines += [f"CUDA tests: {h['cuda_tests']} (`{_results(record, 'tests').get('selection', '')}`).", ""]
    if "cpu_isa" in h:
        lines += [f"The host CPU's paths: {h['cpu_isa']} (`{_results(record, 'cpu-isa').get('selection', '')}`).", ""]
    run = _results(record, "run")
    if run:
        lines += [f"2-step run: `{run['command']}`: losses {', '.join(f'{x:.4f}' for x in h['run_2step_losses'])}; "
                  f"{run.get('batch') or ''}; {run.get('kernels') or ''}", ""]
    peaks = _results(record, "peaks")
    if peaks:
        lines += [f"Peaks measured in the run: bf16 GEMM {peaks['gemm_n_bf16']}³ {_f(peaks['gemm_tflops_bf16'], 1)} "
                  f"TFLOP/s (datasheet dense bf16: {_f(peaks['datasheet_tflops_bf16'], 1)}), fp32 GEMM without TF32 "
                  f"{_f(peaks['gemm_tflops_fp32_no_tf32'], 2)} TFLOP/s, device copy {_f(peaks['copy_gbps'], 0)} GB/s "
                  "(read + write).", ""]
    rows = []
    for arch in ("bert", "groupbert"):
        r = _results(record, arch)
        if r:
            c = r["config"]
            size = "Large" if (c["hidden"], c["layers"]) == (1024, 24) else f"h{c['hidden']} L{c['layers']}"
            name = {"bert": "BERT", "groupbert": "GroupBERT"}[arch]
            rows.append(f"| {name}-{size}, ours | {_f(r['ours_seq_per_s'], 1)} | {_f(r['ours_tflops'], 1)} | "
                        f"{_pct(r.get('ours_mfu'))} | {_pct(r['ours_of_gemm_peak'])} | "
                        f"{_f(r['ours_vs_hf'])}× / {_f(r['ours_vs_hf_masked'])}× |")
            if "ours_shadow_seq_per_s" in r:
                rows.append(f"| {name}-{size}, ours, weight_cast=shadow | {_f(r['ours_shadow_seq_per_s'], 1)} | | | | "
                            f"{_f(r['shadow_vs_autocast'], 3)}× ours |")
            rows.append(f"| HF BERT-{size} (SDPA, autocast bf16, fused AdamW) | {_f(r['hf_seq_per_s'], 1)} | "
                        f"{_f(r['hf_tflops'], 1)} | {_pct(r.get('hf_mfu'))} | {_pct(r['hf_of_gemm_peak'])} | |")
            rows.append(f"| HF BERT-{size}, MLM head at the masked positions only | {_f(r['hf_masked_seq_per_s'], 1)} "
                        f"| {_f(r['hf_masked_tflops'], 1)} | {_pct(r.get('hf_masked_mfu'))} | "
                        f"{_pct(r['hf_masked_of_gemm_peak'])} | |")
    if rows:
        r = _results(record, "bert") or _results(record, "groupbert")
        lines += [f"Training in bf16 on {r['device']}, batch {r['batch']} × seq {r['config']['seq']}, "
                  f"{r['config']['masks']} masks (phase 1). MFU: model FLOPs per step (useful work: the MLM head "
                  "at the masked positions) / step time / the datasheet's dense bf16 peak; HF's own row counts "
                  "the FLOPs it runs:", "",
                  "| runner | seq/s | TFLOP/s | MFU | of the GEMM peak | ours / HF, / HF masked-only |",
                  "| --- | --- | --- | --- | --- | --- |", *rows, ""]
    conv = _results(record, "conv")
    if conv:
        shape = conv["shape"]
        lines += [f"GroupedConv1d forward + backward, B={shape['B']} S={shape['S']} H={shape['H']} C={shape['C']} "
                  f"K={shape['K']}:", "",
                  "| dtype | ours | packed ids | cuDNN (B, H, S) | ours / cuDNN | TFLOP/s | of fp32 GEMM |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for dtype in ("fp32", "bf16"):
            c = conv[dtype]
            lines.append(f"| {dtype} | {_f(c['ours_ms'], 3)} ms | {_f(c['ours_packed_ms'], 3)} ms | "
                         f"{_f(c['cudnn_ms'], 3)} ms | {_f(c['ours_vs_cudnn'])}× | {_f(c['ours_tflops'])} | "
                         f"{_pct(c['ours_of_fp32_gemm'])} |")
            if "triton_ms" in c:
                lines.append(f"| {dtype}, Triton (B, S, H) | {_f(c['triton_ms'], 3)} ms | "
                             f"{_f(c['triton_packed_ms'], 3)} ms | {_f(c['cudnn_ms'], 3)} ms | "
                             f"{_f(c['triton_vs_cudnn'])}× | {_f(c['triton_tflops'])} | – |")
        lines.append("")
        if conv.get("triton") is not True:
            lines += [f"The Triton kernels were not timed: {conv.get('triton') or 'a record from before them'}.", ""]
    lamb = _results(record, "lamb")
    if lamb:
        lines += [f"Optimizer step over {lamb['params'] / 1e6:.1f} M parameters ({lamb['tensors']} tensors): fused "
                  f"LAMB {_f(lamb['ours_ms'])} ms ({_f(lamb['lamb_vs_floor'])}× its floor of "
                  f"{_f(lamb['ours_floor_ms'])} ms), torch fused AdamW {_f(lamb['adamw_fused_ms'])} ms "
                  f"({_f(lamb['adamw_vs_floor'])}× its floor of {_f(lamb['adamw_floor_ms'])} ms); copy "
                  f"{_f(lamb['copy_gbps'], 0)} GB/s.", ""]
    norm = _results(record, "norm")
    if norm.get("timed"):
        lines += [f"Residual add + layer norm, {norm['shape']['rows']} × {norm['shape']['hidden']}, bf16 under autocast, "
                  f"forward + backward: the fused Triton kernels {_f(norm['fused_ms'], 3)} ms, torch's add and "
                  f"F.layer_norm {_f(norm['unfused_ms'], 3)} ms ({_f(norm['fused_vs_unfused'])}×); memory floor "
                  f"{_f(norm['floor_ms'], 3)} ms ({_f(norm['fused_vs_floor'])}× it).", ""]
    profiled = _results(record, "profile")
    if profiled:
        names = {"ours_bert": "BERT-Large, ours", "ours_groupbert": "GroupBERT-Large, ours",
                 "hf_bert_masked_only": "HF BERT-Large, MLM head at the masked positions only"}
        lines += ["Where a training step's time goes (torch.profiler over warm steps; the step timed without the "
                  "profiler; the device busy = the union of its kernels' intervals, so the rest is the device "
                  "waiting on the host):", "",
                  "| runner | step | device busy | busy | the kernels that take the most (ms per step) |",
                  "| --- | --- | --- | --- | --- |"]
        for runner, prof in profiled.items():
            if not isinstance(prof, dict) or "wall_ms" not in prof:
                continue
            top = "; ".join(f"{_kernel_name(k['name'])} {k['ms_per_step']:.2f}" for k in prof["kernels"][:4])
            lines.append(f"| {names.get(runner, runner)} | {_f(prof['wall_ms'], 1)} ms | {_f(prof['busy_ms'], 1)} ms "
                         f"| {_pct(prof['busy_fraction'])} | {top.replace('|', '/')} |")
        lines.append("")
    agreeing = h.get("agreement", {})
    if agreeing:
        lines += [f"The same runner timed in more than one step (agreement within {AGREEMENT:.0%} is what a smaller "
                  "speed-up needs to be seen):", ""]
        lines += [f"- {runner}: " + ", ".join(f"{_f(ms, 1)} ms ({step})" for step, ms in a["ms"].items())
                  + f"; spread {_pct(a['spread'])}, " + ("within" if a["within"] else "**not within**")
                  + f" {AGREEMENT:.0%}" for runner, a in agreeing.items()]
        lines.append("")
    compiled = _results(record, "compile")
    if compiled:
        lines += [f"torch.compile ({compiled['backend']}) of our BERT step: {_f(compiled['compiled_step_ms'], 1)} ms "
                  f"against {_f(compiled['eager_step_ms'], 1)} ms eager ({_f(compiled['compiled_vs_eager'])}×)"
                  + (f"; HF BertForPreTraining (masked-only head) compiled {_f(compiled['hf_masked_compiled_step_ms'], 1)}"
                     f" ms against {_f(compiled['hf_masked_eager_step_ms'], 1)} ms eager; ours compiled / HF compiled "
                     f"{_f(compiled['ours_compiled_vs_hf_compiled'])}×" if "hf_masked_compiled_step_ms" in compiled else "")
                  + "; "
                  f"first step, compiling, {_f(compiled['first_step_s'], 1)} s.", ""]
    fitted = _results(record, "batch")
    if fitted:
        lines += [f"`batch.micro_batch_size auto` (global batch {fitted['global_batch']}): the micro batch that fits, "
                  "timed against batch 64:", "",
                  "| model | seq | micro batch | predicted peak | measured peak | batch 64 | chosen | chosen / 64 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, run in fitted["runs"].items():
            m, today = run["micro_batch"], run["today"]
            lines.append(f"| {name} | {run['seq']} | {m} | {_f(run['predicted_peak_gib'], 1)} GiB | "
                         f"{_f(run.get('measured_peak_gib'), 1)} GiB | {_f(run[f'b{today}']['seq_per_s'], 0)} seq/s "
                         f"(MFU {_f(run[f'b{today}'].get('ours_mfu'))}) | {_f(run[f'b{m}']['seq_per_s'], 0)} seq/s "
                         f"(MFU {_f(run[f'b{m}'].get('ours_mfu'))}) | {_f(run['chosen_vs_b64'])}× |")
        lines.append("")
    equal = _results(record, "equal-time")
    if equal:
        lines += [f"GroupBERT-Base against BERT-Base at equal training seconds on this device (`{equal['command']}`, "
                  f"{_f(equal['seconds'], 0)} s in all):", "", equal["final_comparison"], ""]
        if equal["to_reach"]:
            lines += [equal["to_reach"], ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
