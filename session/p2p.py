"""The pipeline's messages between processes (session/pipeline.py runs the stages).

Messages, written for NCCL's semantics (which gloo is stricter than in none of these
points): NCCL matches a send and a receive between two ranks by the order they are
issued, not by tag, and runs the operations of one pair of ranks one group after
another. So every message is sent in a *round*, the tick of the action that produced
it, and every rank derives the rounds from the same simulated schedule: in round t, a
rank issues, in one `batch_isend_irecv` group and in one canonical order (edge, then
direction), the sends of what its tick-t action produced and the receives of what the
other processes' tick-t actions produced for it. Both ends of every link therefore
issue the same operations in the same order, group by group, for any schedule; tags
are always 0. A receive is posted in its round, before the receiver needs it, and
waited for only when its action runs, so the schedule's overlap is kept. Message
shapes and types come from the graph (its value_info, with symbolic dimensions such
as "batch" sized from the step's inputs, which the process reading the data
broadcasts to its replica's other processes), so no header travels ahead of a tensor.
`strict=True` (GROUPBERT_STRICT_P2P=1) sends a small descriptor with every tensor that
the receiver checks against the message it expects: a debugging aid for any backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from session.pipeline import PipelinePlan, Schedule, TensorSpec

__all__ = ["Links", "Message", "Round", "round_messages", "round_operations"]

Key = tuple[int, bool, int]  # (edge, backward, micro-batch)


@dataclass(frozen=True, order=True)
class Message:
    """One tensor crossing processes: an activation on `edge` (producer → consumer stage)
    or, `backward`, its gradient (consumer → producer)."""

    edge: int
    backward: bool
    microbatch: int
    source_stage: int
    target_stage: int


def round_messages(plan: PipelinePlan, schedule: Schedule) -> list[list[Message]]:
    """The messages each tick's actions produce between processes, in the canonical order."""
    rounds: list[list[Message]] = [[] for _ in range(schedule.length)]
    vg = {s: info.virtual_graph for s, info in plan.stages.items()}
    for action, tick in schedule.ticks.items():
        info, m = plan.stages[action.stage], action.microbatch
        if action.forward:
            for name, consumers in info.sent.items():
                for c in consumers:
                    if vg[c] != vg[action.stage]:
                        rounds[tick].append(Message(plan.edges[(name, c)], False, m, action.stage, c))
        else:
            for name, source in info.received:
                if vg[source] != vg[action.stage] and plan.specs[name].requires_grad:
                    rounds[tick].append(Message(plan.edges[(name, action.stage)], True, m, action.stage, source))
    return [sorted(r) for r in rounds]


def round_operations(plan: PipelinePlan, schedule: Schedule, virtual_graph: int
                     ) -> list[list[tuple[str, Message]]]:
    """This virtual graph's ("send" | "recv", message) operations, round by round, in issue order."""
    vg = {s: info.virtual_graph for s, info in plan.stages.items()}
    out = []
    for messages in round_messages(plan, schedule):
        ops = []
        for msg in messages:
            if vg[msg.source_stage] == virtual_graph:
                ops.append(("send", msg))
            elif vg[msg.target_stage] == virtual_graph:
                ops.append(("recv", msg))
        out.append(ops)
    return out


_DESCRIPTOR = 4  # strict mode: edge, backward, micro-batch, element count


class Round:
    """One round's group of operations: waited for once (a gloo work waited twice hangs),
    its send buffers kept until it completed."""

    def __init__(self, kept: list[torch.Tensor]):
        self.works: list[Any] = []
        self.kept = kept
        self.done = False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done, self.kept = True, []

    def completed(self) -> bool:
        if not self.done and all(work.is_completed() for work in self.works):
            self.done, self.kept = True, []
        return self.done


class Links:
    """This process's ends of the pipeline's links: each round's operations issued as one
    group, and what arrived handed over (checked against its descriptor in strict mode)."""

    def __init__(self, specs: dict[str, TensorSpec], names: dict[int, str], rank_of_stage: dict[int, int],
                 device: torch.device, strict: bool, progress: Callable[..., None]):
        self.specs, self.names, self.rank_of_stage = specs, names, rank_of_stage
        self.device, self.strict, self.progress = device, strict, progress

    def arrived(self, key: Key, arriving: dict[Key, tuple[Round, torch.Tensor, Any]], stage: int) -> torch.Tensor:
        """The tensor of message `key` from `stage`, once its round completed."""
        group, buffer, descriptor = arriving.pop(key)
        what = "a gradient" if key[1] else "an activation"
        self.progress(f"waiting for {what} from rank {self.rank_of_stage[stage]}", waiting=True)
        group.wait()  # its whole round (NCCL coalesces a round into one work)
        if descriptor is not None:
            expected = [key[0], int(key[1]), key[2], buffer.numel()]
            if descriptor.tolist() != expected:
                raise RuntimeError(f"pipeline message mismatch from rank {self.rank_of_stage[stage]}: got "
                                   f"(edge, backward, micro-batch, numel) {descriptor.tolist()}, expected {expected}")
        return buffer

    def exchange(self, ops: list[tuple[str, Message]], sizes: dict[str, int], outgoing: dict[Key, torch.Tensor],
                 arriving: dict[Key, tuple[Round, torch.Tensor, Any]]) -> Round:
        """Issue this round's operations as one group, in the order every rank derives alike:
        sends take their tensors from `outgoing`, receives post buffers into `arriving`."""
        p2p, kept = [], []
        group = Round(kept)
        for kind, msg in ops:
            key = (msg.edge, msg.backward, msg.microbatch)
            if kind == "send":
                peer = self.rank_of_stage[msg.target_stage]
                tensor = outgoing.pop(key).contiguous()
                if self.strict:
                    descriptor = torch.tensor([msg.edge, int(msg.backward), msg.microbatch, tensor.numel()],
                                              device=self.device)
                    p2p.append(dist.P2POp(dist.isend, descriptor, peer, tag=0))
                    kept.append(descriptor)
                p2p.append(dist.P2POp(dist.isend, tensor, peer, tag=0))
                kept.append(tensor)
            else:
                peer = self.rank_of_stage[msg.source_stage]
                descriptor = None
                if self.strict:
                    descriptor = torch.empty(_DESCRIPTOR, dtype=torch.int64, device=self.device)
                    p2p.append(dist.P2POp(dist.irecv, descriptor, peer, tag=0))
                spec = self.specs[self.names[msg.edge]]
                buffer = torch.empty(spec.shape(sizes), dtype=spec.dtype, device=self.device)
                p2p.append(dist.P2POp(dist.irecv, buffer, peer, tag=0))
                arriving[key] = (group, buffer, descriptor)
        group.works = dist.batch_isend_irecv(p2p)
        return group
