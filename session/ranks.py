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

    "cuda" (no index) is the GPU of this process's LOCAL_RANK. "cuda:<index>" names one
    GPU, which every process of a node would share: refused when the launcher started
    more than one process on this node (LOCAL_WORLD_SIZE), with the fix.
    """
    kind, _, index = device.partition(":")
    if kind != "cuda" or world_size_from_env(env) == 1:
        return device
    if not index:
        return f"cuda:{int(env.get('LOCAL_RANK', '0'))}"
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if local > 1:
        raise ValueError(
            f"training.device {device!r} puts all {local} processes of this node on one GPU: give 'cuda' "
            "(each process takes the GPU of its LOCAL_RANK), or start one process per node "
            "(`torchrun --nproc-per-node 1`) to pick a GPU by index")
    return device
