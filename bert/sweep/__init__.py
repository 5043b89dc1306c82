"""Hyper-parameter sweeps described in W&B's sweep YAML, run without a W&B server.

    python bert.py sweep configs/sweeps/<name>.yaml [--storage PATH|URL] [--trials N] [--sweep-dir DIR]

The YAML is W&B's sweep configuration; the same file runs under `wandb sweep` + `wandb agent`
unchanged. Optuna keeps the sweep: a study in a journal file (or a database) that workers share,
a grid enqueued whole, its samplers and pruner, exclusive takes with `study.ask()`, and the
retry of a dead worker's trial. What is the product's own, one seam per module:

- `spec`: the YAML read and checked into a `SweepSpec`;
- `storage`: the journal or database opened through Optuna's public classes, damaged ones
  refused in one line, heartbeats and stale trials on public storage calls;
- `worker`: the study made or joined, each trial a run of the run loop in this process, a
  trial stopped by a signal queued to resume from its checkpoint, a grid that grows in place;
- `report`: runs.csv, runs.md and plots, with the edge flags.

docs/sweeps.md gives the reason for each piece.
"""
from bert.sweep.report import edge_flags, write_report
from bert.sweep.spec import Hyperband, Parameter, SweepSpec, load_spec, spec_from_dict
from bert.sweep.storage import StorageDamaged, open_storage
from bert.sweep.worker import SweepResult, make_sampler, open_study, run_sweep

__all__ = ["Hyperband", "Parameter", "StorageDamaged", "SweepResult", "SweepSpec", "edge_flags", "load_spec",
           "make_sampler", "open_storage", "open_study", "run_sweep", "spec_from_dict", "write_report"]
