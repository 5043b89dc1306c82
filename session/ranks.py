"""Which part of a launched run each process holds: the rank layout, without torch.

The one place the layout is computed. `bert.py` checks it right after reading the
config (before torch is imported or any model is built), `bert/data.py` reads this
process's share of the data from it, and `session.distributed.make_topology` builds
the process groups from it, so the three cannot disagree.

With R replicas of a graph whose stages sit on V virtual graphs (V = 1 without
pipelining) the world holds R × V processes:

    rank = replica · V + virtual_graph

so the stages of one replica are neighbours and a virtual graph's replicas are V apart.

Beside it, what else the launcher's environment decides, also without torch: the nodes a
run spans (`nodes_from_env`), each process's GPU (`process_device`) and whether the address
the processes meet at resolves (`check_rendezvous_address`).
"""
from __future__ import annotations

import enum
import math
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["RankLayout", "check_rendezvous_address", "nodes_from_env", "process_device", "rank_layout",
           "world_size_from_env"]


def world_size_from_env(env: Mapping[str, str] = os.environ) -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return int(env.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class RankLayout:
    rank: int = 0
    replicas: int = 1
    virtual_graphs: int = 1

    @property
    def world_size(self) -> int:
        return self.replicas * self.virtual_graphs

    @property
    def replica(self) -> int:
        return self.rank // self.virtual_graphs

    @property
    def virtual_graph(self) -> int:
        return self.rank % self.virtual_graphs

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rank_of(self, replica: int, virtual_graph: int) -> int:
        return replica * self.virtual_graphs + virtual_graph

    def describe(self) -> str:
        return f"rank {self.rank} (replica {self.replica}, virtual graph {self.virtual_graph})"


def nodes_from_env(env: Mapping[str, str] = os.environ) -> int:
    """The nodes a launched run spans, as the launcher says (1 when it says nothing).

    torchrun's GROUP_WORLD_SIZE (its agents, one per `--nnodes`; several srun tasks of one
    machine that each run an agent are several), else WORLD_SIZE / LOCAL_WORLD_SIZE; srun's
    SLURM_STEP_NUM_NODES or SLURM_NNODES; NNODES where a launcher script sets it by hand.
    """
    groups = _count(env, "GROUP_WORLD_SIZE")
    if groups:
        return groups
    world, local = _count(env, "WORLD_SIZE"), _count(env, "LOCAL_WORLD_SIZE")
    if world and local and world % local == 0:
        return world // local
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "NNODES"):
        if _count(env, key):
            return _count(env, key)
    return 1


def rank_layout(world: int, virtual_graphs: int, replication_factor: Optional[int], rank: int,
                nodes: int = 1) -> RankLayout:
    """The layout of `world` processes as replicas × `virtual_graphs`, seen from `rank`.

    `replication_factor` None means "every process the pipeline does not use": the world
    divided by `virtual_graphs`. A world that does not split so is a ValueError naming
    the process counts that would fit, per node of the `nodes` the run spans
    (`nodes_from_env`): `--nproc-per-node` counts one node's processes.
    """
    v = virtual_graphs
    if replication_factor is None:
        if world % v:
            raise ValueError(
                f"{world} processes{_per_node(world, nodes)} do not split into replicas of {v} pipeline processes "
                f"(one per virtual graph of model.layers_per_stage): launch a multiple of {v}"
                f"{' in all' * (nodes > 1)}, e.g. {_counts_that_fit(world, v, nodes)}")
        replication_factor = world // v
    if replication_factor < 1:
        raise ValueError(f"parallel.replication_factor {replication_factor} must be at least 1")
    if replication_factor * v != world:
        pipeline = f" × {v} pipeline processes" if v > 1 else ""
        hint = (f"; or leave parallel.replication_factor unset to use every process ({world // v} replicas)"
                if world % v == 0 else "")
        needed = replication_factor * v
        if nodes == 1:
            launch = f"launch with `torchrun --nproc-per-node {needed} bert.py ...`"
        elif needed % nodes == 0:
            launch = f"launch `--nproc-per-node {needed // nodes}` on each of {nodes} nodes"
        else:
            launch = (f"{needed} processes do not spread evenly over {nodes} nodes: give parallel.replication_factor "
                      f"a multiple of {nodes // math.gcd(nodes, v)}")
        raise ValueError(
            f"parallel.replication_factor {replication_factor}{pipeline} needs {needed} "
            f"processes, but {world}{_per_node(world, nodes)} were launched: {launch}{hint}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the {world} processes the launcher started (RANK, WORLD_SIZE)")
    return RankLayout(rank, replication_factor, v)


def _per_node(world: int, nodes: int) -> str:
    return f" ({nodes} nodes × {world // nodes})" if nodes > 1 and world % nodes == 0 else ""


def _counts_that_fit(world: int, v: int, nodes: int) -> str:
    """The process counts per node, around this launch's, whose total is a multiple of `v`."""
    step = v // math.gcd(nodes, v)  # per-node counts that are multiples of `step` fill whole pipelines
    per_node = max(1, world // nodes)
    fits = sorted({step * max(1, per_node // step), step * (per_node // step + 1)})
    if nodes == 1:
        return " or ".join(f"`torchrun --nproc-per-node {n}` ({n // v} replica{'s' * (n // v > 1)})" for n in fits)
    return (f"{' or '.join(f'`--nproc-per-node {n}`' for n in fits)} on each of {nodes} nodes "
            f"({' or '.join(str(n * nodes) for n in fits)} processes: "
            f"{' or '.join(str(n * nodes // v) for n in fits)} replicas)")


def check_rendezvous_address(env: Mapping[str, str] = os.environ) -> None:
    """MASTER_ADDR, where every process connects first, names a host this node knows; else a
    ValueError (bad input: exit 2) before any connection is tried.

    torch retries a name that does not resolve until the collective timeout, and torchrun then
    starts the workers again (`--max-restarts`) to wait once more; a name the resolver does not
    know stays unknown. A resolver that cannot answer now (EAI_AGAIN) is left to torch's retries.
    """
    host = env.get("MASTER_ADDR")
    if not host:
        return  # init_process_group names the missing variable itself
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return
        if "TORCHELASTIC_RUN_ID" in env:  # torchrun chose it: the store's host, or the first agent's address
            fix = ("torchrun gives the workers the host of --rdzv-endpoint, or, with "
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the first node's host name (`hostname --fqdn`) unless its "
                   "agent is given `--local-addr` with an address every node reaches")
        else:
            fix = ("set MASTER_ADDR to rank 0's host name or address, one every node resolves (not localhost across "
                   "machines)")
        raise ValueError(f"MASTER_ADDR {host!r} does not resolve on {socket.gethostname()} ({e.strerror}): {fix}; "
                         "more in docs/distributed.md, \"Networks\"") from None


def process_device(device: str, env: Mapping[str, str] = os.environ, visible: Optional[int] = None) -> str:
    """The device this process of a launched run uses; a ValueError (one line, with the fix)
    for a device it cannot use alone.

    `visible` is how many GPUs the process sees (torch.cuda.device_count()); None before
    torch is imported, when CUDA_VISIBLE_DEVICES, if set, says.

    "cuda" (no index) is, in a launched run, the GPU of this process's place among the
    processes of its node that see the same GPUs (`_node_share`): its LOCAL_RANK under
    torchrun; under srun, whose tasks all see the node's GPUs unless given their own
    (`--gpus-per-task`, a `--gpu-bind`), SLURM_LOCALID × the task's processes + LOCAL_RANK.
    More such processes than visible GPUs are refused rather than stacked on one GPU.
    "cuda:<index>" names one GPU: refused when the process does not see it, or when the
    node's other processes see it too (all of them would use it).
    """
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    count = visible if visible is not None else _visible_gpus(env)
    if count == 0:
        raise ValueError(f"training.device {device!r}, but this process sees no GPU ({_where(env)}): use 'cpu', or "
                         "check CUDA_VISIBLE_DEVICES and the driver (`nvidia-smi`)")
    share = _node_share(env, count) if world_size_from_env(env) > 1 else None
    if index:
        if count is not None and int(index) >= count:
            raise ValueError(
                f"training.device {device!r}, but this process sees only {_gpus(count)} ({_where(env)}): give an index "
                f"below {count}, or 'cuda' (each process of a launched run takes the GPU of its local rank)")
        if share is not None and share.processes is not None and share.processes > 1:
            raise ValueError(
                f"training.device {device!r} puts all {share.processes} processes of this node on one GPU: give "
                "'cuda' (each process takes the GPU of its local rank), or start one process per node "
                "(`torchrun --nproc-per-node 1`) to pick a GPU by index")
        return device
    if share is None:
        return device
    if count is not None and share.processes is not None and share.processes > count:
        raise ValueError(f"{share.processes} processes on this node ({share.said_by}) would share "
                         f"{_gpus(count)} ({_where(env)}): start one process per GPU ({share.fix(count)})")
    if share.processes is None and count == 1:
        return "cuda:0"  # a launcher that shows each process one GPU (and sets LOCAL_RANK by hand): that one
    if count is not None and share.index >= count:
        raise ValueError(f"this process is local rank {share.index} but sees {_gpus(count)} ({_where(env)}): start "
                         f"one process per visible GPU on each node ({share.fix(count)})")
    return f"cuda:{share.index}"


class _Sharing(enum.Enum):
    """Who started the processes of a node, and whether srun gave each task GPUs of its own."""

    TORCHRUN = "torchrun"
    SRUN_NODE_GPUS = "srun tasks that see the node's GPUs"
    SRUN_OWN_GPUS = "srun tasks given GPUs of their own"


@dataclass(frozen=True)
class _NodeShare:
    """This process among the processes of its node that see the same GPUs."""

    index: int  # its place among them: the GPU it takes
    processes: Optional[int]  # how many (None: the launcher does not say)
    said_by: str  # what says so, for messages
    sharing: _Sharing = _Sharing.TORCHRUN

    def fix(self, count: int) -> str:
        """How to start one process per GPU of the `count` each process sees."""
        if self.sharing is _Sharing.SRUN_NODE_GPUS:
            return (f"one srun task per node running `torchrun --nproc-per-node {count}`, or each task its own GPU: "
                    "`srun --gpus-per-task 1`")
        if self.sharing is _Sharing.SRUN_OWN_GPUS:
            return f"`torchrun --nproc-per-node {count}` in each srun task, or more `srun --gpus-per-task`"
        return f"`torchrun --nproc-per-node {count}`"


def _node_share(env: Mapping[str, str], visible: Optional[int]) -> _NodeShare:
    local_rank, per_task = _count(env, "LOCAL_RANK"), _count(env, "LOCAL_WORLD_SIZE")
    tasks = _srun_tasks_on_node(env)
    if tasks is not None:
        # The task's processes: torchrun's workers (LOCAL_RANK of LOCAL_WORLD_SIZE), or the task
        # itself (srun starting bert.py, with LOCAL_RANK set by hand to SLURM_LOCALID, if at all).
        own, in_task = (per_task, local_rank or 0) if per_task is not None else (1, 0)
        task = f"{own} process{'es' * (own > 1)} each"
        if tasks > 1 and not _own_gpus(env, visible):
            # The node's tasks all see its GPUs (srun --ntasks-per-node 8 without --gpus-per-task):
            # LOCAL_RANK alone is 0 in every task and would put them all on GPU 0.
            return _NodeShare(_count(env, "SLURM_LOCALID") * own + in_task, tasks * own,
                              f"{tasks} srun tasks of {task}, all seeing the node's GPUs", _Sharing.SRUN_NODE_GPUS)
        return _NodeShare(in_task, own, f"{tasks} srun task{'s' * (tasks > 1)} of {task}",
                          _Sharing.SRUN_NODE_GPUS if tasks == 1 else _Sharing.SRUN_OWN_GPUS)
    if per_task is not None:
        return _NodeShare(local_rank or 0, per_task, f"LOCAL_WORLD_SIZE={per_task}")
    return _NodeShare(local_rank or 0, None, "LOCAL_RANK")


def _srun_tasks_on_node(env: Mapping[str, str]) -> Optional[int]:
    """The tasks of this srun step on this node; None outside an srun task.

    srun gives its tasks SLURM_STEP_TASKS_PER_NODE (per node of the step, repeats compressed:
    "8(x2)", "4,3"), SLURM_NODEID and SLURM_LOCALID; a batch script has SLURM_LOCALID (0)
    and, with `--ntasks-per-node`, SLURM_NTASKS_PER_NODE too, but is one process whatever
    they say, so they alone do not make an srun task.
    """
    layout = env.get("SLURM_STEP_TASKS_PER_NODE")
    if layout is None or _count(env, "SLURM_LOCALID") is None:
        return None
    counts: list[int] = []
    for part in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            counts = []
            break
        counts += [int(match[1])] * int(match[2] or 1)
    node = _count(env, "SLURM_NODEID") or 0
    return counts[node] if node < len(counts) else _count(env, "SLURM_NTASKS_PER_NODE") or 1


def _own_gpus(env: Mapping[str, str], visible: Optional[int]) -> bool:
    """Whether srun gave this task GPUs of its own: `--gpus-per-task` (which binds each task to
    its GPUs), or fewer visible than the node's allocation (a `--gpu-bind`)."""
    if env.get("SLURM_GPUS_PER_TASK"):
        return True
    on_node = _count(env, "SLURM_GPUS_ON_NODE")
    return visible is not None and on_node is not None and visible < on_node


def _visible_gpus(env: Mapping[str, str]) -> Optional[int]:
    """How many GPUs CUDA_VISIBLE_DEVICES lets this process see (None: not set, all of them).
    CUDA reads the list up to its first invalid entry; "-1" hides every GPU."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    count = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        count += 1
    return count


def _where(env: Mapping[str, str]) -> str:
    """Where the GPUs a process sees come from, for messages."""
    if "CUDA_VISIBLE_DEVICES" not in env:
        return "CUDA_VISIBLE_DEVICES is not set"
    return f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES'] or repr('')}"


def _gpus(count: int) -> str:
    return "1 GPU, cuda:0" if count == 1 else f"{count} GPUs, cuda:0 to cuda:{count - 1}"


def _count(env: Mapping[str, str], key: str) -> Optional[int]:
    value = env.get(key, "").strip()
    return int(value) if value.isdigit() else None
