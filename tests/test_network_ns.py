"""Two nodes as a cluster operator meets them, simulated on one host: each node a network
namespace of its own (a veth pair between them, like two machines on one switch, each with an
interface `eth0` and a hosts file naming both), each torchrun agent in it.

- The documented two-node command without GLOO_SOCKET_IFNAME: the processes advertise the host
  name's loopback address, which the other node cannot reach; the job ends with one line naming
  the variable within parallel.collective_timeout + 30 s (it used to say "this is a bug" and
  hang for 30 minutes). With it, the job trains as one process with twice the accumulation.
- Rank 0 killed: the survivor names rank 0 (whose process hosted the job's key-value store) and
  the newest verified checkpoint, found on disk now that the store is gone.
- launch/slurm.sbatch, run as written with a stand-in `srun` (each task in its node's namespace
  with the node's host name) and `scontrol`; launch/kubernetes.yaml, parsed and its pods' command
  run the same way (host names groupbert-<i>, the Service's DNS names in the hosts file): both
  train as one process.

Creating network namespaces needs root; where it cannot, the tests are skipped, naming why.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import assert_close
from tests.test_distributed import _kill_group
from tests.test_watchdog_ns import (UNSHARE, _repository_view, _run_in, _unshare_problem, fault_midway)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # wall-clock fault timeouts
INTERFACE = "eth0"  # each node's interface to the other: one name on every node, as on a cluster
ADDRESSES = ("10.213.0.1", "10.213.0.2")
# What every node's /etc/hosts says (`ip netns exec` mounts /etc/netns/<name>/hosts there): the host
# name `vm` stays loopback, as on this host; the nodes' and pods' names are their addresses.
HOSTS = ("127.0.0.1 localhost vm\n" + "".join(f"{address} node{i} groupbert-{i}.groupbert groupbert-{i}\n"
                                              for i, address in enumerate(ADDRESSES)))
TINY_JOB = ["--data.source", "synthetic", "--training.steps", "8", "--schedule.warmup_steps", "2",
            "--batch.micro_batch_size", "4", "--checkpoint.every", "4", "--evaluation.every", "0"]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def nodes():
    """Two network namespaces joined by a veth pair: (namespace names, addresses)."""
    if _unshare_problem():
        pytest.skip(_unshare_problem())
    tag = uuid.uuid4().hex[:6]
    names = (f"gb{tag}a", f"gb{tag}b")
    made = []
    try:
        for name in names:
            done = _ip("netns", "add", name)
            if done.returncode:
                pytest.skip(f"`ip netns add` fails here (needs root and iproute2): {done.stderr.strip()}")
            made.append(name)
            Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{name}/hosts").write_text(HOSTS)
        ends = (f"gb{tag}x", f"gb{tag}y")
        steps = [("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])]
        for name, end, address in zip(names, ends, ADDRESSES):
            steps += [("link", "set", end, "netns", name), ("-n", name, "link", "set", end, "name", INTERFACE),
                      ("-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE),
                      ("-n", name, "link", "set", INTERFACE, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                pytest.skip(f"`ip {' '.join(step)}` fails here: {done.stderr.strip()}")
        yield names
    finally:
        for name in made:
            _ip("netns", "del", name)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _agents(names: tuple[str, str], port: int, extra_env: str = "", steps: int = 8, restarts: int = 0,
            collective_timeout: int = 20) -> str:
    """The documented two-node command (docs/distributed.md), each agent in its node's network
    namespace, meeting at node 0's address."""
    lines = []
    for node, (name, address) in enumerate(zip(names, ADDRESSES)):
        lines.append(
            f"ip netns exec {name} {' '.join(UNSHARE)} env {extra_env} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            f"{sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --max-restarts {restarts} "
            f"--local-addr {address} --rdzv-backend c10d --rdzv-endpoint {ADDRESSES[0]}:{port} "
            f"--rdzv-conf is_host={'true' if node == 0 else 'false'} --rdzv-id ns "
            f"bert.py train --config configs/demo.json {' '.join(TINY_JOB)} --training.steps {steps} "
            f"--training.output_dir runs/ns --parallel.collective_timeout {collective_timeout} "
            "--parallel.fault_timeout 10 &")
    return "\n".join(lines) + '\nfailed=0; for agent in $(jobs -p); do wait "$agent" || failed=1; done; [ "$failed" = 0 ]'


def test_without_the_interface_variable_the_job_ends_naming_it(nodes, tmp_path):
    timeout = 10
    began = time.monotonic()
    status, output = _run_in(tmp_path / "repo", _agents(nodes, 29431, collective_timeout=timeout), timeout + 200)
    took = time.monotonic() - began
    assert status != 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert lines and all("GLOO_SOCKET_IFNAME" in line and "cannot reach the other processes" in line
                         for line in lines), output[-6000:]
    assert "this is a bug" not in output
    # It used to wait out torch's fixed 30 minutes on the node that could not tell.
    assert took < timeout + 30, f"the job took {took:.0f} s\n{output[-4000:]}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> np.ndarray:
    """The final weights of the tiny job in one process with twice the accumulation (what two
    nodes of one process each compute)."""
    cwd = tmp_path_factory.mktemp("one") / "repo"
    _repository_view(cwd)
    done = subprocess.run([sys.executable, "bert.py", "train", "--config", "configs/demo.json", *TINY_JOB,
                           "--batch.gradient_accumulation", "2", "--training.output_dir", "runs/one"],
                          cwd=cwd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return _final_weights(cwd / "runs/one")


def _final_weights(run: Path) -> np.ndarray:
    return np.fromfile(run / "checkpoint-final/weights.vg0.data", dtype=np.float32)


def test_with_the_interface_variable_two_namespaces_train_as_one_process(nodes, one_process, tmp_path):
    cwd = tmp_path / "repo"
    status, output = _run_in(cwd, _agents(nodes, 29432, extra_env=f"GLOO_SOCKET_IFNAME={INTERFACE}"), 400)
    assert status == 0 and "checkpoint: runs/ns/checkpoint-final" in output, output[-6000:]
    assert_close(_final_weights(cwd / "runs/ns"), one_process, 1e-5, "two network namespaces vs one process")


def test_rank_0_killed_the_survivor_names_it_and_the_newest_checkpoint(nodes, tmp_path):
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    command = _agents(nodes, 29433, extra_env=f"GLOO_SOCKET_IFNAME={INTERFACE}", steps=100000)
    status, output, _ = fault_midway(["bash", "-c", command], cwd, cwd / "runs/ns/checkpoint-8", 0,
                                     lambda pid: os.kill(pid, signal.SIGKILL), 120)
    assert status != 0
    newest = max(int(p.name.split("-")[1]) for p in (cwd / "runs/ns").glob("checkpoint-[0-9]*"))
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert re.match(r"error: rank 0, which hosts the job's key-value store, died or cannot be reached .*; stopping "
                    r"rank 1\. the newest verified checkpoint is runs/ns/checkpoint-(\d+): resume with", line), line
    assert f"checkpoint-{newest}:" in line, (newest, line)


# ------------------------------------------------------------ SLURM and Kubernetes
SRUN = r"""#!/bin/bash
# srun for the tests: each task of the allocation in its node's network namespace, with the
# node's host name and the SLURM variables of its task.
while [[ $# -gt 0 && $1 == --* ]]; do shift; done  # srun's own options
read -ra namespaces <<< "$FAKE_SLURM_NAMESPACES"
per_node=${SLURM_NTASKS_PER_NODE:-1}
for ((task = 0; task < SLURM_NTASKS; task++)); do
  node=$((task / per_node))
  ip netns exec "${namespaces[$node]}" unshare --uts env SLURM_PROCID=$task SLURM_NODEID=$node \
    SLURM_LOCALID=$((task % per_node)) sh -c 'hostname "$0" && exec "$@"' "node$node" "$@" &
done
failed=0; for task in $(jobs -p); do wait "$task" || failed=1; done; exit $failed
"""
SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && seq -f 'node%g' 0 $((SLURM_NNODES - 1))
"""


def _cluster_view(tmp_path: Path) -> Path:
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    (cwd / "launch").symlink_to(ROOT / "launch")
    return cwd


def _wait_all(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    try:
        return [(p.wait(timeout=timeout), p.communicate()[0]) for p in processes]
    finally:
        for p in processes:
            _kill_group(p)


def test_the_sbatch_script_runs_two_nodes_as_one_process(nodes, one_process, tmp_path):
    cwd = _cluster_view(tmp_path)
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_ins}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242", "FAKE_SLURM_NAMESPACES": " ".join(nodes),
           "CONFIG": "configs/demo.json", "PROCESSES_PER_TASK": "1"}
    job = subprocess.Popen(["bash", "launch/slurm.sbatch", *TINY_JOB, "--training.output_dir", "runs/slurm"], cwd=cwd,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ((status, output),) = _wait_all([job], 400)
    assert status == 0 and "checkpoint: runs/slurm/checkpoint-final" in output, output[-6000:]
    assert "global batch 8 = micro batch 4 × gradient accumulation 1 × 2 replica(s)" in output
    assert_close(_final_weights(cwd / "runs/slurm"), one_process, 1e-5, "launch/slurm.sbatch vs one process")


def test_the_kubernetes_manifest_runs_two_pods_as_one_process(nodes, one_process, tmp_path):
    import yaml

    documents = list(yaml.safe_load_all((ROOT / "launch/kubernetes.yaml").read_text()))
    (service,) = [d for d in documents if d["kind"] == "Service"]
    (job,) = [d for d in documents if d["kind"] == "Job"]
    name, spec, pod = job["metadata"]["name"], job["spec"], job["spec"]["template"]["spec"]
    # The pods find each other: an Indexed Job's pod i is host groupbert-<i>, and the headless
    # Service of the pods' subdomain gives it the DNS name the rendezvous endpoint names.
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == len(nodes)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": name}
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["NODES"]) == spec["parallelism"]
    env["PROCESSES_PER_NODE"] = "1"  # this host's pods have no GPUs: one process each
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["command"] + container["args"]]
    assert f"{name}-0.{pod['subdomain']}:{service['spec']['ports'][0]['port']}" in argv
    argv[argv.index("--config") + 1] = "configs/demo.json"
    argv[argv.index("--training.output_dir") + 1] = "runs/k8s"
    argv = [sys.executable if a == "python" else a for a in argv] + TINY_JOB
    cwd = _cluster_view(tmp_path)
    pods = [subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
                              'hostname "$0" && exec "$@"', f"{name}-{i}", "env", f"JOB_COMPLETION_INDEX={i}",
                              *(f"{k}={v}" for k, v in env.items()), *argv],
                             cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for i, namespace in enumerate(nodes)]
    results = _wait_all(pods, 400)
    assert [status for status, _ in results] == [0, 0], results[0][1][-4000:] + results[1][1][-4000:]
    assert_close(_final_weights(cwd / "runs/k8s"), one_process, 1e-5, "launch/kubernetes.yaml vs one process")
