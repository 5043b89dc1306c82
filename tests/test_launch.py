"""What a launch decides before and around the processes' work, checked in one process:
the rank layout (one function for the data share and the process groups), the device of
each process, the early refusal of a launch that does not fit, and who owns SIGINT/SIGTERM."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bert import load_config, with_overrides
from bert.data import data_share, run_layout
from session import distributed
from session.ranks import RankLayout, nodes_from_env, process_device, rank_layout

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("world, stages", [(1, 1), (4, 1), (2, 2), (6, 2), (12, 3), (8, 4)])
def test_every_rank_holds_one_replica_and_virtual_graph_and_every_pair_is_held_once(world, stages):
    layouts = [rank_layout(world, stages, None, rank) for rank in range(world)]
    assert {(l.replica, l.virtual_graph) for l in layouts} == \
        {(r, v) for r in range(world // stages) for v in range(stages)}
    for layout in layouts:
        assert layout.replicas * layout.virtual_graphs == world == layout.world_size
        assert layout.rank_of(layout.replica, layout.virtual_graph) == layout.rank
        # The stages of one replica are neighbours; a virtual graph's replicas are V apart.
        assert layout.rank == layout.replica * stages + layout.virtual_graph


def test_a_process_count_that_does_not_split_into_pipelines_names_the_counts_that_fit():
    with pytest.raises(ValueError, match=r"^3 processes do not split into replicas of 2 pipeline processes .*"
                                         r"`torchrun --nproc-per-node 2` \(1 replica\) or "
                                         r"`torchrun --nproc-per-node 4` \(2 replicas\)$"):
        rank_layout(3, 2, None, 2)
    with pytest.raises(ValueError, match=r"parallel.replication_factor 2 × 2 pipeline processes needs 4 processes, "
                                         r"but 6 were launched: launch with `torchrun --nproc-per-node 4 bert.py "
                                         r"...`; or leave parallel.replication_factor unset to use every process "
                                         r"\(3 replicas\)"):
        rank_layout(6, 2, 2, 0)
    with pytest.raises(ValueError, match="replication_factor 2 needs 2 processes, but 1 were launched"):
        rank_layout(1, 1, 2, 0)


def test_over_several_nodes_the_counts_that_fit_are_per_node():
    """2 nodes × 8 processes, 3 stages: a per-node count whose total is a multiple of 3 (the
    hint used to be the totals, `--nproc-per-node 15` or `18`, as if for one node)."""
    with pytest.raises(ValueError, match=r"^16 processes \(2 nodes × 8\) do not split into replicas of 3 pipeline "
                                         r"processes .*: launch a multiple of 3 in all, e\.g\. `--nproc-per-node 6` or "
                                         r"`--nproc-per-node 9` on each of 2 nodes \(12 or 18 processes: 4 or 6 "
                                         r"replicas\)$"):
        rank_layout(16, 3, None, 0, nodes=2)
    # 3 nodes × 4 processes, 2 stages: each node's count must be even (3 nodes of an odd count
    # leave a pipeline half-filled); 4 nodes of 3 over 2 stages: any count, the total is even.
    with pytest.raises(ValueError, match=r"`--nproc-per-node 4` or `--nproc-per-node 6` on each of 3 nodes"):
        rank_layout(15, 2, None, 0, nodes=3)
    assert rank_layout(12, 2, None, 0, nodes=4).replicas == 6
    with pytest.raises(ValueError, match=r"`--nproc-per-node 3` or `--nproc-per-node 4` on each of 4 nodes "
                                         r"\(12 or 16 processes: 6 or 8 replicas\)"):
        rank_layout(4 * 3 + 1, 2, None, 0, nodes=4)
    with pytest.raises(ValueError, match=r"needs 6 processes, but 16 \(2 nodes × 8\) were launched: launch "
                                         r"`--nproc-per-node 3` on each of 2 nodes; or leave"):
        rank_layout(16, 2, 3, 0, nodes=2)
    with pytest.raises(ValueError, match=r"needs 10 processes, but 16 \(4 nodes × 4\) were launched: 10 "
                                         r"processes do not spread evenly over 4 nodes: give "
                                         r"parallel.replication_factor a multiple of 2"):
        rank_layout(16, 2, 5, 0, nodes=4)


@pytest.mark.parametrize("env, nodes", [
    ({}, 1),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}, 2),  # torchrun
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # torchrun before GROUP_WORLD_SIZE, or by hand
    ({"WORLD_SIZE": "16", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "4"}, 4),  # srun starts bert.py itself
    ({"WORLD_SIZE": "16", "SLURM_NNODES": "2"}, 2),
    ({"WORLD_SIZE": "16", "NNODES": "2"}, 2),
], ids=["none", "torchrun", "local-world-size", "srun-step", "slurm-job", "nnodes"])
def test_the_nodes_of_a_run_are_read_from_its_launcher(env, nodes):
    assert nodes_from_env(env) == nodes


def test_the_refusal_before_torch_counts_the_nodes_torchrun_started(monkeypatch):
    for key, value in {"WORLD_SIZE": "16", "RANK": "5", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    config = with_overrides(_pipeline_config(), {"model.layers_per_stage": [8, 8, 8]})
    with pytest.raises(ValueError, match=r"`--nproc-per-node 6` or `--nproc-per-node 9` on each of 2 nodes"):
        run_layout(config)


def _pipeline_config(**training):
    config = load_config(ROOT / "configs" / "groupbert_large.json")
    return with_overrides(config, {"parallel.pipeline": True, "model.layers_per_stage": [6, 6, 6, 6],
                                   **{f"training.{k}": v for k, v in training.items()}})


@pytest.mark.parametrize("rank", range(8))
def test_the_data_share_is_the_layout_the_process_groups_are_made_from(monkeypatch, rank):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", str(rank))
    config = _pipeline_config()
    layout = run_layout(config)
    assert layout == rank_layout(8, 4, None, rank) == RankLayout(rank, 2, 4)
    assert data_share(config) == (rank // 4, 2)
    # make_topology takes the same function; Topology is the layout with its groups.
    assert issubclass(distributed.Topology, RankLayout) and distributed.rank_layout is rank_layout


def test_the_data_share_refuses_what_the_session_would_refuse(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="3 processes do not split into replicas of 4 pipeline processes"):
        data_share(_pipeline_config())


# ----------------------------------------------------------------- devices
def test_each_process_of_a_node_gets_its_own_gpu_or_an_index_is_refused_with_the_fix():
    launched = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "3"}
    assert process_device("cuda", launched) == "cuda:1" == process_device("cuda", launched, visible=2)
    assert process_device("cpu", launched) == "cpu"
    with pytest.raises(ValueError, match=r"training.device 'cuda:0' puts all 2 processes of this node on one GPU: "
                                         r"give 'cuda' \(each process takes the GPU of its local rank\)"):
        process_device("cuda:0", launched)
    one_per_node = {**launched, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert process_device("cuda:1", one_per_node) == "cuda:1", "one process per node may pick its GPU"
    assert process_device("cuda:1", {}) == "cuda:1" and process_device("cuda", {}) == "cuda"
    # A launcher that shows each process one GPU and sets LOCAL_RANK itself: that GPU.
    assert process_device("cuda", {"WORLD_SIZE": "16", "RANK": "11", "LOCAL_RANK": "3",
                                   "CUDA_VISIBLE_DEVICES": "3"}) == "cuda:0"


def test_more_processes_on_a_node_than_its_gpus_are_refused_not_stacked():
    # torchrun --nproc-per-node 4 on a machine (or pod) of 2 GPUs: ranks 0 and 1 used to take
    # cuda:0 and cuda:1, and ranks 2 and 3 were refused one by one; every process says it now.
    for local_rank in range(4):
        env = {"WORLD_SIZE": "4", "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "4"}
        with pytest.raises(ValueError, match=r"^4 processes on this node \(LOCAL_WORLD_SIZE=4\) would share 2 GPUs, "
                                             r"cuda:0 to cuda:1 \(CUDA_VISIBLE_DEVICES is not set\): start one process "
                                             r"per GPU \(`torchrun --nproc-per-node 2`\)$"):
            process_device("cuda", env, visible=2)
    with pytest.raises(ValueError, match=r"would share 1 GPU, cuda:0 \(CUDA_VISIBLE_DEVICES=0\)"):
        process_device("cuda", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                "CUDA_VISIBLE_DEVICES": "0"})


@pytest.mark.parametrize("env, visible, expected", [
    ({"CUDA_VISIBLE_DEVICES": "3"}, None, r"sees only 1 GPU, cuda:0 \(CUDA_VISIBLE_DEVICES=3\)"),
    ({}, 1, r"sees only 1 GPU, cuda:0 \(CUDA_VISIBLE_DEVICES is not set\)"),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, None, r"sees only 1 GPU, cuda:0 \(CUDA_VISIBLE_DEVICES=0,-1,2\)"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}, 1, r"sees only 1 GPU, cuda:0"),
], ids=["visible-devices", "torch-count", "cuda-stops-at-an-invalid-entry", "one-process-per-node"])
def test_a_gpu_index_the_process_cannot_see_is_refused_naming_what_it_sees(env, visible, expected):
    with pytest.raises(ValueError, match=r"^training.device 'cuda:1', but this process " + expected
                       + r".*: give an index below 1, or 'cuda'"):
        process_device("cuda:1", env, visible=visible)
    assert process_device("cuda:0", env, visible=visible) == "cuda:0"


@pytest.mark.parametrize("visible_devices", ["", "-1"])
def test_a_process_that_sees_no_gpu_is_refused(visible_devices):
    with pytest.raises(ValueError, match=r"^training.device 'cuda', but this process sees no GPU "
                                         r"\(CUDA_VISIBLE_DEVICES=.*\): use 'cpu'"):
        process_device("cuda", {"CUDA_VISIBLE_DEVICES": visible_devices})


def _srun_task(local_id: int, tasks_per_node: int, **env: str) -> dict[str, str]:
    """What srun gives task `local_id` of node 1 in a 2-node step (and torchrun, when `env` has
    LOCAL_RANK, its workers): SLURM_STEP_TASKS_PER_NODE marks an srun task."""
    return {"WORLD_SIZE": str(2 * tasks_per_node), "RANK": str(tasks_per_node + local_id), "SLURM_NODEID": "1",
            "SLURM_LOCALID": str(local_id), "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x2)", "SLURM_GPUS_ON_NODE": "8", **env}


def test_srun_tasks_that_share_the_node_s_gpus_take_one_each():
    # `srun --ntasks-per-node 8` (no --gpus-per-task): every task sees the node's 8 GPUs and runs
    # torchrun --nproc-per-node 1, whose LOCAL_RANK is 0 in every task: all 8 used to take cuda:0.
    all_eight = "0,1,2,3,4,5,6,7"
    torchrun = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for env, visible in (({"CUDA_VISIBLE_DEVICES": all_eight}, None), ({}, 8)):
        devices = [process_device("cuda", _srun_task(i, 8, **torchrun, **env), visible) for i in range(8)]
        assert devices == [f"cuda:{i}" for i in range(8)], devices
        # srun starting bert.py itself (RANK and WORLD_SIZE from SLURM_PROCID and SLURM_NTASKS by hand).
        assert process_device("cuda", _srun_task(5, 8, **env), visible) == "cuda:5"
    # 4 tasks of torchrun --nproc-per-node 2 on the node's 8 GPUs: task 3's second process.
    assert process_device("cuda", _srun_task(3, 4, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                                             CUDA_VISIBLE_DEVICES=all_eight)) == "cuda:7"
    # A node of 4 GPUs under 8 tasks: refused in one line with the fix, on every task.
    four = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4", **torchrun}
    refused = (r"^8 processes on this node \(8 srun tasks of 1 process each, all seeing the node's GPUs\) would "
               r"share 4 GPUs, cuda:0 to cuda:3 \(CUDA_VISIBLE_DEVICES=0,1,2,3\): start one process per GPU \(one "
               r"srun task per node running `torchrun --nproc-per-node 4`, or each task its own GPU: "
               r"`srun --gpus-per-task 1`\)$")
    for i in (0, 7):
        with pytest.raises(ValueError, match=refused):
            process_device("cuda", _srun_task(i, 8, **four))
    with pytest.raises(ValueError, match=r"puts all 8 processes of this node on one GPU"):
        process_device("cuda:0", _srun_task(2, 8, CUDA_VISIBLE_DEVICES=all_eight, **torchrun))


def test_srun_tasks_given_their_own_gpus_take_those():
    # `srun --ntasks-per-node 8 --gpus-per-task 1`: each task sees its one GPU, which is cuda:0
    # whatever its local id (with torchrun inside, or bert.py started by srun itself).
    for env in ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, {}, {"LOCAL_RANK": "3"}):
        per_task = _srun_task(3, 8, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="3", **env)
        assert process_device("cuda", per_task) == "cuda:0" == process_device("cuda", per_task, visible=1)
        assert process_device("cuda:0", per_task) == "cuda:0", "its own GPU by index is no GPU shared"
    # `--gpu-bind` without --gpus-per-task: the task sees 1 of the node's 8.
    assert process_device("cuda", _srun_task(3, 8, CUDA_VISIBLE_DEVICES="3", LOCAL_RANK="0",
                                             LOCAL_WORLD_SIZE="1")) == "cuda:0"
    # `--gpus-per-task 2` and torchrun --nproc-per-node 2 in each task: its processes take its two.
    two = _srun_task(1, 4, SLURM_GPUS_PER_TASK="2", CUDA_VISIBLE_DEVICES="2,3", LOCAL_WORLD_SIZE="2")
    assert [process_device("cuda", {**two, "LOCAL_RANK": r}) for r in "01"] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match=r"^4 processes on this node \(4 srun tasks of 4 processes each\) would "
                                         r"share 2 GPUs, cuda:0 to cuda:1 \(CUDA_VISIBLE_DEVICES=2,3\): start one "
                                         r"process per GPU \(`torchrun --nproc-per-node 2` in each srun task"):
        process_device("cuda", {**two, "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"})


def test_one_srun_task_per_node_runs_torchrun_over_the_node_s_gpus():
    # launch/slurm.sbatch as shipped: one task per node, torchrun --nproc-per-node 8 in it.
    per_node = _srun_task(0, 1, LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert process_device("cuda", per_node) == "cuda:5" == process_device("cuda", per_node, visible=8)
    with pytest.raises(ValueError, match=r"puts all 8 processes of this node on one GPU"):
        process_device("cuda:0", per_node)
    with pytest.raises(ValueError, match=r"^8 processes on this node \(1 srun task of 8 processes each\) would "
                                         r"share 4 GPUs, cuda:0 to cuda:3 \(CUDA_VISIBLE_DEVICES=0,1,2,3\): start one "
                                         r"process per GPU \(one srun task per node running `torchrun --nproc-per-node "
                                         r"4`"):
        process_device("cuda", {**per_node, "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    # Nodes of different task counts: srun's layout for this node (node 1 runs 3 of "4,3").
    uneven = _srun_task(2, 3, SLURM_STEP_TASKS_PER_NODE="4,3", SLURM_NTASKS_PER_NODE="", SLURM_GPUS_ON_NODE="3",
                        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    assert process_device("cuda", uneven, visible=3) == "cuda:2"
    with pytest.raises(ValueError, match=r"^3 processes on this node \(3 srun tasks"):
        process_device("cuda", {**uneven, "SLURM_GPUS_ON_NODE": "2"}, visible=2)


def test_torchrun_in_a_batch_script_is_no_srun_task():
    # torchrun started by the batch script itself (no srun) under `#SBATCH --ntasks-per-node 8`:
    # SLURM_LOCALID is 0 and SLURM_NTASKS_PER_NODE 8, but the script is one process, not 8 tasks.
    batch = {"WORLD_SIZE": "8", "RANK": "6", "LOCAL_RANK": "6", "LOCAL_WORLD_SIZE": "8", "SLURM_LOCALID": "0",
             "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert process_device("cuda", batch) == "cuda:6"
    # Without a count of the node's processes, the world is not taken for one node.
    assert process_device("cuda:0", {"WORLD_SIZE": "16", "RANK": "3"}) == "cuda:0"


@pytest.mark.slow
@pytest.mark.parametrize("argv, expected", [
    (["--training.log_every", "5"], "error: data.eval_files ['data/pretraining/seq128/eval/*.hdf5'] match no file"),
    (["--parallel.pipeline", "true", "--model.layers_per_stage", "[12, 12]"],
     "error: 3 processes do not split into replicas of 2 pipeline processes"),
], ids=["missing-data", "process-count"])
def test_a_launch_that_cannot_run_is_refused_before_torch_is_imported(tmp_path, argv, expected):
    """configs/groupbert_large.json without its shards, with overrides, as rank 2 of 3."""
    probe = ("import runpy, sys; code = runpy.run_path('bert.py')['main'](sys.argv[1:]); "
             "print(code, 'torch' in sys.modules, ','.join(sorted(m for m in sys.modules if m.startswith('session'))))")
    done = subprocess.run([sys.executable, "-c", probe, "--config", "configs/groupbert_large.json", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "3"})
    assert done.stderr.startswith(expected) and len(done.stderr.strip().splitlines()) == 1, done.stderr
    code, torch_imported, session_modules = done.stdout.split()
    assert code == "2" and torch_imported == "False", done.stdout
    torch_free = {"session", "session.ranks", "session.kernel_choices", "session.process", "session.hyperparameters"}
    assert set(session_modules.split(",")) <= torch_free, session_modules


# ------------------------------------------------------------- rendezvous
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "env"])
def test_a_rendezvous_address_that_does_not_resolve_is_bad_input_at_once(tmp_path, launcher):
    """MASTER_ADDR no-such-host.invalid: torchrun hands it to the workers as the first agent's
    `--local-addr` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as the docs ask; without it, the
    agent's own host name, which other nodes may not resolve); another launcher sets it itself.
    Each worker used to retry it for parallel.collective_timeout and then say "set
    GLOO_SOCKET_IFNAME", and torchrun started them again to wait once more (69 s at a 20 s
    timeout and one restart; 41 minutes at the default 600 s and --max-restarts 3). Now each
    attempt ends before any connection with exit 2 and one line naming MASTER_ADDR; torchrun
    still restarts a worker that fails (any exit but 0), so its restarts are spent, in seconds."""
    try:
        socket.getaddrinfo("no-such-host.invalid", None)
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:  # a resolver that cannot answer is left to torch's retries
            pytest.skip(f"this host's resolver does not say that no-such-host.invalid is unknown: {e}")
    job = ["bert.py", "train", "--config", "configs/demo.json", "--data.source", "synthetic", "--training.steps", "2",
           "--schedule.warmup_steps", "1", "--evaluation.every", "0", "--parallel.collective_timeout", "120",
           "--training.output_dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                   "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                   "--local-addr", "no-such-host.invalid", *job]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        fix = r"torchrun gives the workers the host of --rdzv-endpoint, or, .* `--local-addr` with an address"
    else:
        command = [sys.executable, *job]
        env.update(WORLD_SIZE="2", RANK="1", MASTER_ADDR="no-such-host.invalid", MASTER_PORT=str(_free_port()))
        fix = r"set MASTER_ADDR to rank 0's host name or address, one every node resolves"
    began = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - began
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    pattern = rf"^error: MASTER_ADDR 'no-such-host.invalid' does not resolve on \S+ \(.*\): {fix}.*\"Networks\"$"
    assert errors and all(re.match(pattern, line) for line in errors), done.stderr[-4000:]
    if launcher == "torchrun":  # 2 workers × 2 attempts, each ended with the bad-input status
        assert len(errors) == 4 and done.returncode == 1, done.stderr[-4000:]
        assert re.search(r"exitcode\s*: 2 ", done.stderr), done.stderr[-4000:]
    else:
        assert len(errors) == 1 and done.returncode == 2, done.stderr[-4000:]
    assert took < 120, f"{took:.0f} s: it waited for a connection"


# ------------------------------------------------------------- Kubernetes
def test_the_kubernetes_job_replaces_lost_pods_not_bad_input_and_waits_for_the_sigterm_checkpoint(tmp_path):
    """launch/kubernetes.yaml's policies (tests/test_network_ns.py runs its command in two pods'
    network namespaces): a disrupted pod (drain, lost node, preemption) is replaced uncounted,
    status 2 ends the job, a SIGTERM's checkpoint has time, and the pod asks for what it uses."""
    import runpy

    import yaml

    (job,) = [d for d in yaml.safe_load_all((ROOT / "launch/kubernetes.yaml").read_text()) if d["kind"] == "Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy Never"
    disrupted, bad_input = spec["podFailurePolicy"]["rules"]  # in this order: a drained pod is never bad input
    assert disrupted == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert bad_input == {"action": "FailJob", "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                              "values": [2]}}
    # 2 is bert.py's status for bad input (a config file that is not there, here).
    main = runpy.run_path(str(ROOT / "bert.py"))["main"]
    assert main(["train", "--config", str(tmp_path / "missing.json")]) == 2
    assert spec["backoffLimit"] >= 2, "a failure other than bad input replaces the pods, both of which it may end"
    unreachable = {t["key"]: t for t in pod["tolerations"]}["node.kubernetes.io/unreachable"]
    assert unreachable["effect"] == "NoExecute" and unreachable["tolerationSeconds"] < 300  # the default
    # SIGTERM: torchrun gives its workers --shutdown-timeout seconds to write their checkpoint (30
    # by default; GroupBERT-base's is about 19 s at 100 MB/s), Kubernetes gives the pod its grace.
    args = container["args"]
    shutdown = int(args[args.index("--shutdown-timeout") + 1])
    assert 30 < shutdown < pod["terminationGracePeriodSeconds"]
    # torchrun is not the pod's PID 1, so a worker that finds MASTER silent can SIGKILL it
    # (tests/test_elastic.py, a paused MASTER, where its agent is its namespace's init or not).
    assert pod["shareProcessNamespace"] is True
    # Guaranteed QoS: requests equal limits, for the GPUs the command starts a process on each.
    resources = container["resources"]
    assert resources["requests"] == resources["limits"] and {"cpu", "memory", "nvidia.com/gpu"} <= set(
        resources["limits"])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert resources["limits"]["nvidia.com/gpu"] == int(env["PROCESSES_PER_NODE"])
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory" and "sizeLimit" in shm["emptyDir"]  # counted in the memory limit


# ----------------------------------------------------------------- signals
@pytest.fixture
def handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


def test_the_launch_context_owns_the_signals_and_gives_them_back(handlers):
    with distributed.launch("cpu") as world:
        assert signal.getsignal(signal.SIGTERM) == world._on_signal == signal.getsignal(signal.SIGINT)
        with pytest.raises(SystemExit) as stopped:
            signal.raise_signal(signal.SIGTERM)
        assert stopped.value.code == 128 + signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_in_a_stoppable_block_the_first_signal_asks_to_stop_and_the_second_stops_now(handlers, signum, capsys):
    asked = []
    with distributed.launch("cpu") as world:
        with world.stop_on_signal(lambda: asked.append(True), announce=True) as stop:
            signal.raise_signal(signum)
            assert asked == [True] and stop.signum == signum
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
            assert asked == [True], "the second signal does not ask again"
        with pytest.raises(SystemExit if signum == signal.SIGTERM else KeyboardInterrupt):
            signal.raise_signal(signum)  # outside the block: at once
    assert f"{signal.Signals(signum).name}: stopping after this step" in capsys.readouterr().out
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_bert_py_runs_with_the_process_settings_the_benchmarks_measure_with(monkeypatch, capsys):
    """session.process's settings (glibc keeping freed memory: 10 % of a CPU step) are applied
    by bert.py itself, so the benchmarks' tokens/s are what a run gets."""
    import runpy

    import session.process

    assert session.process.retain_freed_memory(), "glibc takes the setting"
    calls = []
    monkeypatch.setattr(session.process, "retain_freed_memory", lambda: calls.append(1) or True)
    main = runpy.run_path(str(ROOT / "bert.py"))["main"]
    assert main(["summary", "--config", str(ROOT / "configs" / "demo.json")]) == 0
    assert calls == [1]
    for bench in ("train_throughput.py", "step_profile.py"):
        assert "retain_freed_memory()" in (ROOT / "bench" / bench).read_text(), bench


def test_a_fault_names_the_step_a_process_is_in_or_the_one_it_has_done():
    from session.watchdog import _position

    assert _position(8, True, "backward of stage 1, micro-batch 2") == "in step 8 (backward of stage 1, micro-batch 2)"
    assert _position(8, False, "saving a checkpoint") == "after step 8 (saving a checkpoint)"
    assert _position(0, False, "starting") == "before its first step (starting)"


def test_a_record_holds_each_rank_s_work_and_a_slow_rank_among_its_peers_is_named():
    from bert.run.progress import _Window

    window = _Window()
    for step, ranks in enumerate([[0.20, 0.21, 0.50, 0.22], [0.22, 0.19, 0.46, 0.20]], start=11):
        window.add(step, {"loss": 1.0, "skipped": 0.0}, 0.6, 8, 100, 8, ranks)
    record = window.record(12)
    assert (record["rank_seconds_min"], record["rank_seconds_median"], record["rank_seconds_max"],
            record["slowest_rank"]) == (0.2, 0.21, 0.48, 2)
    # 2 replicas × 2 virtual graphs: rank 2 (replica 1, virtual graph 0) against rank 0.
    said = window.slow_rank([[0, 2], [1, 3]], 1.5)
    assert said == "rank 2 is slow: 0.48 s of work per step against 0.21 s, the other replica's (2.3×)", said
    assert window.slow_rank([[0, 2], [1, 3]], 3.0) == "", "within the factor: nothing said"
    assert window.slow_rank([], 1.5) == "", "no peers (one replica): nothing to compare"
    one = _Window()
    one.add(1, {"loss": 1.0, "skipped": 0.0}, 0.6, 8, 100, 8, [0.2])
    assert "rank_seconds_max" not in one.record(1), "one process: no per-rank figures"
