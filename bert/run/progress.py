"""What a run has spent and what it says about it: the run loop's clock and its metrics records.

- `Clock`: the steps and training seconds a run has spent, whether it is done, and with a
  seconds budget the learning rate at the fraction spent (the schedule itself stays a pure
  function, session/schedules.py);
- `Logger`: one metrics record per `training.log_every` steps (the means over the steps since
  the record before) and one per evaluation, to metrics.jsonl and W&B on rank 0, to the run's
  result and `on_log` on every process, and to the console: a bar on a terminal, one plain
  line per record otherwise, a terminal of no width included (`steps 11-20 of 300: loss
  7.558, ... (means); lr ..., tokens/s, ETA`). A record holds the machine's load average
  beside its throughput. With several processes it also holds each rank's seconds of work
  per step (min, median, max over ranks and the slowest), and a rank slower than
  `parallel.slow_rank_factor` × the median of its peers' (the other replicas of its virtual
  graph) is named on the console. Every record holds the model FLOP/s achieved (`tflops`: the
  FLOPs of a graph row, bert/run/budget.py, × the rows its steps ran, over their seconds: a
  fine-tuning run that packs each micro-batch as it comes runs fewer rows than samples) and,
  where the devices' peak is known (session/peaks.py), the MFU against it; the console line
  shows both.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np

from bert.run.budget import Budget
from bert.config import Config
from bert.run.rundir import MetricsLog
from session.peaks import Peak, flops_text
from session.training import TrainingSession

__all__ = ["Clock", "Logger", "Progress", "round_figure", "span"]


def round_figure(value: float) -> float:
    """Nine significant digits (a small accuracy keeps its precision, as decimals would not)."""
    return float(f"{value:.9g}") if isinstance(value, float) and math.isfinite(value) else value


def span(first: int, last: int) -> str:
    return f"steps {first}-{last}" if first < last else f"step {last}"


class Clock:
    """The run's progress: `steps` at most and, with a seconds budget, until its training steps
    (data, forward, backward, update; not evaluations or checkpoints) have taken that long."""

    def __init__(self, steps: int, budget: Budget, seconds: float = 0.0):
        self.steps, self.budget, self.seconds = steps, budget, seconds

    def add(self, seconds: float, session: TrainingSession) -> None:
        """Count one step's seconds; with a seconds budget every process takes rank 0's sum, so
        they agree on the rate and the end."""
        self.seconds += seconds
        if self.budget.seconds is not None:
            self.seconds = session.broadcast(self.seconds)

    def done(self, step: int) -> bool:
        return step >= self.steps or self.budget.seconds is not None and self.seconds >= self.budget.seconds

    def learning_rate(self) -> Optional[float]:
        """The rate of the next step with a seconds budget (its curve at the fraction spent);
        None: the session's schedule at the step."""
        if self.budget.curve is None or self.budget.seconds is None:
            return None
        return self.budget.curve.at_fraction(min(1.0, self.seconds / self.budget.seconds))

    def share(self, step: int) -> float:
        """How far through the run `step` is: its share of the steps or, with a seconds budget,
        of the seconds, whichever is further."""
        share = step / max(self.steps, 1)
        return max(share, self.seconds / self.budget.seconds) if self.budget.seconds else share

    def seconds_left(self) -> Optional[float]:
        return self.budget.seconds - self.seconds if self.budget.seconds is not None else None

    def spent(self, step: int) -> dict:
        """What a record of a run with a budget says it has spent (bert/run/budget.py)."""
        if not self.budget.flops_per_step:
            return {}
        return {"train_seconds": round(self.seconds, 3), "train_flops": step * self.budget.flops_per_step}


class Logger:
    """The run's metrics records (see the module docstring); files on rank 0 (`lead`)."""

    def __init__(self, config: Config, file: Optional[MetricsLog], lead: bool, start: int, progress: bool,
                 on_log: Optional[Callable[[dict], None]], postfix: Callable[[dict], dict[str, str]],
                 peers: Sequence[Sequence[int]] = (), flops_per_row: int = 0, peak: Optional[Peak] = None):
        """`file`: rank 0's metrics.jsonl (`RunDirectory.log`), None elsewhere; `flops_per_row`:
        the model FLOPs of one graph row; `peak`: of all the run's devices together (None: no MFU)."""
        self.every, self.postfix, self.on_log = config.training.log_every, postfix, on_log
        self.flops_per_row, self.peak = flops_per_row, peak
        self.peers, self.slow_factor = [list(p) for p in peers if len(p) > 1], config.parallel.slow_rank_factor
        self.records: list[dict] = []
        self.lead = lead
        self.file = file
        self.bar = Progress(progress and lead, config.training.steps, start, config.name, config.budget.seconds)
        self.window = _Window()

    def should_log(self, step: int) -> bool:
        return step % self.every == 0

    def add(self, step: int, out: dict[str, float], seconds: float, sequences: int, tokens: int, rows: int,
            rank_seconds: Sequence[float] = ()) -> None:
        """A step's figures (`sequences`, `tokens` and the graph `rows` it ran: the whole step's,
        every replica's; `rank_seconds`: each rank's seconds of work in it)."""
        self.window.add(step, {k: float(v) for k, v in out.items()}, seconds, sequences, tokens, rows, rank_seconds)
        self.bar.step(step)

    def flush(self, step: int, clock: Clock) -> None:
        """The record of the steps since the last one."""
        record = {**self.window.record(step), **self.utilisation(), **clock.spent(step)}
        self.emit(record)
        self.bar.record(self.window.first, step, self.postfix(record), _rates(record), clock.seconds_left())
        slow = self.window.slow_rank(self.peers, self.slow_factor)
        if slow:
            self.bar.write(f"note: {slow} (steps {self.window.first}-{step}); every step waits for the slowest "
                           "process: look at what else runs on its node, its GPU's clocks and temperature")
        self.window = _Window()

    def utilisation(self) -> dict:
        """The window's model TFLOP/s and MFU (None without a known peak)."""
        if not self.flops_per_row or not self.window.seconds:
            return {}
        flops = self.flops_per_row * self.window.rows / self.window.seconds
        return {"tflops": round_figure(flops / 1e12), "mfu": round(flops / self.peak.flops, 4) if self.peak else None}

    def emit(self, record: dict) -> None:
        if self.file is not None:
            self.file.log(record)
        self.records.append(record)
        if self.on_log is not None:
            self.on_log(record)

    def write(self, line: str) -> None:
        self.bar.write(line)

    def warn(self, line: str) -> None:
        """A line rank 0 says even without progress output (sweeps, tests)."""
        if self.lead:
            self.bar.write(line, always=True)

    def end_steps(self) -> None:
        """The bar ends with the last step (what comes after prints below it)."""
        self.bar.close()

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
            self.file = None


class Progress:
    """The console's view of the metrics records: a bar on a terminal (its postfix the last
    record's means), one plain line per record otherwise, each with an ETA from the steps
    this process has run (from the end of its first step, so start-up is not counted)."""

    def __init__(self, enabled: bool, total: int, start: int, title: str, seconds: Optional[float] = None):
        """`total`: the run's last step; `seconds`: its time budget, which ends it instead (its
        steps are then not known in advance: the lines name the budget, not a step count)."""
        from tqdm import tqdm

        self.enabled, self.total, self.seconds = enabled, total, seconds
        self.terminal = enabled and _room_for_a_bar(sys.stderr)
        self.bar = (tqdm(total=None if seconds is not None else total, initial=start, desc=title, dynamic_ncols=True)
                    if self.terminal else None)
        self._since: Optional[tuple[float, int]] = None  # (time, step) at the end of this process's first step
        self._now: tuple[float, int] = (time.monotonic(), start)

    def step(self, step: int) -> None:
        self._now = (time.monotonic(), step)
        if self._since is None:
            self._since = self._now
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta(self) -> Optional[float]:
        """Seconds to the last step at the pace so far (None before two steps)."""
        if self._since is None or self._now[1] <= self._since[1]:
            return None
        (t0, s0), (t1, s1) = self._since, self._now
        return (t1 - t0) / (s1 - s0) * (self.total - s1)

    def record(self, first: int, step: int, means: dict[str, str], extra: list[str],
               seconds_left: Optional[float] = None) -> None:
        """A metrics record's line: `means` are the means over steps `first`..`step`; the ETA
        is `seconds_left` when the run has a time budget, else the pace of the steps so far."""
        steps = span(first, step)
        figures = ", ".join(f"{k} {v}" for k, v in means.items()) + " (means)" if means else ""
        if self.bar is not None:
            self.bar.set_postfix_str(f"{steps}: {figures}" + "".join(f", {x}" for x in extra))
        elif self.enabled:
            if seconds_left is not None:
                eta = seconds_left if seconds_left > 0 and step < self.total else None
            else:
                eta = self.eta() if step < self.total else None
            tail = extra + ([f"ETA {_duration(eta)}"] if eta is not None else [])
            of = f" of a {self.seconds:g} s budget" if self.seconds is not None else f" of {self.total}"
            print(f"{steps}{of}: {figures}" + ("; " + ", ".join(tail) if tail else ""), flush=True)

    def write(self, line: str, always: bool = False) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled or always:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _room_for_a_bar(stream) -> bool:
    """Whether `stream` is a terminal a bar shows on. One whose size reads 0×0 (a pseudo-terminal
    nobody sized: some container and CI runners) gets no tqdm bar at all, so it gets the plain
    lines; one whose size cannot be read gets tqdm's default width."""
    if not stream.isatty():
        return False
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both of the first two
        return True
    return columns > 1  # tqdm draws in columns - 1


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _rates(record: dict) -> list[str]:
    """The figures of a record besides the job's means: the learning rate at its step, the
    pace over its steps, steps skipped."""
    out = []
    if record.get("learning_rate") is not None:
        out.append(f"lr {record['learning_rate']:.2e}")
    if record.get("tokens_per_s"):
        out.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if record.get("tflops") is not None:
        mfu = f", MFU {record['mfu']:.3f}" if record.get("mfu") is not None else ""
        out.append(flops_text(record["tflops"] * 1e12) + mfu)
    if record.get("skipped"):
        out.append(f"{record['skipped']} skipped (not finite)")
    return out


class _Window:
    """The steps since the last metrics record: their means, and their time and tokens."""

    _LAST = {"learning_rate", "loss_scale"}  # the value at the record's step, not a mean

    def __init__(self):
        self.first: Optional[int] = None  # the step of the window's first step
        self.values: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}
        self.seconds = self.sequences = self.tokens = self.rows = self.skipped = 0.0
        self.rank_seconds: Optional[np.ndarray] = None  # each rank's seconds of work, summed over the steps
        self.steps = 0

    def add(self, step: int, out: dict[str, float], seconds: float, sequences: int, tokens: int, rows: int,
            rank_seconds: Sequence[float] = ()) -> None:
        self.first = step if self.first is None else self.first
        self.steps += 1
        if len(rank_seconds) > 1:
            ranks = np.asarray(rank_seconds, dtype=np.float64)
            self.rank_seconds = ranks if self.rank_seconds is None else self.rank_seconds + ranks
        self.seconds += seconds
        self.sequences += sequences
        self.tokens += tokens
        self.rows += rows
        self.skipped += out["skipped"]
        for key, value in out.items():
            if key in self._LAST:
                self.last[key] = value
            elif key != "skipped":
                self.values.setdefault(key, []).append(value)

    def record(self, step: int) -> dict:
        """Means over the finite values (a step skipped for a non-finite loss adds none);
        NaN (null in metrics.jsonl) where every step of the window was non-finite."""
        out = {"step": step}
        for key, values in self.values.items():
            finite = [v for v in values if math.isfinite(v)]
            out[key] = round_figure(float(np.mean(finite))) if finite else float("nan")
        out.update({k: round(v, 9) for k, v in self.last.items()})
        out["skipped"] = int(self.skipped)
        out["sequences_per_s"] = round(self.sequences / self.seconds, 2) if self.seconds else None
        out["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else None
        if hasattr(os, "getloadavg"):  # what else ran: throughput and seconds read beside it
            out["load_average"] = round(os.getloadavg()[0], 2)
        if self.rank_seconds is not None:
            per_step = self.rank_seconds / self.steps
            out.update(rank_seconds_min=round_figure(float(per_step.min())),
                       rank_seconds_median=round_figure(float(np.median(per_step))),
                       rank_seconds_max=round_figure(float(per_step.max())), slowest_rank=int(per_step.argmax()))
        return out

    def slow_rank(self, peers: Sequence[Sequence[int]], factor: float) -> str:
        """The rank whose seconds of work per step most exceed `factor` × the median of its peers'
        (each list of ranks that do the same work), in words; "" when none does."""
        if self.rank_seconds is None:
            return ""
        per_step, worst = self.rank_seconds / self.steps, (0.0, "")
        for ranks in peers:
            r = max(ranks, key=lambda rank: per_step[rank])
            median = float(np.median([per_step[o] for o in ranks if o != r]))
            ratio = float(per_step[r]) / median if median > 0 else 0.0
            if ratio > factor and ratio > worst[0]:
                others = f"the other {len(ranks) - 1} replicas' median" if len(ranks) > 2 else "the other replica's"
                worst = (ratio, f"rank {r} is slow: {per_step[r]:.3g} s of work per step against {median:.3g} s, "
                                f"{others} ({ratio:.1f}×)")
        return worst[1]
