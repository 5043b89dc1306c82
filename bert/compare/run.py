"""The comparison's runs, each stage a sweep of bert/sweep/ (resumable, several workers, ranked
by the final held-out loss), in `<output-dir>/<config>/`:

1. `grid/`: each config's grid (its `parameters`, at the first seed), under the budget;
2. `seeds/`: each config's best grid point again at every other seed;
3. `squad/`: SQuAD fine-tuning of each config's best pre-trained checkpoint (when `squad:` is given);

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

from bert import budget as budgets
from bert.compare.spec import Arm, CompareSpec
from bert.config import with_overrides
from bert.outputs import check_output_dir
from bert.sweep import SweepResult, run_sweep, spec_from_dict

__all__ = ["CompareRuns", "prepared_arm", "run_compare"]


@dataclass
class CompareRuns:
    """Each config's sweeps: its grid, its seeds (None with one seed) and its SQuAD fine-tuning."""

    output_dir: Path
    arms: dict[str, Arm]
    grids: dict[str, SweepResult]
    seeds: dict[str, Optional[SweepResult]]
    squad: dict[str, Optional[SweepResult]]

    def finals(self, arm: str) -> list[dict]:
        """The runs of the final comparison: the grid's best and its seeds' (finished ones)."""
        rows = [self.grids[arm].best]
        if self.seeds[arm] is not None:
            rows += [r for r in self.seeds[arm].rows if r["state"] == "finished"]
        return rows


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

    squad: dict[str, Optional[SweepResult]] = {name: None for name in arms}
    if spec.squad is not None:
        tune = {}
        for name, arm in arms.items():
            checkpoint = _best(grids[name], name, "grid")["checkpoint"]
            base = with_overrides(spec.squad.config, _squad_overrides(spec, arm, checkpoint),
                                  f"comparison {spec.source} squad ({name})")
            tune[name] = (_sweep(spec, arm, "squad", {"training.seed": {"values": [first]}}, "f1", "maximize",
                                 spec.squad.config_file), base)
        squad.update(_stage("squad", tune, out, use_wandb, progress))
    return CompareRuns(out, arms, grids, seeds, squad)


def _squad_overrides(spec: CompareSpec, arm: Arm, checkpoint: str) -> dict:
    """Fine-tune `checkpoint` (its sizes come with it, bert/sources.py) with the pre-training vocab."""
    vocab = spec.squad.vocab_file or spec.squad.config.data.vocab_file
    if arm.config.data.source == "demo" and spec.squad.vocab_file is None:
        from bert.data import demo_data

        vocab = str(demo_data(arm.config).vocab_path)
    if vocab is None:
        raise ValueError(f"comparison {spec.source}: squad.vocab_file: name the vocab of {arm.name}'s shards (the "
                         "vocab.txt data/create_pretraining_data.py wrote beside them)")
    return {"model.architecture": arm.config.model.architecture.value, "training.init_from": checkpoint,
            "data.vocab_file": vocab}
