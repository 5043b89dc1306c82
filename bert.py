#!/usr/bin/env python3
"""Entry point: python bert.py --config configs/<name>.json [--section.key value ...]
           or: python bert.py --sweep configs/sweeps/<name>.yaml [--storage URL] [--trials N] [...]
           or: python bert.py --compare configs/compare/<name>.yaml [--output-dir DIR] [--section.key value ...]

    --summary              build the graph, print parameters, FLOPs and placement; no training
    --checkpoint-input D   resume a run exactly from checkpoint directory D
    --wandb                also log metrics to Weights & Biases (offline without credentials)
    --export PATH          write the portable ONNX export of --checkpoint-input (or training.init_from)
                           for onnxruntime (infer.py); no training
    --export-hf DIR        write a BERT of --checkpoint-input (or training.init_from) as a HuggingFace
                           transformers directory (config, safetensors, vocab, tokenizer); no training
    --eval-only            score --checkpoint-input (or training.init_from) without training:
                           pre-training: eval_* on the held-out set (data.eval_files, the demo's own);
                           SQuAD: EM/F1 on data.dev_file (a checkpoint or a HuggingFace directory)
    --sweep YAML           run (or join) the W&B sweep in YAML without a W&B server (docs/sweeps.md);
                           its `command` names the --config; --storage, --trials, --sweep-dir, --max-loss
    --compare YAML         compare configs at an equal budget of training FLOPs or seconds, each at its best
                           grid point, over seeds, with SQuAD scores, in one report (docs/quality.md);
                           resumable, several workers; --output-dir DIR (default runs/compare/<name>)
    --debug                show the full traceback of any error

model.task "squad" runs SQuAD fine-tuning (bert/finetune.py), "pretraining" pre-training;
`torchrun --nproc-per-node N bert.py ...` runs N processes (docs/distributed.md).

Any config field can be overridden: `--training.steps 300`, `--model.hidden_size=256`,
`--data.files '["a.hdf5", "b.hdf5"]'` (values are read as JSON when they parse, else as text).

A mistake in the command, the config or the data ends in one line `error: ...` naming
what to fix, exit code 2; a diverging run in `error: training diverged ...`, exit code 3;
SIGINT/SIGTERM in a checkpoint and one line, exit code 130/143; an unexpected exception
(a bug) in `error: internal error ...`, exit code 1; `--debug` shows the traceback.

GROUPBERT_DOC_STEPS=N in the environment caps every run at N steps past where it starts
(the test that runs the commands of README.md and docs/ sets it, tests/doc_commands.py):
training.steps becomes at most N more than the step of the checkpoint it resumes (0 for a
new run), warmup_steps at most that, epochs give way to the steps, and data.eval_samples
is at most 64. One line says what changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DOC_STEPS_ENV = "GROUPBERT_DOC_STEPS"
DOC_EVAL_SAMPLES = 64  # data.eval_samples under GROUPBERT_DOC_STEPS


def parse_overrides(extra: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"unrecognised argument {arg!r}: overrides look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise ValueError(f"override {arg} needs a value")
            value = extra[i + 1]
            i += 1
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
        i += 1
    return overrides


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we raise one line
        raise ValueError(f"{message} (see python bert.py --help)")


def main(argv: list[str] | None = None) -> int:
    from session.process import retain_freed_memory

    retain_freed_memory()  # the process settings the benchmarks measure with (session/process.py)
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="JSON config file (configs/*.json)")
    parser.add_argument("--summary", action="store_true", help="print the model summary and exit")
    parser.add_argument("--checkpoint-input", help="resume exactly from this checkpoint directory")
    parser.add_argument("--wandb", action="store_true", help="log metrics to Weights & Biases too")
    parser.add_argument("--export", metavar="PATH", help="write the portable ONNX export of the weights and exit")
    parser.add_argument("--export-outputs", default="heads", choices=["heads", "encoder"],
                        help="the task's logits (default) or the encoder's sequence output")
    parser.add_argument("--export-hf", metavar="DIR", help="write the BERT weights as a HuggingFace transformers "
                        "directory and exit")
    parser.add_argument("--eval-only", action="store_true",
                        help="score the starting weights without training (held-out eval_*; SQuAD: dev EM/F1)")
    parser.add_argument("--sweep", help="W&B sweep YAML (configs/sweeps/*.yaml) to run or join")
    parser.add_argument("--storage", help="sweep: Optuna journal file or database URL shared by workers "
                        "(default: optuna.journal in --sweep-dir)")
    parser.add_argument("--trials", type=int, help="sweep: run at most this many trials here (0: report only)")
    parser.add_argument("--sweep-dir", help="sweep: directory of its runs and report (default runs/sweeps/<name>)")
    parser.add_argument("--max-loss", type=float, help="sweep: a loss above this marks a run diverged")
    parser.add_argument("--compare", metavar="YAML", help="comparison YAML (configs/compare/*.yaml) to run or join")
    parser.add_argument("--output-dir", help="compare: directory of its runs and report (default runs/compare/<name>)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        return _run(parser, argv)
    except Exception as e:
        if debug:
            raise
        from bert.errors import RunInterrupted, TrainingDiverged

        if isinstance(e, TrainingDiverged):
            print(f"error: {e}", file=sys.stderr)
            return 3
        if isinstance(e, RunInterrupted):  # a checkpoint was written: say where, in one line
            print(e, file=sys.stderr)
            return 128 + e.signal
        if isinstance(e, (ValueError, OSError)):  # user errors, and files that cannot be read or written
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
        print(f"error: internal error ({type(e).__name__}: {_one_line(e)}); this is a bug: rerun with --debug "
              "for the traceback and report it", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted: stopped at once; the checkpoints already written are intact", file=sys.stderr)
        return 130


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = " ".join(str(error).split())
    return text if len(text) <= 500 else text[:497] + "..."


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args, extra = parser.parse_known_args(argv)
    if args.compare:
        return compare(parser, args, extra)
    if args.output_dir is not None:
        parser.error("--output-dir goes with --compare (a run's directory is --training.output_dir)")
    if args.sweep:
        return sweep(parser, args, extra)
    if not args.config:
        parser.error("--config (or --sweep) is required")
    if any(v is not None for v in (args.storage, args.trials, args.sweep_dir, args.max_loss)):
        parser.error("--storage, --trials, --sweep-dir and --max-loss go with --sweep")
    modes = [flag for flag, given in (("--summary", args.summary), ("--eval-only", args.eval_only),
                                      ("--export", args.export is not None)) if given]
    if len(modes) > 1:  # each is a job of its own: none is dropped silently
        parser.error(f"{' and '.join(modes)} are separate jobs: run one at a time (e.g. score with --eval-only, "
                     "then export with --export)")
    if args.export is not None:  # the output is checked before anything is read or built
        from bert.outputs import check_output

        check_output(args.export, "--export", replace=True, suffix=".onnx")

    from bert import build_model, load_config, with_overrides

    config = load_config(args.config)
    if extra:
        config = with_overrides(config, parse_overrides(extra), f"command line (over {args.config})")
    if args.export and args.export_hf:
        parser.error("--export and --export-hf are two exports: pass one")
    if not (args.summary or args.export or args.export_hf):
        config = doc_step_cap(config, None if args.eval_only else args.checkpoint_input, training=not args.eval_only)
    if not (args.summary or args.export or args.export_hf):
        # Before any model is built, and before torch is imported: the launch fits the
        # config (processes = pipeline stages × replicas, one GPU per process), the data exists.
        from bert.data import check_data, run_layout
        from session.ranks import process_device

        run_layout(config)
        process_device(config.training.device)
        check_data(config)

    if args.summary:
        from bert.summary import summary

        print(summary(build_model(config.model)))
        return 0

    from bert import Task
    from bert.export import export_run
    from bert.finetune import evaluate_only, finetune
    from bert.train import evaluate_only as evaluate_pretraining
    from bert.train import train

    if args.eval_only and config.model.task is Task.SQUAD:
        evaluate_only(config, checkpoint_input=args.checkpoint_input)
    elif args.eval_only:
        evaluate_pretraining(config, checkpoint_input=args.checkpoint_input)
    elif args.export:
        export_run(config, args.export, checkpoint_input=args.checkpoint_input, outputs=args.export_outputs)
    elif args.export_hf:
        from bert.hf_export import export_hf

        export_hf(config, args.export_hf, checkpoint_input=args.checkpoint_input)
    elif config.model.task is Task.SQUAD:
        finetune(config, checkpoint_input=args.checkpoint_input, use_wandb=args.wandb)
    else:
        train(config, checkpoint_input=args.checkpoint_input, use_wandb=args.wandb)
    return 0


def sweep(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    """The sweep's `command` is parsed as `wandb agent` would run bert.py; `extra` goes over it."""
    from bert import load_config, with_overrides
    from bert.sweep import load_spec, run_sweep

    try:
        spec = load_spec(args.sweep)
        run, run_extra = parser.parse_known_args(list(spec.program_args))
        for given in ("summary", "checkpoint_input", "sweep", "storage", "trials", "sweep_dir", "max_loss"):
            if getattr(run, given) not in (None, False):
                raise ValueError(f"sweep {args.sweep}: its command cannot pass --{given.replace('_', '-')}")
        if args.config or not run.config:
            raise ValueError(f"sweep {args.sweep}: the base config comes from the YAML's command "
                             "(--config FILE before ${args}), as wandb agent runs it")
        config = load_config(run.config)
        if run_extra:
            config = with_overrides(config, parse_overrides(run_extra), f"sweep {args.sweep} command")
        if extra:
            config = with_overrides(config, parse_overrides(extra), "command line")
        config = doc_step_cap(config, None)
        run_sweep(spec, config, sweep_dir=args.sweep_dir, storage=args.storage, trials=args.trials,
                  use_wandb=args.wandb or run.wandb, max_loss=args.max_loss)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep interrupted: the same command continues it (finished runs are kept)", file=sys.stderr)
        return 130
    return 0


def compare(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    """The comparison; `extra` (--section.key value) goes over every config it names."""
    given = [f"--{k.replace('_', '-')}" for k in ("config", "sweep", "storage", "trials", "sweep_dir", "max_loss",
                                                   "checkpoint_input", "export", "export_hf")
             if getattr(args, k) is not None] + [f for f, on in (("--summary", args.summary),
                                                                 ("--eval-only", args.eval_only)) if on]
    if given:
        parser.error(f"{', '.join(given)} cannot go with --compare: the comparison's YAML names its configs")
    from bert.compare import compare as run_comparison

    try:
        run_comparison(args.compare, args.output_dir, parse_overrides(extra), use_wandb=args.wandb)
    except KeyboardInterrupt:
        print("comparison interrupted: the same command continues it (finished runs are kept)", file=sys.stderr)
        return 130
    return 0


def doc_step_cap(config, checkpoint_input: str | None, training: bool = True):
    """The config capped by GROUPBERT_DOC_STEPS (module docstring), or `config` when it is unset."""
    value = os.environ.get(DOC_STEPS_ENV, "")
    if not value:
        return config
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DOC_STEPS_ENV}={value!r}: give a positive number of steps, or unset it")
    from bert import with_overrides

    start = 0
    if training and (checkpoint_input or "TORCHELASTIC_RUN_ID" in os.environ):
        from bert.rundir import resume_step

        # Read without claiming the run directory: under torchrun every process caps its
        # config before rank 0 claims the run.
        start = resume_step(config, checkpoint_input)
    t, data = config.training, config.data
    steps = min(t.steps, start + int(value))
    capped = {"training.steps": steps, "training.warmup_steps": min(t.warmup_steps, steps),
              "training.epochs": None, "data.eval_samples": min(data.eval_samples, DOC_EVAL_SAMPLES)}
    before = {"training.steps": t.steps, "training.warmup_steps": t.warmup_steps, "training.epochs": t.epochs,
              "data.eval_samples": data.eval_samples}
    changed = [f"{k} {before[k]} → {v}" for k, v in capped.items() if before[k] != v]
    if changed and os.environ.get("RANK", "0") == "0":
        print(f"{DOC_STEPS_ENV}={value}: {', '.join(changed)}", flush=True)
    return with_overrides(config, capped, DOC_STEPS_ENV)


if __name__ == "__main__":
    sys.exit(main())
