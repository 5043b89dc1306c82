"""Which part of a launched run each process holds: the rank layout, without torch.

The one place the layout is computed. `bert.py` checks it right after reading the
config (before torch is imported or any model is built), `bert/data.py` reads this
process's share of the data from it, and `session.distributed.make_topology` builds
the process groups from it, so the three cannot disagree.

With R replicas of a graph whose stages sit on V virtual graphs (V = 1 without
pipelining) the world holds R × V processes:

    rank = replica · V + virtual_graph

so the stages of one replica are neighbours and a virtual graph's replicas are V apart.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["RankLayout", "process_device", "rank_layout", "world_size_from_env"]


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


def rank_layout(world: int, virtual_graphs: int, replication_factor: Optional[int], rank: int) -> RankLayout:
    """The layout of `world` processes as replicas × `virtual_graphs`, seen from `rank`.

    `replication_factor` None means "every process the pipeline does not use": the world
    divided by `virtual_graphs`. A world that does not split so is a ValueError naming
    the process counts that would fit.
    """
    v = virtual_graphs
    if replication_factor is None:
        if world % v:
            fits = sorted({v * max(1, world // v), v * (world // v + 1)})
            raise ValueError(
                f"{world} processes do not split into replicas of {v} pipeline processes (one per virtual graph "
                f"of model.layers_per_stage): launch a multiple of {v}, e.g. "
                + " or ".join(f"`torchrun --nproc-per-node {n}` ({n // v} replica{'s' * (n // v > 1)})"
                              for n in fits))
        replication_factor = world // v
    if replication_factor < 1:
        raise ValueError(f"parallel.replication_factor {replication_factor} must be at least 1")
    if replication_factor * v != world:
        pipeline = f" × {v} pipeline processes" if v > 1 else ""
        hint = (f"; or leave parallel.replication_factor unset to use every process ({world // v} replicas)"
                if world % v == 0 else "")
        raise ValueError(
            f"parallel.replication_factor {replication_factor}{pipeline} needs {replication_factor * v} "
            f"processes, but {world} were launched: launch with `torchrun --nproc-per-node "
            f"{replication_factor * v} bert.py ...`{hint}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the {world} processes the launcher started (RANK, WORLD_SIZE)")
    return RankLayout(rank, replication_factor, v)


def process_device(device: str, env: Mapping[str, str] = os.environ) -> str:
    """The device this process of a launched run uses.

    "cuda" (no index) is the GPU of this process's local rank (LOCAL_RANK from torchrun,
    SLURM_LOCALID from srun) among those it sees; a process that sees one GPU
    (CUDA_VISIBLE_DEVICES of one entry: `srun --gpus-per-task 1`, a pod of one GPU) takes
    it, whatever its local rank. "cuda:<index>" names one GPU, which every process of a
    node would share: refused when several processes run on this node (LOCAL_WORLD_SIZE,
    SLURM_NTASKS_PER_NODE) and see the same GPUs, with the fix.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda" or world_size_from_env(env) == 1:
        return device
    visible = _visible_gpus(env)
    if not index:
        if visible == 1:
            return "cuda:0"
        local_rank = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
        if visible is not None and local_rank >= visible:
            raise ValueError(
                f"this process is local rank {local_rank} but sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                f"{env['CUDA_VISIBLE_DEVICES']}): start one process per visible GPU on each node "
                f"(`torchrun --nproc-per-node {visible}`), or give each task its own GPU (`srun --gpus-per-task 1`)")
        return f"cuda:{local_rank}"
    local = _processes_on_node(env)
    if local is not None and local > 1 and visible != 1:
        raise ValueError(
            f"training.device {device!r} puts all {local} processes of this node on one GPU: give 'cuda' "
            "(each process takes the GPU of its local rank), or start one process per node "
            "(`torchrun --nproc-per-node 1`) to pick a GPU by index")
    return device


def _visible_gpus(env: Mapping[str, str]) -> Optional[int]:
    """How many GPUs CUDA_VISIBLE_DEVICES lets this process see (None: not set, all of them)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return len([d for d in visible.split(",") if d.strip()])


def _processes_on_node(env: Mapping[str, str]) -> Optional[int]:
    """Processes of the job on this node, where a launcher says (None: unknown; never the
    world size, which spans every node)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        if value.isdigit():
            return int(value)
    return None
