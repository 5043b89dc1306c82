"""Data-parallel replicas: gradient reduction while backward runs, and replicated tensor sharding.

Replication (PopART's replicatedGraphCount): every replica runs the whole graph (or
its stages of it) on its own micro-batches; gradients are summed over the replicas
and the optimizer step divides by the replica count (folded into the loss scale it
already divides by), which gives PopART's Mean reduction over micro-batches and
replicas. `GradientReducer` starts the communication of each bucket of the flat
gradient buffer as soon as backward has produced all of its gradients, in a fixed
order, while backward goes on with earlier layers (DDP's bucketing).

Replicated tensor sharding (PopART's `replicatedTensorSharding` of the optimizer
state and the accumulators; ZeRO stage 2): `ShardedBuffers` holds, per replica, only its
shard of the gradients and of the optimizer state, 1/R of each, for whichever rule the
optimizer runs (it is the optimizer's holding, not a kind of optimizer: ZeRO's split of
partitioning from the update rule). Every micro-batch's gradients are reduce-scattered
bucket by bucket into the gradient shard (a parameter's `.grad` is released once copied
into its buckets; each use's gradient of a weight used twice, the tied word embedding,
as it is produced); the rule runs on the shard, any per-tensor partial squared norms
all-reduced through `ShardedBuffers.reduce_norms`; the updated parameter shards are
all-gathered so that every replica holds the whole weights again.

    flat buffer    | bucket 0            | bucket 1            | ...   (each padded to a multiple of R)
    replica r      |  chunk r of each bucket, back to back     = its shard: gradients and state (LAMB: m, v)
    backward       → bucket b's gradients complete → reduce-scatter(b) → shard[b-chunk] += sum over replicas
    step           the rule on the shard (LAMB: stage 1 → all-reduce per-tensor norms → stage 2)
                   → all-gather each bucket's chunks → the whole parameters on every replica
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from custom_ops.lamb import shard_segments
from session.flat import FlatOptimizer
from session.shadow import is_single_shadow

__all__ = ["GradientReducer", "ShardedBuffers", "gradient_edges"]

# reduce_scatter_tensor / all_gather_into_tensor were renamed in torch 2.13.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedBuffers:
    """A replica's shard of the gradients and of the optimizer state: the holding of replicated
    tensor sharding, for any flat-buffer optimizer (`Lamb(..., holding=ShardedBuffers(group))`).

    `group` is the replicas' process group. Parameters stay whole on every replica (the
    forward pass needs them); `.grad` is left to autograd and emptied by the
    `GradientReducer`, which reduce-scatters into `grad_shard`. The layout pads each bucket
    to a multiple of the replica count, so replica r holds chunk r of every bucket.
    """

    sharded = True

    def __init__(self, group: Any) -> None:
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.replica_index = dist.get_rank(group)

    def attach(self, optimizer: FlatOptimizer, params: Sequence[torch.nn.Parameter]) -> None:
        self.layout, self.flat_params = optimizer.layout, optimizer.flat_params
        device, n = self.flat_params.device, self.layout.shard_numel
        self.chunks = self.layout.chunks(self.replica_index)
        # Where each bucket's chunk starts in the shard.
        self.chunk_starts = [0]
        for a, b in self.chunks:
            self.chunk_starts.append(self.chunk_starts[-1] + b - a)
        self.segments = functools.reduce(torch.add, (shard_segments(optimizer.segments, a, b) for a, b in self.chunks))
        self.param_shard = torch.empty(n, dtype=self.flat_params.dtype, device=device)
        self.grad_shard = torch.zeros(n, dtype=torch.float32, device=device)
        for p in params:
            p.grad = None

    def new_state(self) -> torch.Tensor:
        return torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.flat_params.device)

    def _shard_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in self.chunks]

    def step_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The shard of the current weights: they may have been loaded since the last step.
        torch.cat(self._shard_of(self.flat_params), out=self.param_shard)
        return self.param_shard, self.grad_shard, self.segments

    def reduce_norms(self, norms: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(norms, group=self.group)
        return norms

    def after_update(self) -> None:
        """All-gather the updated parameter shards: every replica holds the whole weights again."""
        works = [
            _all_gather(self.flat_params[a:b], self.param_shard[s : s + (b - a) // self.replicas],
                        group=self.group, async_op=True)
            for (a, b), s in zip(self.layout.buckets, self.chunk_starts)
        ]
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        self.grad_shard.zero_()

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """The parts of each tensor's state in this shard: (tensor, first, end, shard offset)."""
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

    def gather(self, shard: torch.Tensor) -> Optional[torch.Tensor]:
        """Collective: a state buffer's whole values, unpadded, on the group's first process; None elsewhere."""
        root = dist.get_global_rank(self.group, 0)
        full = torch.zeros(self.layout.total, device=shard.device) if self.replica_index == 0 else None
        for (a, b), s in zip(self.layout.buckets, self.chunk_starts):
            size = (b - a) // self.replicas
            pieces = list(full[a:b].chunk(self.replicas)) if full is not None else None
            dist.gather(shard[s : s + size], pieces, dst=root, group=self.group)
        return self.layout.unpad(full) if full is not None else None

    def scatter(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        torch.cat(self._shard_of(self.layout.pad(values.to(shard.device))), out=shard)

    def gradient_bytes(self) -> int:
        return self.grad_shard.nbytes


@dataclass
class _Reduction:
    """A reduction in flight."""

    work: Any
    microbatch: int
    bucket: int
    add: Optional[torch.Tensor] = None  # added into the shard at `at` once complete (None: nothing, or it is there)
    at: int = 0
    keep: Optional[torch.Tensor] = None  # the input, alive until the reduction completes
    copy: bool = False  # reads the reducer's copy buffer
    release: bool = False  # the last to read it: the buffer is let go once complete


def gradient_edges(roots: Sequence[torch.Tensor], accumulators: dict[Any, int],
                   through_casts: bool = False) -> dict[int, list[tuple[Any, int]]]:
    """Where, in the autograd graph behind `roots`, each parameter receives a gradient.

    `accumulators` maps the AccumulateGrad node of each parameter to its index. Returns,
    for each parameter reached, the (node, output index) of every use, the last to run
    in backward (the first made in forward) last: a weight used twice in one graph (the
    tied word embedding: lookup and MLM projection) has two, and autograd would add them
    up before handing one gradient to AccumulateGrad. `through_casts`: a use through a
    cast of the parameter (autocast's bf16 copy of a weight) is the node that hands the
    cast its gradient, in the cast's dtype, rather than the cast, which makes a float32
    copy of the whole of it.
    """
    found: dict[int, list[tuple[Any, int]]] = {}
    seen: set[Any] = set()
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for k, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            index = accumulators.get(child)
            if index is None and through_casts and _is_cast(child):
                index = accumulators.get(child.next_functions[0][0])
            if index is not None:
                found.setdefault(index, []).append((node, k))
            elif child not in seen:
                stack.append(child)
    for uses in found.values():  # autograd runs later-made nodes first
        uses.sort(key=lambda use: use[0]._sequence_nr(), reverse=True)
    return found


def _is_cast(node: Any) -> bool:
    """Whether an autograd node only casts its input to another dtype (autocast's copy of a
    weight for a bf16 matmul, or the copy weight_cast=shadow keeps, session/shadow.py): then
    the gradient it receives is its input's, in that dtype."""
    return node.name() == "ToCopyBackward0" or is_single_shadow(node)


def _flat_range(grad: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `grad` in row-major order: a view when contiguous, else a copy of
    only the rows they lie in (never of the whole tensor)."""
    if grad.is_contiguous():
        return grad.view(-1)[lo:hi]
    rows = grad.reshape(grad.shape[0], -1) if grad.dim() > 1 else grad.reshape(-1, 1)
    width = rows.shape[1]
    first, end = lo // width, -(-hi // width)
    return rows[first:end].reshape(-1)[lo - first * width : hi - first * width]


class GradientReducer:
    """Sums gradients over the replicas bucket by bucket, while backward runs.

    The session tells it which micro-batch's backward is running and from which tensors
    (`backward_of`), and when all of a micro-batch's backward passes in this process are
    done (`end_microbatch`); `finish` waits for the last communication. Each parameter's
    post-accumulate-grad hook counts the gradients it received in each micro-batch
    (`uses`: 1, or the number of this process's pipeline stages that use it). Buckets
    start in one fixed order (the reverse of the layout's, as backward runs) on every
    replica, so the collectives always match, as NCCL needs.

    Whole gradients (no sharding): `.grad` is a view of the optimizer's flat gradient
    buffer, which autograd accumulates into; each bucket of it is all-reduced once,
    during the last micro-batch, as soon as all of its parameters received their
    gradients (or the micro-batch ends: a parameter no gradient reached).

    Sharded: a parameter's `.grad` is taken as soon as autograd completed it for the
    micro-batch: its part of each bucket is copied into that bucket's staging buffer
    (a bucket lying wholly inside one tensor, as the cuts of the word embedding do, is
    reduced straight from a view of `.grad`), and `.grad` is released. A bucket whose
    parts are all in is reduced into the gradient shard. At most `in_flight`
    reductions run at once, and a gradient is taken, or a reduction that needs memory
    of its own started, only when it fits beside the buffers in flight in `in_flight`
    buckets' worth. A gradient larger than that (the word embedding's) meets no
    reduction in flight: when the next bucket to reduce holds part of one, the
    reductions in flight are finished first, before autograd produces it.

    A weight used twice in one backward pass (the tied word embedding: the MLM
    projection's use runs first in backward, the lookup's last) would have autograd
    hold the first use's gradient, outside any `.grad`, until the last use adds to it:
    a whole embedding-sized gradient beside everything else for the whole backward.
    So `backward_of` finds the uses in the graph (`gradient_edges`) and takes every
    use's gradient but the last as the node producing it hands it over (a node hook,
    which passes autograd nothing for that input): whole gradients add it into `.grad`
    at once; sharded ones reduce it into the shard at once, as a part of its own with
    its own place in the fixed order (the first units of the micro-batch). Sharded,
    this costs one more reduction of that weight per micro-batch; whole, nothing. A use
    through autocast's cast of the weight (bf16, fp16: the projection's) is taken from
    the node that hands the cast its gradient, in the cast's dtype, and cast a piece at
    a time as it is copied for its reduction: the float32 copy of the whole gradient,
    which the cast would make, never exists.

    Reductions: `reduce_scatter` into the shard, except on gloo, whose reduce-scatter is
    an all-reduce of a copy of its input (a bucket-sized copy per reduction in flight):
    there a buffer the reducer owns (a staging buffer, or `.grad` once taken) is all-
    reduced in place and this replica's chunk added into the shard, and a gradient it
    does not own (what a node hands over may be shared) is copied, a quarter of a bucket
    at a time, into one buffer that is all-reduced (`in_place`: which of the two).
    A replica so holds its shard, the gradient autograd just produced, and the buckets
    being filled or reduced: never a whole gradient buffer (bench/scaling.py counts
    every storage a gradient lives in, autograd's included; tests check that count
    against the allocator).
    """

    def __init__(self, optimizer: FlatOptimizer, group: Any, microbatches: int, uses: Optional[list[int]] = None,
                 in_flight: int = 2) -> None:
        self.optimizer = optimizer
        self.holding = optimizer.holding
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.microbatches = microbatches
        self.in_flight = in_flight
        self.sharded = optimizer.sharded
        # Sharded, reduce by all-reducing the reducer's own buffers in place (gloo, whose reduce-scatter
        # copies its input) or by reduce-scatter (NCCL); either works on any backend.
        self.in_place = self.sharded and dist.get_backend(group) == "gloo"
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
        # Whose uses are taken one by one: any weight's with whole gradients; sharded, a large
        # weight's (its buckets are its own, so a use's gradient is reduced without staging).
        self._early_ok = {i for i in range(len(self.params))
                          if not self.sharded or (i in big and all(len(self._bucket_params[b]) == 1
                                                                   for b, _, _ in self._parts[i]))}
        # Each parameter's AccumulateGrad node, held (as DDP holds them) so that every graph
        # hands this parameter its gradients through this one node.
        with torch.enable_grad():
            self._accumulators = {p.view_as(p).grad_fn.next_functions[0][0]: i
                                  for i, p in enumerate(self.params) if p.requires_grad}
        self.early_uses = True  # False: autograd adds a weight's uses up itself (bench/scaling.py compares)
        # gloo: uses taken early are copied a piece of a quarter bucket at a time, into one buffer.
        self._piece = max(1, largest // 4)
        self._copy: Optional[torch.Tensor] = None
        self._current = 0
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
        self.begin_step()

    # ------------------------------------------------------------ the step
    def begin_step(self) -> None:
        m_last = self.microbatches - 1
        micro = range(self.microbatches) if self.sharded else [m_last]
        # (micro-batch, bucket, part): part 0 is what `.grad` holds, part p > 0 a use taken early.
        self._units: list[tuple[int, int, int]] = [(m, b, 0) for m in micro for b in self._order]
        self._next = 0
        self._forced_up_to = -1
        self._counts = [[0] * len(self.params) for _ in range(self.microbatches)]
        self._taken = [[0] * len(self.optimizer.layout.buckets) for _ in range(self.microbatches)]
        self._seen_backward: set[int] = set()  # micro-batches whose first backward pass began
        # Sharded: each open bucket's input, a staging buffer or a view of one tensor's .grad;
        # the gradients of uses taken early, (micro-batch, part) -> (parameter, gradient).
        self.filling: dict[tuple[int, int], torch.Tensor] = {}
        self.early: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self.pending: list[_Reduction] = []
        self._written: set[int] = set()  # buckets whose shard chunk a reduce-scatter has written this step

    def forward_of(self, microbatch: int, stage: int) -> None:
        """Whole weights on every replica: nothing to gather before a forward."""

    def forward_done(self, microbatch: int, stage: int) -> None:
        pass

    def backward_of(self, microbatch: int, roots: Sequence[torch.Tensor]) -> None:
        """The backward pass about to run, from `roots`, belongs to this micro-batch."""
        self._current = microbatch
        if microbatch in self._seen_backward:
            return  # a later pass of the micro-batch (pipeline stages): its units may have started
        self._seen_backward.add(microbatch)
        if not self.early_uses:
            return
        early = [(node, k, i) for i, uses in gradient_edges(roots, self._accumulators, through_casts=True).items()
                 if i in self._early_ok for node, k in uses[:-1]]
        early.sort(key=lambda use: use[0]._sequence_nr(), reverse=True)
        units = []
        for part, (node, k, i) in enumerate(early, start=1):
            node.register_hook(functools.partial(self._on_early, i, microbatch, part, k))
            units += [(microbatch, b, part) for b, _, _ in reversed(self._parts[i])]
        if self.sharded and units:
            # In the fixed order, before the micro-batch's other units (none has started).
            at = next(n for n, unit in enumerate(self._units) if unit[0] == microbatch)
            assert at >= self._next, "no unit of this micro-batch has started"
            self._units[at:at] = units

    def _on_early(self, index: int, microbatch: int, part: int, k: int, grad_inputs: tuple, _outputs: tuple):
        """Node hook: the gradient of one use of parameter `index`, taken as it is produced."""
        grad = grad_inputs[k]
        if grad is None:
            return None
        if self.sharded:
            while self.pending and self._in_flight_bytes() + grad.nbytes > self._budget:
                self._wait_oldest()
            self.early[(microbatch, part)] = (index, grad)
            self._launch_ready()
        else:
            self.params[index].grad.add_(grad)  # .grad is a view of the flat buffer (float32)
        return grad_inputs[:k] + (None,) + grad_inputs[k + 1 :]

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        m = self._current
        self._counts[m][index] += 1
        if self.sharded and self._counts[m][index] == self.uses[index]:
            self._take(index, m)
        self._launch_ready()

    def _take(self, index: int, microbatch: int) -> None:
        """Move this micro-batch's gradient of parameter `index` into its buckets; release `.grad`."""
        p = self.params[index]
        for b, _, _ in self._parts[index]:
            self._taken[microbatch][b] += 1
        if p.grad is None:  # every use's gradient was taken early, or none reached it
            return
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
        assert not self.filling and not self.early, "every staged bucket was reduced"
        self.begin_step()

    def _ready(self, unit: tuple[int, int, int]) -> bool:
        m, b, part = unit
        if m <= self._forced_up_to:
            return True
        if part:
            return (m, part) in self.early
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

    def _launch(self, microbatch: int, bucket: int, part: int) -> None:
        a, e = self.optimizer.layout.buckets[bucket]
        if not self.sharded:
            work = dist.all_reduce(self.holding.flat_grads[a:e], group=self.group, async_op=True)
            self.pending.append(_Reduction(work, microbatch, bucket))
            return
        if part and self.in_place:
            self._all_reduce_early(microbatch, bucket, part)
            return
        if part:
            source = self._early_input(microbatch, bucket, part)
        else:
            for i in self._bucket_params[bucket]:  # parameters no gradient reached: their part stays zero
                if self._counts[microbatch][i] < self.uses[i] and self.params[i].grad is not None:
                    self._take(i, microbatch)
            source = self.filling.pop((microbatch, bucket), None)
        if source is None:
            source = torch.zeros(e - a, dtype=torch.float32, device=self.optimizer.flat_params.device)
        s = self.holding.chunk_starts[bucket]
        size = (e - a) // self.replicas
        if self.in_place:  # a staging buffer or a view of a taken .grad: the reducer's own memory
            self._make_room()
            work = dist.all_reduce(source, group=self.group, async_op=True)
            r = self.holding.replica_index
            self.pending.append(_Reduction(work, microbatch, bucket, source[r * size : (r + 1) * size], s))
            return
        # The first sum of a bucket in the step goes straight into its (zeroed) shard chunk; later ones are added.
        first = bucket not in self._written
        self._written.add(bucket)
        self._make_room(0 if first else 4 * size)
        out = (self.holding.grad_shard[s : s + size] if first else
               torch.empty(size, dtype=torch.float32, device=source.device))
        work = _reduce_scatter(out, source.contiguous(), group=self.group, async_op=True)
        self.pending.append(_Reduction(work, microbatch, bucket, None if first else out, s, keep=source))

    def _early_range(self, microbatch: int, bucket: int, part: int) -> tuple[torch.Tensor, int, int]:
        """A use taken early, and where in it the bucket lies: (gradient, first, end), flat; the
        reducer lets go of the gradient when this is its last bucket in the order."""
        index, grad = self.early[(microbatch, part)]
        start = self.optimizer.layout.starts[index]
        a, e = self.optimizer.layout.buckets[bucket]
        if bucket == self._parts[index][0][0]:
            del self.early[(microbatch, part)]
        return grad, max(a, start) - start, min(e, start + self.optimizer.layout.numels[index]) - start

    def _early_input(self, microbatch: int, bucket: int, part: int) -> torch.Tensor:
        """The bucket's input, read (not written) by a reduce-scatter, from a use taken early."""
        grad, lo, hi = self._early_range(microbatch, bucket, part)
        piece = _flat_range(grad, lo, hi)
        a, e = self.optimizer.layout.buckets[bucket]
        if hi - lo == e - a and piece.dtype == torch.float32:
            return piece
        # The tensor's last bucket, padded, or a bucket of a use taken in another dtype, cast.
        staged = torch.zeros(e - a, dtype=torch.float32, device=piece.device)
        staged[: hi - lo].copy_(piece)
        return staged

    def _all_reduce_early(self, microbatch: int, bucket: int, part: int) -> None:
        """gloo: all-reduce a bucket of a use taken early through the reducer's copy buffer, a
        piece at a time (what a node hands over may be shared, so it is never written), and
        add this replica's chunk of each piece into the shard. A bucket's padding sums to
        zero and is skipped."""
        grad, lo, hi = self._early_range(microbatch, bucket, part)
        last = not self.early  # the last bucket of the last use taken early: the buffer goes after it
        a, e = self.optimizer.layout.buckets[bucket]
        size = (e - a) // self.replicas
        mine = self.holding.replica_index * size  # this replica's chunk of the bucket starts here
        s = self.holding.chunk_starts[bucket]
        for p0 in range(0, hi - lo, self._piece):
            p1 = min(p0 + self._piece, hi - lo)
            while any(r.copy for r in self.pending):  # one reduction reads the copy buffer at a time
                self._wait_oldest()
            self._make_room()
            if self._copy is None:
                self._copy = torch.empty(self._piece, dtype=torch.float32, device=grad.device)
            buffer = self._copy[: p1 - p0]
            buffer.copy_(_flat_range(grad, lo + p0, lo + p1))
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            first, end = max(p0, mine), min(p1, mine + size)
            add = buffer[first - p0 : end - p0] if first < end else None
            self.pending.append(_Reduction(work, microbatch, bucket, add, s + first - mine, copy=True,
                                           release=last and p1 == hi - lo))

    def _make_room(self, new_bytes: int = 0) -> None:
        """Wait for the oldest reductions until one more fits: at most `in_flight`, and what
        it allocates (`new_bytes`) within the budget beside those in flight."""
        while self.pending and (len(self.pending) >= self.in_flight
                                or (new_bytes and self._in_flight_bytes() + new_bytes > self._budget)):
            self._wait_oldest()

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer of this reducer a gradient lives in now: buckets being filled, uses
        taken early, reductions in flight and (sharded) the shard."""
        held = list(self.filling.values()) + [grad for _, grad in self.early.values()]
        held += [t for r in self.pending for t in (r.add, r.keep) if t is not None]
        held += [self._copy] if self._copy is not None else []
        return held + ([self.holding.grad_shard] if self.sharded else [self.holding.flat_grads])

    def _in_flight_bytes(self) -> int:
        """Bytes of the storages of the reductions in flight and the uses taken early."""
        tensors = [t for r in self.pending for t in (r.add, r.keep) if t is not None]
        tensors += [grad for _, grad in self.early.values()]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def _wait(self, up_to: int) -> None:
        while self.pending and self.pending[0].microbatch <= up_to:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        reduction = self.pending.pop(0)
        reduction.work.wait()
        if reduction.add is not None:
            self.holding.grad_shard[reduction.at : reduction.at + reduction.add.numel()].add_(reduction.add)
        if reduction.release:
            self._copy = None  # the last piece of the uses taken early is in

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this process keeps between steps: the whole flat
        buffer, or the shard (bench/scaling.py measures what is alive during backward)."""
        return self.holding.gradient_bytes()
