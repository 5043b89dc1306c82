"""`batch.micro_batch_size: auto`: the largest micro batch that fits the device.

The run's global batch is `batch.global_batch_size`; auto chooses how each replica splits
its share of it (global / replicas samples per step) into micro batches: the largest
micro batch that divides the share and fits, the rest as gradient accumulation. The
learning-rate schedule, the data order and the samples per step are the run's whatever
the split; the split only decides how many passes a step takes.

It is chosen before a pre-training job is made (data, budget and session follow the batch),
and by a fine-tuning job once its files are read and its source and labels have sized its
model (`run_batch`), from a session of that model on this process's
device, with any weights, which trains two steps of zero-token batches and is then dropped:

- CUDA: the allocator's peak over a whole step (forward, backward, the optimizer's
  update) at micro batches 1 and 2.
  The probe holds the whole optimizer state, as a run without replicated tensor sharding
  does: with it, the state a replica holds is smaller, and the choice errs on the safe side.
- CPU: the host has no allocator peak to read. The weights, their gradients and the
  optimizer's state, plus what the forward pass saves for backward (each storage once,
  the weights' own left out) at micro batches 1 and 2: a lower bound of the peak.

The peak at micro batch m is fitted as fixed + m × per sample from those two. The limit
is `batch.auto_memory_gib`, else 90 % of the device's memory (of the host's on the CPU,
shared by the processes of a node). Every process computes the same split from the same
shapes and device model, so the replicas agree without talking (each measures alone, on its
own device, before the run's process group exists).

A resume from a checkpoint with the run's replica count and global batch takes that
checkpoint's split, measured nothing, so the run continues exactly as it would have.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from bert.config import Config
from bert.data import data_share
from bert.run.elastic import keep_global_batch, saved_batch
from bert.run.rundir import starting_checkpoint
from session.distributed import local_device
from session.training import TrainingSession

__all__ = ["DEVICE_SHARE", "MemoryFit", "device_memory", "fit_micro_batch", "fitted", "largest_fitting",
           "measure_memory", "run_batch"]

GIB = 2**30
DEVICE_SHARE = 0.9  # of the device's memory a step may take when batch.auto_memory_gib does not say


@dataclass(frozen=True)
class MemoryFit:
    """A step's peak memory as fixed + rows × per_row bytes, and how it was measured."""

    fixed: float
    per_row: float
    how: str

    def peak(self, rows: int) -> float:
        return self.fixed + rows * self.per_row


def run_batch(config: Config, checkpoint_input: Optional[str], make_session: Callable[[Config], TrainingSession]
              ) -> Config:
    """The batch a run of `config` from `checkpoint_input` trains with, each decision said once
    (rank 0): micro_batch_size auto chosen for this device, and under another number of
    replicas than its checkpoint's, the checkpoint's global batch kept (bert/run/elastic.py).
    Called before what follows the batch is made (the data, the budget, the session): a
    pre-training run at its start, a fine-tuning job once its model is sized (`config.model`
    is the run's whole model; `make_session` builds a session of it with any weights)."""
    checkpoint, replicas = starting_checkpoint(config, checkpoint_input), data_share(config)[1]
    config = _said(*fit_micro_batch(config, replicas, checkpoint, make_session))
    return _said(*keep_global_batch(config, checkpoint, replicas))


def fitted(config: Config, make_session: Callable[[Config], TrainingSession]) -> Config:
    """`config` with micro_batch_size auto chosen for this device, said once: `bert.py eval`'s
    batches, whose weights are scored, not trained on."""
    return _said(*fit_micro_batch(config, data_share(config)[1], None, make_session))


def _said(config: Config, line: str) -> Config:
    if line and int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)
    return config


def fit_micro_batch(config: Config, replicas: int, checkpoint: Optional[Path],
                    make_session: Callable[[Config], TrainingSession]) -> tuple[Config, str]:
    """`config` with micro_batch_size auto resolved to numbers (unchanged otherwise), and
    the line that says what was chosen and why; a ValueError naming what to change where
    the global batch does not split over the replicas or no micro batch fits."""
    b = config.batch
    if b.micro_batch_size != "auto":
        return config, ""
    total = b.global_batch_size
    if total % replicas:
        raise ValueError(f"batch.global_batch_size {total} does not split over {replicas} replicas: use a multiple "
                         f"of {replicas}")
    share = total // replicas
    saved = saved_batch(checkpoint) if checkpoint is not None else None
    if saved is not None and saved.replicas == replicas and saved.global_batch == total:
        line = (f"batch.micro_batch_size auto: {saved.micro_batch_size}, as {checkpoint} was trained "
                f"({saved.describe()})")
        return _split(config, saved.micro_batch_size, share), line
    device = local_device(torch.device(config.training.device))
    limit = b.auto_memory_gib * GIB if b.auto_memory_gib is not None else DEVICE_SHARE * device_memory(device)
    fit = measure_memory(config, device, make_session, rows=(1, 2) if share > 1 else (1,))
    chosen = largest_fitting(fit, share, limit)
    where = f"{_device_name(device)}'s {_gib(limit)}"
    if chosen is None:
        raise ValueError(f"batch.micro_batch_size auto: a micro batch of 1 needs about {_gib(fit.peak(1))}, more "
                         f"than {where} ({fit.how}): set batch.auto_memory_gib higher, recompute "
                         "(training.recompute true) or use a smaller model")
    larger = min((m for m in range(chosen + 1, share + 1) if share % m == 0), default=None)
    line = (f"batch.micro_batch_size auto: {chosen} (gradient accumulation {share // chosen} × {replicas} replica(s) "
            f"= global batch {total}): it needs about {_gib(fit.peak(chosen))} of {where}"
            + (f"; {larger} would need {_gib(fit.peak(larger))}" if larger else "") + f" ({fit.how})")
    return _split(config, chosen, share), line


def largest_fitting(fit: MemoryFit, share: int, limit: float) -> Optional[int]:
    """The largest micro batch that divides `share` and whose peak is within `limit` bytes."""
    return next((m for m in range(share, 0, -1) if share % m == 0 and fit.peak(m) <= limit), None)


def _gib(size: float) -> str:
    return f"{size / GIB:.3g} GiB"


def _split(config: Config, micro: int, share: int) -> Config:
    batch = config.batch.model_copy(update={"micro_batch_size": micro, "gradient_accumulation": share // micro,
                                            "global_batch_size": None, "auto_memory_gib": None})
    return config.model_copy(update={"batch": batch})


def device_memory(device: torch.device) -> float:
    """Bytes of `device`: the GPU's, or the host's shared by the processes of this node."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the host"


def measure_memory(config: Config, device: torch.device, make_session: Callable[[Config], TrainingSession],
                   rows: tuple[int, ...] = (1, 2)) -> MemoryFit:
    """The peak memory of a training step of `config`'s model on `device` as a function of
    its rows, from steps of a session of its own at each of `rows` (the module docstring); its
    batch section is not read (micro_batch_size may be auto)."""
    alone = config.model_copy(update={
        "batch": config.batch.model_copy(update={"micro_batch_size": 1, "gradient_accumulation": 1,
                                                 "global_batch_size": None, "auto_memory_gib": None}),
        "training": config.training.model_copy(update={"device": str(device), "kernels": {
            **config.training.kernels, "graph": "eager"}}),
        "parallel": config.parallel.model_copy(update={"replication_factor": 1, "replicated_tensor_sharding": False}),
    })
    with _alone(), make_session(alone) as session:
        specs = session.input_specs
        feeds = {r: _zero_batch(specs, r, device) for r in rows}
        session.run(feeds[rows[0]])  # the optimizer's state and the kernels' first calls, before measuring
        at = f"at micro batch{'es' if len(rows) > 1 else ''} " + " and ".join(map(str, rows))
        if device.type == "cuda":
            peaks = [_cuda_peak(session, feeds[r], device) for r in rows]
            how = f"the CUDA allocator's peak over a step {at}"
        else:
            weights = [p for _, p in session.named_weights()]
            held = sum(p.numel() * p.element_size() for p in weights)
            state = sum(p.numel() for p in weights) * 4 * (1 + len(session.optimizer.state_kinds))
            peaks = [held + state + _saved_bytes(session, feeds[r]) for r in rows]
            how = ("estimated: the weights, their gradients and the optimizer's state, and what the forward pass "
                   f"saves for backward {at}")
    if len(rows) == 1:  # all of it taken as growing with the rows: an upper bound beyond them
        return MemoryFit(fixed=0.0, per_row=peaks[0] / rows[0], how=how)
    per_row = max(0.0, (peaks[-1] - peaks[0]) / (rows[-1] - rows[0]))
    return MemoryFit(fixed=peaks[0] - rows[0] * per_row, per_row=per_row, how=how)


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """The probe as a process of its own under a launcher (torchrun starts every process of a run
    with its place in the run in these variables): it makes no process group and talks to no
    other process, and the session it builds is told so while it runs."""
    hidden = {name: os.environ.pop(name) for name in _LAUNCHED if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


_LAUNCHED = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def _zero_batch(specs, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch of `rows` rows of every graph input: zeros (token, position, label 0), ones
    for masks and floating inputs (every position real, every weight 1). The memory a step
    takes does not depend on the values."""
    feeds = {}
    for name, spec in specs.items():
        dims = [rows if i == 0 and not isinstance(d, int) else d for i, d in enumerate(spec.dims)]
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"batch.micro_batch_size auto: graph input {name} {spec.shape_text()} has a size other "
                             "than its rows left open: give the micro batch as a number")
        fill = 1 if spec.binary or not spec.integer else 0
        feeds[name] = torch.full(dims, fill, dtype=spec.dtype)
    return feeds


def _cuda_peak(session: TrainingSession, feeds: dict[str, torch.Tensor], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    session.run(feeds)
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device))


def _saved_bytes(session: TrainingSession, feeds: dict[str, torch.Tensor]) -> float:
    """Bytes of the storages the step's forward pass saves for backward, the weights' left out."""
    weights = {p.untyped_storage().data_ptr() for _, p in session.named_weights()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        session.run(feeds)
    return float(sum(saved.values()))
