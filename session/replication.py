"""Data-parallel replicas: gradient reduction while backward runs, and replicated tensor sharding.

Replication (PopART's replicatedGraphCount): every replica runs the whole graph (or
its stages of it) on its own micro-batches; gradients are summed over the replicas
and the optimizer step divides by the replica count (folded into the loss scale it
already divides by), which gives PopART's Mean reduction over micro-batches and
replicas. `GradientReducer` starts the communication of each bucket of the flat
gradient buffer as soon as backward has produced all of its gradients, in a fixed
order, while backward goes on with earlier layers (DDP's bucketing).

Replicated tensor sharding (PopART's `replicatedTensorSharding` of the optimizer
state and the accumulators; ZeRO stage 2): `ShardedLamb` holds, per replica, only its
shard of the gradients and of the moments, 1/R of each. Every micro-batch's gradients
are reduce-scattered bucket by bucket into the gradient shard (a parameter's `.grad`
is released once copied into its buckets); the fused LAMB step runs on the shard, its
per-tensor partial squared norms all-reduced through `Lamb.reduce_norms`; the updated
parameter shards are all-gathered so that every replica holds the whole weights again.

    flat buffer    | bucket 0            | bucket 1            | ...   (each padded to a multiple of R)
    replica r      |  chunk r of each bucket, back to back     = its shard: gradients, m, v
    backward       → bucket b's gradients complete → reduce-scatter(b) → shard[b-chunk] += sum over replicas
    step           stage 1 on the shard → all-reduce per-tensor norms → stage 2 on the shard
                   → all-gather each bucket's chunks → the whole parameters on every replica
"""
from __future__ import annotations

import bisect
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from custom_ops.lamb import shard_segments
from session.optimizers import Lamb

__all__ = ["GradientReducer", "ShardedLamb"]

# reduce_scatter_tensor / all_gather_into_tensor were renamed in torch 2.13.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedLamb(Lamb):
    """LAMB (or AdamW) with gradients and moments sharded over the processes of `group`.

    Takes Lamb's arguments plus `group`, the replicas' process group. Parameters stay
    whole on every replica (the forward pass needs them); `.grad` is left to autograd
    and emptied by the `GradientReducer`, which reduce-scatters into `grad_shard`.
    """

    sharded = True

    def __init__(self, named_parameters, *args: Any, group: Any, **kwargs: Any) -> None:
        self.group = group
        self.replica_count = dist.get_world_size(group)
        self.replica_index = dist.get_rank(group)
        super().__init__(named_parameters, *args, **kwargs)

    def _replicas(self) -> int:
        return self.replica_count

    def _allocate_state(self, params: list[torch.nn.Parameter]) -> None:
        device, n = self.flat_params.device, self.layout.shard_numel
        self.chunks = self.layout.chunks(self.replica_index)
        # Where each bucket's chunk starts in the shard.
        self.chunk_starts = [0]
        for a, b in self.chunks:
            self.chunk_starts.append(self.chunk_starts[-1] + b - a)
        self.shard_segments = functools.reduce(
            torch.add, (shard_segments(self.segments, a, b) for a, b in self.chunks))
        self.param_shard = torch.empty(n, dtype=self.flat_params.dtype, device=device)
        self.grad_shard = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        for p in params:
            p.grad = None

    def _shard_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in self.chunks]

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The shard of the current weights: they may have been loaded since the last step.
        torch.cat(self._shard_of(self.flat_params), out=self.param_shard)
        return self.param_shard, self.grad_shard, self.shard_segments

    def reduce_norms(self, norms: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(norms, group=self.group)
        return norms

    def _after_update(self) -> None:
        works = [
            _all_gather(self.flat_params[a:b], self.param_shard[s : s + (b - a) // self.replica_count],
                        group=self.group, async_op=True)
            for (a, b), s in zip(self.layout.buckets, self.chunk_starts)
        ]
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad_shard.zero_()

    def held_pieces(self) -> list[tuple[int, int, int, int]]:
        """The parts of each tensor's moments in this shard: (tensor, first, end, shard offset)."""
        layout, pieces = self.layout, []
        for (a, b), shard_start in zip(self.chunks, self.chunk_starts):
            first = max(0, bisect.bisect_right(layout.starts, a) - 1)
            for i in range(first, len(layout.starts)):
                start, numel = layout.starts[i], layout.numels[i]
                if start >= b:
                    break
                lo, hi = max(a, start), min(b, start + numel)
                if lo < hi:
                    pieces.append((i, lo - start, hi - start, shard_start + lo - a))
        return pieces

    # ------------------------------------------------------------- state
    def _full_moments(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Collective: the whole moments on the group's first process, (None, None) elsewhere."""
        root = dist.get_global_rank(self.group, 0)
        out = []
        for shard in (self.exp_avg, self.exp_avg_sq):
            full = torch.zeros(self.layout.total, device=shard.device) if self.replica_index == 0 else None
            for (a, b), s in zip(self.layout.buckets, self.chunk_starts):
                size = (b - a) // self.replica_count
                pieces = list(full[a:b].chunk(self.replica_count)) if full is not None else None
                dist.gather(shard[s : s + size], pieces, dst=root, group=self.group)
            out.append(self.layout.unpad(full) if full is not None else None)
        return out[0], out[1]

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Collective over the replicas: the whole state on the first, None on the others."""
        state = super().state_dict()
        return state if state["state"]["exp_avg"] is not None else None

    def _load_moments(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        for buf, saved in ((self.exp_avg, exp_avg), (self.exp_avg_sq, exp_avg_sq)):
            torch.cat(self._shard_of(self.layout.pad(saved.to(buf.device))), out=buf)


class GradientReducer:
    """Sums gradients over the replicas bucket by bucket, while backward runs.

    The session tells it which micro-batch's backward is running (`backward_of`) and
    when all of a micro-batch's backward passes in this process are done
    (`end_microbatch`); `finish` waits for the last communication. Each parameter's
    post-accumulate-grad hook counts the gradients it received in each micro-batch
    (`uses`: 1, or the number of this process's pipeline stages that use it, as the tied
    word embedding). Buckets start in one fixed order (the reverse of the layout's, as
    backward runs) on every replica, so the collectives always match, as NCCL needs.

    Whole gradients (no sharding): `.grad` is a view of the optimizer's flat gradient
    buffer, which autograd accumulates into; each bucket of it is all-reduced once,
    during the last micro-batch, as soon as all of its parameters received their
    gradients (or the micro-batch ends: a parameter no gradient reached).

    Sharded: a parameter's `.grad` is taken as soon as autograd completed it for the
    micro-batch: its part of each bucket is copied into that bucket's staging buffer
    (a bucket lying wholly inside one tensor, as the cuts of the word embedding do, is
    reduce-scattered straight from a view of `.grad`, with no copy), and `.grad` is
    released. A bucket whose parts are all in is reduce-scattered, into the gradient
    shard itself for the first micro-batch and added to it after. At most `in_flight`
    reductions run at once, and before a gradient is taken the oldest ones are waited
    for until it and the buffers still in flight fit in `in_flight` buckets' worth. A
    gradient larger than that (the word embedding's) meets no reduction in flight:
    when the next bucket to reduce holds part of one, the reductions in flight are
    finished first, before autograd produces it.
    A replica so holds its shard, the gradient autograd just produced, and the buckets
    being filled or reduced: never a whole gradient buffer (bench/scaling.py measures it).
    """

    def __init__(self, optimizer: Lamb, group: Any, microbatches: int, uses: Optional[list[int]] = None,
                 in_flight: int = 2) -> None:
        self.optimizer = optimizer
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.microbatches = microbatches
        self.in_flight = in_flight
        self.sharded = optimizer.sharded
        self.params: list[torch.nn.Parameter] = list(optimizer.param_groups[0]["params"])
        self.uses = uses or [1] * len(self.params)
        layout = optimizer.layout
        # Each parameter's part of each bucket it spans: (bucket, start, end) in flat coordinates.
        self._parts: list[list[tuple[int, int, int]]] = []
        self._bucket_params: list[list[int]] = [[] for _ in layout.buckets]
        bucket_starts = [a for a, _ in layout.buckets]
        for i, (start, numel) in enumerate(zip(layout.starts, layout.numels)):
            first = bisect.bisect_right(bucket_starts, start) - 1
            last = bisect.bisect_right(bucket_starts, start + max(numel, 1) - 1) - 1
            parts = []
            for b in range(first, last + 1):
                a, e = layout.buckets[b]
                parts.append((b, max(start, a), min(start + numel, e)))
                self._bucket_params[b].append(i)
            self._parts.append(parts)
        self._order = list(reversed(range(len(layout.buckets))))
        largest = max((e - a for a, e in layout.buckets), default=0)
        # Bytes in flight (staging and reduced chunks) a gradient may be taken beside.
        self._budget = in_flight * 4 * (largest + largest // self.replicas)
        big = {i for i, n in enumerate(layout.numels) if 4 * n > self._budget}
        self._holds_big = [any(i in big for i in params) for params in self._bucket_params]
        self._current = 0
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
        self.begin_step()

    # ------------------------------------------------------------ the step
    def begin_step(self) -> None:
        m_last = self.microbatches - 1
        micro = range(self.microbatches) if self.sharded else [m_last]
        self._units = [(m, b) for m in micro for b in self._order]
        self._next = 0
        self._forced_up_to = -1
        self._counts = [[0] * len(self.params) for _ in range(self.microbatches)]
        self._taken = [[0] * len(self.optimizer.layout.buckets) for _ in range(self.microbatches)]
        # Sharded: each open bucket's input, a staging buffer or a view of one tensor's .grad.
        self.filling: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: list[tuple[Any, int, int, Optional[torch.Tensor], Optional[torch.Tensor]]] = []

    def backward_of(self, microbatch: int) -> None:
        """The backward pass about to run belongs to this micro-batch."""
        self._current = microbatch

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        m = self._current
        self._counts[m][index] += 1
        if self.sharded and self._counts[m][index] == self.uses[index]:
            self._take(index, m)
        self._launch_ready()

    def _take(self, index: int, microbatch: int) -> None:
        """Move this micro-batch's gradient of parameter `index` into its buckets; release `.grad`."""
        p = self.params[index]
        grad = p.grad.reshape(-1)
        while self.pending and self._in_flight_bytes() + grad.nbytes > self._budget:
            self._wait_oldest()
        start = self.optimizer.layout.starts[index]
        for b, lo, hi in self._parts[index]:
            a, e = self.optimizer.layout.buckets[b]
            if (lo, hi) == (a, e) and len(self._bucket_params[b]) == 1:
                self.filling[(microbatch, b)] = grad[lo - start : hi - start]  # the bucket is this view
            else:
                self._staging(microbatch, b)[lo - a : hi - a].copy_(grad[lo - start : hi - start])
            self._taken[microbatch][b] += 1
        p.grad = None

    def _staging(self, microbatch: int, bucket: int) -> torch.Tensor:
        if (microbatch, bucket) not in self.filling:
            a, e = self.optimizer.layout.buckets[bucket]
            self.filling[(microbatch, bucket)] = torch.zeros(e - a, dtype=torch.float32,
                                                             device=self.optimizer.flat_params.device)
        return self.filling[(microbatch, bucket)]

    def end_microbatch(self, microbatch: int) -> None:
        """Every backward pass of `microbatch` in this process has run."""
        self._forced_up_to = microbatch
        self._launch_ready()
        if self.sharded:
            self._wait(up_to=microbatch)

    def finish(self) -> None:
        """Wait for every reduction of the step; the gradients are then summed over replicas."""
        self._forced_up_to = self.microbatches - 1
        self._launch_ready()
        self._wait(up_to=self.microbatches - 1)
        assert self._next == len(self._units), "every bucket was reduced"
        assert not self.filling, "every staged bucket was reduced"
        self.begin_step()

    def _ready(self, unit: tuple[int, int]) -> bool:
        m, b = unit
        if m <= self._forced_up_to:
            return True
        if self.sharded:
            return self._taken[m][b] == len(self._bucket_params[b])
        counts = self._counts[m]
        return all(counts[i] >= self.uses[i] for i in self._bucket_params[b])

    def _launch_ready(self) -> None:
        while self._next < len(self._units) and self._ready(self._units[self._next]):
            self._launch(*self._units[self._next])
            self._next += 1
            if self.sharded and self._next < len(self._units) and self._holds_big[self._units[self._next][1]]:
                self._wait(up_to=self.microbatches)  # a large gradient comes next: nothing in flight beside it

    def _launch(self, microbatch: int, bucket: int) -> None:
        a, e = self.optimizer.layout.buckets[bucket]
        if not self.sharded:
            work = dist.all_reduce(self.optimizer.flat_grads[a:e], group=self.group, async_op=True)
            self.pending.append((work, microbatch, bucket, None, None))
            return
        while len(self.pending) >= self.in_flight:  # bound the memory in flight
            self._wait_oldest()
        for i in self._bucket_params[bucket]:  # parameters no gradient reached: their part stays zero
            if self._counts[microbatch][i] < self.uses[i] and self.params[i].grad is not None:
                self._take(i, microbatch)
        staged = self.filling.pop((microbatch, bucket), None)
        if staged is None:
            staged = torch.zeros(e - a, dtype=torch.float32, device=self.optimizer.flat_params.device)
        s = self.optimizer.chunk_starts[bucket]
        size = (e - a) // self.replicas
        # The first micro-batch's sum goes straight into the (zeroed) shard; later ones are added.
        out = (self.optimizer.grad_shard[s : s + size] if microbatch == 0 else
               torch.empty(size, dtype=torch.float32, device=staged.device))
        work = _reduce_scatter(out, staged.contiguous(), group=self.group, async_op=True)
        self.pending.append((work, microbatch, bucket, out, staged))

    def _in_flight_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for *_, out, staged in self.pending for t in (out, staged)
                   if t is not None)

    def _wait(self, up_to: int) -> None:
        while self.pending and self.pending[0][1] <= up_to:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, microbatch, bucket, out, _ = self.pending.pop(0)
        work.wait()
        if out is not None and microbatch > 0:
            s = self.optimizer.chunk_starts[bucket]
            self.optimizer.grad_shard[s : s + out.numel()].add_(out)

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this process keeps between steps: the whole flat
        buffer, or the shard (bench/scaling.py measures what is alive during backward)."""
        if self.sharded:
            return self.optimizer.grad_shard.nbytes
        return self.optimizer.flat_grads.nbytes
