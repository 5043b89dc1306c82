"""The comparison's runs, each stage a sweep of bert/sweep/ (resumable, several workers, ranked
by the final held-out loss), in `<output-dir>/<config>/`:

1. `grid/`: each config's grid (its `parameters`, at the first seed), under the budget;
2. `seeds/`: each config's best grid point again at every other seed;
3. `classify/` and `squad/`: each final run of each config (its best grid point, every seed)
   fine-tuned on the labelled task (`classify:`, on by default) and on SQuAD (when `squad:` is
   given), one run per pre-training seed, so the downstream scores have their spread too;

then the report (bert/compare/report.py). A worker first takes what is free in every config's
stage, then waits for the others' runs of it, so several workers (`bert.py compare` started
again, on this machine or another sharing the directory) keep busy; killing one and starting it
again continues where it stopped (a run cut off resumes from its last checkpoint).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bert.run import budget as budgets
from bert.compare.spec import Arm, CompareSpec, FineTune
from bert.config import with_overrides
from bert.run.outputs import check_output_dir
from bert.sweep import SweepResult, run_sweep, spec_from_dict

__all__ = ["CompareRuns", "prepared_arm", "run_compare"]


@dataclass
class CompareRuns:
    """Each config's sweeps: its grid, its seeds (None with one seed) and its fine-tuning on each
    downstream task (`tuned[task][config]`)."""

    output_dir: Path
    arms: dict[str, Arm]
    grids: dict[str, SweepResult]
    seeds: dict[str, Optional[SweepResult]]
    tuned: dict[str, dict[str, SweepResult]]

    def finals(self, arm: str) -> list[dict]:
        """The runs of the final comparison: the grid's best and its seeds' (finished ones)."""
        return _finals(self.grids[arm], self.seeds[arm])


def _finals(grid: SweepResult, seeds: Optional[SweepResult]) -> list[dict]:
    return [grid.best] + ([r for r in seeds.rows if r["state"] == "finished"] if seeds is not None else [])


def prepared_arm(spec: CompareSpec, arm: Arm) -> Arm:
    """The arm's config as its runs take it: evaluations spread over its budget's steps (a FLOPs
    budget fixes them), and a checkpoint at each evaluation, so a killed run loses little."""
    config = arm.config
    updates = {}
    if spec.evaluations is not None:
        steps = budgets.resolve(config)[0].training.steps
        updates["evaluation.every"] = max(1, math.ceil(steps / spec.evaluations))
    if not config.checkpoint.every:
        updates["checkpoint.every"] = updates.get("evaluation.every", config.evaluation.every)
    if not updates:
        return arm
    return dataclasses.replace(arm, config=with_overrides(arm.config, updates, f"comparison {spec.source}"))


def _sweep(spec: CompareSpec, arm: Arm, stage: str, parameters: dict, metric: str, goal: str, config_file: str):
    return spec_from_dict({
        "program": "bert.py", "name": f"{spec.name}-{arm.name}-{stage}", "method": "grid",
        "description": f"{stage} of {arm.name} in the comparison {spec.name} ({spec.source})",
        "metric": {"name": metric, "goal": goal}, "parameters": parameters,
        "command": ["${env}", "${interpreter}", "${program}", "--config", config_file, "${args}"]},
        f"{spec.source} ({arm.name}, {stage})")


def _stage(stage: str, sweeps: dict[str, tuple], out: Path, use_wandb: bool,
           progress: bool) -> dict[str, SweepResult]:
    """Run one stage's sweeps: first what is free in each, then each to its end."""
    results = {}
    for wait in (False, True):
        for name, (sweep, base) in sweeps.items():
            results[name] = run_sweep(sweep, base, sweep_dir=out / name / stage, use_wandb=use_wandb,
                                      progress=progress, wait=wait)
    return results


def _best(result: SweepResult, arm: str, stage: str) -> dict:
    if result.best is None:
        raise ValueError(f"comparison: no run of {arm}'s {stage} finished (see {result.sweep_dir / 'runs.md'}): "
                         "every point diverged or failed; change its parameters (a new comparison: another name)")
    return result.best


def run_compare(spec: CompareSpec, output_dir: Optional[str | os.PathLike] = None, *, use_wandb: bool = False,
                progress: bool = True) -> CompareRuns:
    """Run (or join, or continue) the comparison's sweeps; returns them for the report."""
    out = check_output_dir(output_dir or Path("runs") / "compare" / spec.name, "compare --output-dir")
    arms = {arm.name: prepared_arm(spec, arm) for arm in spec.arms}
    first, others = spec.seeds[0], list(spec.seeds[1:])

    grid = {name: (_sweep(spec, arm, "grid", {**arm.parameters, "training.seed": {"values": [first]}},
                          spec.metric, "minimize", arm.config_file), arm.config) for name, arm in arms.items()}
    grids = _stage("grid", grid, out, use_wandb, progress)

    seeds: dict[str, Optional[SweepResult]] = {name: None for name in arms}
    if others:
        again = {}
        for name, arm in arms.items():
            best, swept = _best(grids[name], name, "grid"), grid[name][0]
            point = {p.name: {"value": best[p.name]} for p in swept.swept if p.name != "training.seed"}
            constants = {k: {"value": v} for k, v in swept.constants.items()}
            again[name] = (_sweep(spec, arm, "seeds", {**constants, **point, "training.seed": {"values": others}},
                                  spec.metric, "minimize", arm.config_file), arm.config)
        seeds.update(_stage("seeds", again, out, use_wandb, progress))

    tuned: dict[str, dict[str, SweepResult]] = {}
    for task in spec.fine_tunes:
        tune = {}
        for name, arm in arms.items():
            _best(grids[name], name, "grid")  # a grid without a finished run is refused, naming it
            starts = sorted(r["checkpoint"] for r in _finals(grids[name], seeds[name]))
            base = with_overrides(task.config, _fine_tune_overrides(task, arm),
                                  f"comparison {spec.source} {task.task} ({name})")
            tune[name] = (_sweep(spec, arm, task.task, {"training.init_from": {"values": starts},
                                                        "training.seed": {"value": first}},
                                 task.metric, "maximize", task.config_file), base)
        tuned[task.task] = _stage(task.task, tune, out, use_wandb, progress)
    return CompareRuns(out, arms, grids, seeds, tuned)


def _fine_tune_overrides(task: FineTune, arm: Arm) -> dict:
    """Fine-tune the arm's checkpoints: their sizes and their vocab come with them (bert/io/sources.py);
    the task config's own vocab (a SQuAD demo's) is not theirs. A `vocab_file` the YAML names is
    checked against theirs."""
    return {"model.architecture": arm.config.model.architecture.value, "data.vocab_file": task.vocab_file}
