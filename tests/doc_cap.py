"""The one cap on the documented commands (tests/doc_commands.py): at most DOC_STEPS steps.

In a doc-test sandbox `python`, `python3` and `torchrun` are shims: a command that runs
`bert.py` goes through this script, which appends the overrides that cap it and says so
in one line, then runs the command as written with them. For `bert.py train`, `eval`
and `sweep` (its base config):

    --training.steps S          S: the config's steps, at most DOC_STEPS past where the run
                                starts (the step of its --checkpoint-input; 0 for a new run)
    --schedule.warmup_steps W   at most S
    --training.epochs null      the capped steps decide
    --data.eval_samples E       at most DOC_EVAL_SAMPLES

Overrides go anywhere on a bert.py command line and the last one of a key wins, so the
cap holds over the command's own. Every other command runs unchanged.

    python tests/doc_cap.py LAUNCHER ARG...     run `LAUNCHER ARG...` (a python or torchrun), capped
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

DOC_STEPS = 4
DOC_EVAL_SAMPLES = 64
CAPPED = ("train", "eval", "sweep")


def _script(path: Path):
    """bert.py as a module, with its directory (the sandbox) first on the import path."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("bert_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cap(script: Path, argv: list[str]) -> tuple[list[str], str]:
    """(the overrides that cap `bert.py argv`, the line that says what they change); ([], "")
    for a command that neither trains nor evaluates, or that bert.py will refuse itself."""
    bert = _script(script)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help, notes: bert.py says them itself
            args, overrides = bert.parse_command(argv)
            if args.command not in CAPPED:
                return [], ""
            sweep = args.command == "sweep"
            config = bert.sweep_config(args, overrides)[1] if sweep else bert.command_config(args, overrides)
    except (ValueError, OSError, SystemExit):
        return [], ""  # bert.py says what is wrong with the command
    from bert.run.rundir import resume_step

    start = resume_step(config, args.checkpoint_input) if args.command == "train" else 0
    steps = min(config.training.steps, start + DOC_STEPS)
    capped = {"training.steps": steps, "schedule.warmup_steps": min(config.schedule.warmup_steps, steps),
              "training.epochs": None, "data.eval_samples": min(config.data.eval_samples, DOC_EVAL_SAMPLES)}
    before = {"training.steps": config.training.steps, "schedule.warmup_steps": config.schedule.warmup_steps,
              "training.epochs": config.training.epochs, "data.eval_samples": config.data.eval_samples}
    changed = [f"{key} {before[key]} → {value}" for key, value in capped.items() if before[key] != value]
    extra = [arg for key, value in capped.items() for arg in (f"--{key}", "null" if value is None else str(value))]
    return extra, f"doc-test cap: {', '.join(changed)}" if changed else ""


def main(launcher: str, argv: list[str]) -> None:
    at = next((i for i, arg in enumerate(argv) if arg.endswith("bert.py")), None)
    extra: list[str] = []
    if at is not None:
        extra, line = cap(Path(argv[at]).resolve(), argv[at + 1:])
        if line:
            print(line, flush=True)
    os.execv(launcher, [launcher, *argv, *extra])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
