"""What a training session carries from step to step besides its weights and optimizer:
the fp16 loss scale and its own random-number state (both saved in checkpoints)."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

__all__ = ["LossScaler", "SessionRandomness"]


class LossScaler:
    """Static or dynamic loss scaling for fp16 (Micikevicius et al. 2018).

    Dynamic: start at 2^15, halve on a non-finite gradient (the step is skipped), double
    after `growth_interval` clean steps.
    """

    def __init__(self, setting: float | str | None, growth_interval: int = 1000):
        self.dynamic = setting == "dynamic"
        self.scale = 2.0**15 if self.dynamic else float(setting or 1.0)
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:  # the run stops when it falls below precision.min_loss_scale (bert/run/loop.py)
            self.scale /= 2
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2


class SessionRandomness:
    """The session's own random-number state (CPU, and its CUDA device when there is one).

    `active()` swaps it in for the global generators around the session's forward and
    backward passes and swaps the caller's back after, so dropout masks, and the ones
    torch.utils.checkpoint replays when it recomputes, come from the session's stream
    alone: two sessions in one process, or the code around them, never shift each
    other's randomness.
    """

    def __init__(self, seed: int, device: torch.device):
        self.device: Optional[torch.device] = device if device.type == "cuda" else None
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.cpu = torch.Generator().manual_seed(seed).get_state()
        self.cuda = torch.Generator(self.device).manual_seed(seed).get_state() if self.device else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            saved_cuda = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda, self.device)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if self.device is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved_cuda, self.device)

    def state(self) -> dict[str, list[int]]:
        out = {"cpu": self.cpu.tolist()}
        if self.cuda is not None:
            out["cuda"] = self.cuda.tolist()
        return out

    def load(self, state: dict[str, list[int]]) -> None:
        self.cpu = torch.tensor(state["cpu"], dtype=torch.uint8)
        if self.device is not None and "cuda" in state:
            self.cuda = torch.tensor(state["cuda"], dtype=torch.uint8)
