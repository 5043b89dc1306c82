"""What the comparison's winners do downstream: every final run (each config's best grid point at
every seed) fine-tuned once on each task (bert/compare/run.py), its dev figures read from its
own `eval_results.json`, with their mean and min–max over the pre-training seeds, and for an
accuracy the dev set's sampling error, √(p(1−p)/n) over its n rows (the rows are the draws; the
error says what another dev set of that size could move one run's figure by). A fine-tune
whose run found it degenerate (one class for every row, below the constant baseline, no
entity: bert/tasks/metrics.py) is named and left out of the ranking.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bert.compare.run import CompareRuns
from bert.compare.spec import ROOT, CompareSpec, FineTune
from bert.compare.stats import ranking, spread

__all__ = ["Tuned", "accuracy_se", "downstream", "downstream_lines", "downstream_verdict"]


@dataclass(frozen=True)
class Tuned:
    """One fine-tuning run of one pre-trained checkpoint."""

    config: str
    seed: Optional[int]  # the pre-training seed of the checkpoint it started from
    scores: dict[str, Optional[float]]  # its eval_results.json (None: not written)
    rows: Optional[int]  # dev rows scored (predictions.tsv); None where a row is not one draw (SQuAD, tags)
    run: Path
    degenerate: Optional[str] = None  # why its predictions show it learned nothing (bert/tasks/metrics.py): not ranked

    @property
    def se(self) -> Optional[float]:
        """The sampling error of its accuracy (None for other figures)."""
        p = self.scores.get("accuracy")
        return None if p is None or not self.rows else accuracy_se(p, self.rows)


def accuracy_se(p: float, n: int) -> float:
    """The binomial standard error of an accuracy `p` over `n` independent rows."""
    return math.sqrt(p * (1 - p) / n)


def downstream(spec: CompareSpec, runs: CompareRuns) -> dict[str, list[Tuned]]:
    """Each task's fine-tuning runs (finished ones), in the order of the configs and their seeds."""
    found: dict[str, list[Tuned]] = {}
    for task in spec.fine_tunes:
        found[task.task] = []
        for name in runs.arms:
            seed_of = {r["checkpoint"]: r.get("training.seed") for r in runs.finals(name)}
            result = runs.tuned.get(task.task, {}).get(name)
            for r in (result.rows if result is not None else []):
                if r["state"] != "finished":
                    continue
                run = Path(r["output_dir"])
                found[task.task].append(Tuned(name, seed_of.get(r.get("training.init_from")),
                                              _scores(run, task), _rows(run, task), run, _degenerate(run)))
        found[task.task].sort(key=lambda t: (list(runs.arms).index(t.config), t.seed is None, t.seed or 0))
    return found


def _scores(run: Path, task: FineTune) -> dict[str, Optional[float]]:
    path = run / "eval_results.json"
    scores = json.loads(path.read_text()) if path.is_file() else {}
    scores.setdefault("exact_match", scores.get("exact"))  # SQuAD v2.0's name for it (a score of SQuAD's only)
    return {k: scores.get(k) for k in task.scores}


def _degenerate(run: Path) -> Optional[str]:
    path = run / "eval_results.json"
    found = json.loads(path.read_text()).get("degenerate") if path.is_file() else None
    return found if isinstance(found, str) else None


def _rows(run: Path, task: FineTune) -> Optional[int]:
    if task.config.model.task.spec.head != "sequence":  # predictions.tsv has a line per row of a sequence head
        return None
    path = run / "predictions.tsv"
    return sum(1 for _ in path.open()) - 1 if path.is_file() else None


def downstream_verdict(spec: CompareSpec, found: dict[str, list[Tuned]],
                       groups: Optional[dict[Optional[str], list[str]]] = None) -> list[str]:
    """Each task's ranking in words, for the report's verdict (higher is better): of every config,
    or within each group of `groups` (a ladder's configs of one size)."""
    lines = []
    for task in spec.fine_tunes:
        tuned = found.get(task.task, [])
        for size, names in (groups or {None: list(dict.fromkeys(t.config for t in tuned))}).items():
            topic = _title(task) + (f" at size {size}" if size is not None else "")
            lines += [f"- {topic}: {t.config} (seed {t.seed}) {t.degenerate}: not ranked" for t in tuned
                      if t.config in names and t.degenerate]
            ranked = [t for t in tuned if not t.degenerate]
            values = {n: spread([t.scores.get(task.metric) for t in ranked if t.config == n]) for n in names}
            values = {n: v for n, v in values.items() if v is not None}
            errors = {n: [t.se for t in ranked if t.config == n and t.se is not None] for n in values}
            if not values and any(t.degenerate for t in tuned if t.config in names):
                lines.append(f"- {topic}: no config ranked: every fine-tune learned nothing of the task (above)")
            lines += ranking(values, errors, f"dev {task.metric}", "dev set's standard error", goal_minimize=False,
                             topic=topic)
    return lines


def downstream_lines(spec: CompareSpec, found: dict[str, list[Tuned]], out: Path) -> list[str]:
    """The report's section of each task: each config's figures over its pre-training seeds."""
    lines = []
    for task in spec.fine_tunes:
        tuned = found.get(task.task, [])
        lines += [f"## Downstream: {_title(task)}", "",
                  f"Each config's final runs (its best grid point at every seed) fine-tuned once each with "
                  f"`{task.config_file}` (fine-tuning seed {spec.seeds[0]}), scored on "
                  f"`{_shown(task.config.data.dev_file)}`: the mean of the dev figures, and their min–max over the "
                  "pre-training seeds."
                  + (" ± is the dev set's standard error of one run's accuracy (binomial over its rows)."
                     if "accuracy" in task.scores else ""), ""]
        se = ["±"] if "accuracy" in task.scores else []
        header = [task.scores[0], *se, *task.scores[1:]]
        lines += ["| config | " + " | ".join(header) + " | per seed | runs |", "|" + " --- |" * (len(header) + 3)]
        for name in dict.fromkeys(t.config for t in tuned):
            mine = [t for t in tuned if t.config == name]
            cells = [spread([t.scores.get(k) for t in mine]) for k in task.scores]
            text = ["" if c is None else c.text(4) for c in cells]
            if se:
                error = spread([t.se for t in mine])
                text.insert(1, "" if error is None else f"{error.mean:.2g}")
            each = ", ".join(f"seed {t.seed}: {_figure(t.scores.get(task.metric))}"
                             + (" (degenerate: not ranked)" if t.degenerate else "") for t in mine)
            where = ", ".join(f"`{os.path.relpath(t.run, out)}`" for t in mine)
            lines.append(f"| {name} | " + " | ".join(text) + f" | {each} | {where} |")
        lines.append("")
    return lines


def _title(task: FineTune) -> str:
    return "SQuAD" if task.task == "squad" else f"{task.config.model.task.value} ({Path(task.config_file).stem})"


def _shown(path: str) -> str:
    """A dev file as the report names it: relative to the working directory, or the repository."""
    for base in (Path.cwd(), ROOT):
        try:
            return str(Path(path).resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return Path(path).name


def _figure(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.4g}"
