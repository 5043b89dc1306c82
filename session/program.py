"""The lowered program's steps (session/lowering.py): one per node or fused op, each reading and
writing slots of an environment list, and what is worked out from their order once, when a
graph is lowered: the values each step reads for the last time (dropped there) and the runs
of steps recomputed in backward."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["Step", "recompute_runs", "with_releases"]

OpFn = Callable[..., Any]


@dataclass(frozen=True)
class Step:
    fn: OpFn
    inputs: tuple[int, ...]  # environment slots (-1: absent optional input)
    outputs: tuple[int, ...]
    recompute: bool
    name: str
    release: tuple[int, ...] = ()  # slots no later step or output reads: dropped after this one


def with_releases(steps: Sequence[Step], output_slots: Sequence[int]) -> list[Step]:
    """The steps, each naming the intermediate values it reads or writes for the last time.

    Dropping them from the environment as the graph runs keeps only live values (and
    what autograd saved for backward) in memory, as eager code does; the graph's outputs
    are kept.
    """
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        for s in step.outputs:
            last.setdefault(s, k)  # an output nothing reads dies where it is made
        for s in step.inputs:
            last[s] = k
    produced = {s for step in steps for s in step.outputs}
    release: list[list[int]] = [[] for _ in steps]
    for s, k in last.items():
        if s in produced and s not in output_slots:
            release[k].append(s)
    return [dataclasses.replace(step, release=tuple(r)) for step, r in zip(steps, release)]


def recompute_runs(steps: Sequence[Step], output_slots: Sequence[int]) -> list[tuple[list[Step], Optional[list[int]], list[int]]]:
    """Split the nodes into maximal runs of equal recompute marking.

    A recomputed run gets the slots it reads from outside (kept for backward) and the
    slots it produces that later nodes or the outputs read; other runs get (steps, None, []).
    """
    runs: list[list[Step]] = []
    for step in steps:
        if runs and step.recompute == runs[-1][-1].recompute:
            runs[-1].append(step)
        else:
            runs.append([step])
    segments = []
    read_after: set[int] = set(output_slots)
    for run in reversed(runs):
        produced = {s for step in run for s in step.outputs}
        if run[0].recompute:
            needed = sorted({i for step in run for i in step.inputs if i >= 0 and i not in produced})
            keep = sorted(produced & read_after)
            segments.append((run, needed, keep))
        else:
            segments.append((run, None, []))
        read_after |= {i for step in run for i in step.inputs if i >= 0}
    return segments[::-1]
