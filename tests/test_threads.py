"""The intra-op thread count (session/process.py): chosen from OMP_NUM_THREADS, or from the
CPUs the process may use (affinity, cgroup v1/v2 quota, torchrun's processes on the node),
applied by bert.py and infer.py before any work and named on the kernels line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import infer
import session.process
from session.kernels import KernelPolicy, choose_kernels
from session.process import Threads, cgroup_cpu_quota, choose_threads, use_cpu_threads
from tests.tiny_runs import bert_cli

ROOT = Path(__file__).resolve().parents[1]
FOUR = {0, 1, 2, 3}


def fabricated(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    """A root with /proc/self/cgroup and the cgroup files below /sys/fs/cgroup."""
    for name, text in {"proc/self/cgroup": cgroup, **{f"sys/fs/cgroup/{k}": v for k, v in files.items()}}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


# ------------------------------------------------------------------ the choice
@pytest.mark.parametrize("cgroup, files, quota, threads", [
    ("0::/kubepods/pod1/c1", {"kubepods/pod1/c1/cpu.max": "150000 100000"}, 1.5, 2),
    ("0::/kubepods/pod1/c1", {"kubepods/pod1/c1/cpu.max": "max 100000"}, None, 4),
    # The tightest of the cgroup and those above it.
    ("0::/kubepods/pod1/c1", {"kubepods/pod1/c1/cpu.max": "max 100000", "kubepods/pod1/cpu.max": "300000 100000",
                              "kubepods/cpu.max": "max 100000"}, 3.0, 3),
    # A container without a cgroup namespace: its path is not below its mount, the limit is at the top.
    ("0::/system.slice/docker-abc.scope", {"cpu.max": "200000 100000"}, 2.0, 2),
    ("4:cpu,cpuacct:/slurm/uid_1/job_7\n3:memory:/slurm/uid_1/job_7\n0::/",
     {"cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_quota_us": "300000",
      "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_period_us": "100000"}, 3.0, 3),
    ("1:cpu:/\n2:cpuacct:/", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
                              "cpuacct/cpu.cfs_quota_us": "50000", "cpuacct/cpu.cfs_period_us": "100000"}, None, 4),
    ("0::/job", {"job/cpu.max": "20000 100000"}, 0.2, 1),  # below one CPU: one thread
    ("0::/job", {"job/cpu.max": "garbled", "cpu.max": "100000 0"}, None, 4),
    ("0::/job", {}, None, 4),  # no cgroup files at all
], ids=["v2", "v2-max", "v2-parent", "v2-no-namespace", "v1", "v1-none", "below-one-cpu", "garbled", "missing"])
def test_the_count_is_the_affinity_capped_by_the_cgroup_quota(tmp_path, cgroup, files, quota, threads):
    root = fabricated(tmp_path, cgroup, files)
    assert cgroup_cpu_quota(root) == pytest.approx(quota)
    chosen = choose_threads({}, FOUR, root)
    assert chosen == Threads(threads, "affinity 4 CPUs" + ("" if quota is None else f", cgroup quota {quota:.3g} CPUs"))


def test_no_proc_file_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None
    assert choose_threads({}, {0}, tmp_path) == Threads(1, "affinity 1 CPU")


@pytest.mark.parametrize("cpus, local, threads", [(4, "2", 2), (3, "2", 1), (1, "4", 1), (4, "1", 4)])
def test_torchruns_processes_on_a_node_share_its_cpus(tmp_path, cpus, local, threads):
    chosen = choose_threads({"LOCAL_WORLD_SIZE": local}, set(range(cpus)), tmp_path)
    assert chosen.count == threads
    assert chosen.source.endswith(f" / {local} local processes") == (local != "1"), chosen.source


@pytest.mark.parametrize("value, threads", [("3", 3), (" 1 ", 1), ("4,2", 4)])
def test_an_explicit_omp_num_threads_wins(tmp_path, value, threads):
    root = fabricated(tmp_path, "0::/", {"cpu.max": "100000 100000"})
    chosen = choose_threads({"OMP_NUM_THREADS": value, "LOCAL_WORLD_SIZE": "2"}, FOUR, root)
    assert chosen == Threads(threads, f"OMP_NUM_THREADS={value.strip()}")
    assert choose_threads({"OMP_NUM_THREADS": ""}, FOUR, root) == Threads(1, "affinity 4 CPUs, cgroup quota 1 CPU")


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_refused_in_one_line(tmp_path, value, monkeypatch, capsys):
    with pytest.raises(ValueError, match=re.escape(f"OMP_NUM_THREADS={value!r} is not a number of threads")):
        choose_threads({"OMP_NUM_THREADS": value}, FOUR, tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert bert_cli()(["summary", "--config", str(ROOT / "configs" / "demo.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: OMP_NUM_THREADS={value!r}") and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------ the kernels line
def test_the_kernels_line_names_the_count_and_its_source(monkeypatch):
    line = KernelPolicy(threads=1, threads_from="OMP_NUM_THREADS=1").describe()
    assert "; 1 thread: OMP_NUM_THREADS=1):" in line, line
    assert "; 2 threads: affinity 2 CPUs):" in KernelPolicy(threads=2, threads_from="affinity 2 CPUs").describe()
    threads = torch.get_num_threads()
    monkeypatch.setattr(session.process, "_applied", Threads(threads, "affinity 9 CPUs"))
    assert (choose_kernels().threads, choose_kernels().threads_from) == (threads, "affinity 9 CPUs")
    monkeypatch.setattr(session.process, "_applied", Threads(threads + 1, "affinity 9 CPUs"))
    assert choose_kernels().threads_from == "set by the caller or torch's default", "the count was changed since"


def test_a_process_that_imported_torch_keeps_its_count(monkeypatch):
    """In pytest torch is imported first: bert.py's main leaves the tests' count alone."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    assert use_cpu_threads().count >= 1
    assert "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == threads
    assert session.process._applied is None


# ------------------------------------------------------------------ end to end
def one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.parametrize("omp, expected", [
    (None, r"1 thread: affinity 1 CPU(, cgroup quota [\d.]+ CPUs?)?"),
    ("2", r"2 threads: OMP_NUM_THREADS=2"),
], ids=["affinity", "explicit"])
def test_a_run_pinned_to_one_cpu_takes_one_thread_unless_told_otherwise(tmp_path, omp, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    command = [sys.executable, "bert.py", "train", "--config", "configs/demo.json", "--data.source", "synthetic",
               "--training.steps", "1", "--schedule.warmup_steps", "0", "--batch.micro_batch_size", "2",
               "--evaluation.every", "0", "--checkpoint.every", "0", "--training.output_dir", str(tmp_path / "run")]
    done = subprocess.run(command, cwd=ROOT, env=env, preexec_fn=one_cpu, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("kernels ("))
    assert re.search(rf"; {expected}\):", line), line


# ------------------------------------------------------------------ infer.py
def test_infer_gives_onnxruntime_the_count(tmp_path, monkeypatch):
    """onnxruntime reads no OMP_NUM_THREADS: infer.py passes the count to its session."""
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["out"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 2])],
                              [helper.make_tensor_value_info("out", TensorProto.INT64, [1, 2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    model = infer.OnnxModel(tmp_path / "m.onnx", "cpu", threads=1)
    assert model.session.get_session_options().intra_op_num_threads == 1
    seen = []

    def record(*args, threads=None, **kwargs):
        seen.append(threads)
        raise ValueError("recorded")

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(infer, "OnnxModel", record)
    assert infer.main(["--model", str(tmp_path / "m.onnx"), "--task", "mlm", "--text", "a [MASK]"]) == 2
    assert seen == [3]
