#!/usr/bin/env python3
"""GroupBERT / BERT pre-training and fine-tuning.

    python bert.py train --config configs/<name>.json [--checkpoint-input DIR] [--section.key value ...]
    python bert.py eval --config CONFIG [--checkpoint-input DIR]    score weights without training
    python bert.py export --config CONFIG --output model.onnx       portable ONNX for onnxruntime (infer.py)
    python bert.py export-hf --config CONFIG --output DIR           a (Group)BERT as a transformers directory
    python bert.py summary --config CONFIG                          parameters, FLOPs and placement
    python bert.py sweep configs/sweeps/<name>.yaml                 a W&B sweep without a W&B server
    python bert.py compare configs/compare/<name>.yaml              configs at an equal budget

`python bert.py <command> --help` says more; options may come before the subcommand as well
(`--config CONFIG train`). `python bert.py --config CONFIG` trains, as `train` does.
model.task picks the job (bert/tasks/spec.py; `train --help` lists the tasks): "pretraining" pre-trains,
"squad" fine-tunes on SQuAD, the labelled tasks on labelled files; `torchrun --nproc-per-node N bert.py
train ...` runs N processes (docs/distributed.md).

Any config field can be overridden: `--training.steps 300`, `--model.hidden_size=256`,
`--data.files '["a.hdf5", "b.hdf5"]'` (values are read as JSON when they parse, else as text).

A mistake in the command, the config or the data ends in one line `error: ...` naming
what to fix, exit code 2; a diverging run in `error: training diverged ...`, exit code 3;
SIGINT/SIGTERM in a checkpoint and one line, exit code 130/143 (in an export: its partial
files removed and one line); a batch the GPU cannot hold in `error: out of device memory ...`
naming the batch keys, exit code 2; an unexpected exception (a bug) in `error: internal
error ...`, exit code 1; `--debug` shows the traceback.

The flags of earlier releases (--summary, --eval-only, --export PATH, --export-hf DIR,
--sweep YAML, --compare YAML) still run their subcommand for this release, saying which.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from typing import Any, Callable, Iterator

from fileio import say

COMMANDS = ("train", "eval", "export", "export-hf", "summary", "sweep", "compare")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments, the `--section.key value` overrides among them)."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        key = arg[2:].partition("=")[0]
        if arg.startswith("--") and "." in key:
            take = 1 if "=" in arg else 2
            overrides += argv[i : i + take]
            i += take
        else:
            rest.append(arg)
            i += 1
    return rest, overrides


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
        raise ValueError(f"{message} (see python {self.prog} --help)")


_FORMAT = argparse.RawDescriptionHelpFormatter


def build_parser() -> _Parser:
    """bert.py's subcommands, each with its own arguments and --help."""
    parser = _Parser(prog="bert.py", description=__doc__, formatter_class=_FORMAT)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(name: str, run: Callable, summary: str, description: str = "") -> _Parser:
        sub = commands.add_parser(name, help=summary, description=f"{summary}.\n\n{description}".strip(),
                                  formatter_class=_FORMAT, epilog="Any config field can be overridden: "
                                  "--section.key value (e.g. --training.steps 300).")
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        sub.set_defaults(run=run)
        return sub

    def config(sub: _Parser, starting: bool = True) -> None:
        sub.add_argument("--config", required=True, help="JSON config file (configs/*.json)")
        if starting:
            sub.add_argument("--checkpoint-input", metavar="DIR",
                             help="the checkpoint directory to start from (default: training.init_from)")

    from bert.tasks import SPECS

    tasks = "\n".join(f"  {s.task.value:<15} {s.description}" for s in SPECS)
    sub = command("train", train, "pre-train or fine-tune: the job of the config's model.task",
                  f"model.task:\n{tasks}\n\nA run resumes by itself from the newest checkpoint of its output "
                  "directory.")
    config(sub)
    sub.add_argument("--wandb", action="store_true", help="log metrics to Weights & Biases too")
    figures = "\n".join(f"  {s.task.value:<15} {', '.join((s.best_metric, *s.secondary_metrics))}" for s in SPECS
                        if s.fine_tuning)
    config(command("eval", evaluate, "score the starting weights without training",
                   "Pre-training: eval_* on the held-out set (data.eval_files, the demo's own). A fine-tune (a\n"
                   "checkpoint, or a HuggingFace directory): its task's figures on data.dev_file:\n" + figures))
    sub = command("export", export, "write the portable ONNX export of the weights, for onnxruntime (infer.py)")
    config(sub)
    sub.add_argument("--output", required=True, metavar="PATH", help="the .onnx file to write")
    sub.add_argument("--outputs", default="heads", choices=["heads", "encoder"],
                     help="the task's logits (default) or the encoder's sequence output")
    sub.add_argument("--optimize", action="store_true",
                     help="fuse attention, LayerNorm and GELU into onnxruntime's own operators (faster; the file then "
                          "runs in onnxruntime only)")
    sub = command("export-hf", export_hf, "write a BERT or GroupBERT as a HuggingFace transformers directory",
                  "config, safetensors weights, vocab and tokenizer; for GroupBERT also its modeling code\n"
                  "(transformers loads it with trust_remote_code=True)")
    config(sub)
    sub.add_argument("--output", required=True, metavar="DIR", help="a new or empty directory")
    config(command("summary", summary, "build the graph, print parameters, FLOPs and placement"), starting=False)
    sub = command("sweep", sweep, "run (or join) a W&B sweep YAML without a W&B server (docs/sweeps.md)",
                  "Its `command` names the --config; overrides go over it.")
    sub.add_argument("spec", metavar="YAML", help="the sweep (configs/sweeps/*.yaml)")
    sub.add_argument("--storage", help="Optuna journal file or database URL shared by workers "
                     "(default: optuna.journal in --sweep-dir)")
    sub.add_argument("--trials", type=int, help="run at most this many trials here (0: report only)")
    sub.add_argument("--sweep-dir", help="directory of its runs and report (default runs/sweeps/<name>)")
    sub.add_argument("--max-loss", type=float, help="a loss above this marks a run diverged")
    sub.add_argument("--wandb", action="store_true", help="log every run to Weights & Biases too")
    sub = command("compare", compare, "compare configs at an equal budget of training FLOPs or seconds "
                  "(docs/quality.md)", "Each at its best grid point, over seeds, each seed fine-tuned downstream, "
                  "in one report; resumable, several workers. Overrides go over every config it names.")
    sub.add_argument("spec", metavar="YAML", help="the comparison (configs/compare/*.yaml)")
    sub.add_argument("--output-dir", help="directory of its runs and report (default runs/compare/<name>)")
    sub.add_argument("--wandb", action="store_true", help="log the report to Weights & Biases too")
    return parser


# The flags of earlier releases: each stands for a subcommand; a flag that takes a value passes it
# after the arguments listed (none: the subcommand's positional argument), a flag without one is None.
_ALIASES = {"--summary": ("summary", None), "--eval-only": ("eval", None), "--export": ("export", ["--output"]),
            "--export-hf": ("export-hf", ["--output"]), "--sweep": ("sweep", []), "--compare": ("compare", [])}
_RENAMED = {"--export-outputs": "--outputs"}


def from_flags(argv: list[str]) -> list[str]:
    """An earlier release's command line (`--config X --summary`) as its subcommand's, said once;
    `--config X` alone trains."""
    modes, rest, i = [], [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in _ALIASES:
            command, before = _ALIASES[flag]
            if before is not None and not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"argument {flag}: expected one argument (see python bert.py --help)")
                value, i = argv[i + 1], i + 1
            modes.append((flag, command, [] if before is None else [*before, value]))
        else:
            rest.append(_RENAMED.get(flag, flag) + eq + value)
        i += 1
    if len(modes) > 1:
        flags = " and ".join(flag for flag, *_ in modes)
        raise ValueError(f"{flags} are separate jobs: run one at a time (python bert.py "
                         f"{' / '.join(command for _, command, *_ in modes)} ...)")
    if not modes:
        return ["train", *rest]
    flag, command, arguments = modes[0]
    given = [command, *arguments, *rest]
    from bert.config import note

    note(f"{flag} stands for the subcommand {command!r}: python bert.py {' '.join(given)} (the flag is read for "
         "this release)", topic=flag)
    return given


def main(argv: list[str] | None = None) -> int:
    from session.process import retain_freed_memory, use_cpu_threads

    retain_freed_memory()  # the process settings the benchmarks measure with (session/process.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        use_cpu_threads()  # before torch is imported: as many threads as the CPUs this process may use allow
        return _run(argv)
    except Exception as e:
        if debug:
            raise
        from bert.errors import RunInterrupted, TrainingDiverged

        if isinstance(e, TrainingDiverged):
            say(f"error: {e}")
            return 3
        if isinstance(e, RunInterrupted):  # a checkpoint was written: say where, in one line
            say(str(e))
            return 128 + e.signal
        if isinstance(e, (ValueError, OSError)):  # user errors, and files that cannot be read or written
            say(f"error: {_one_line(e)}")
            return 2
        import torch  # the run's, already imported

        if isinstance(e, torch.OutOfMemoryError):  # the batch is larger than the device holds: the config's to change
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            say(f"error: out of device memory ({first}): lower batch.micro_batch_size and raise "
                "batch.gradient_accumulation to keep the global batch, let batch.micro_batch_size auto choose it "
                "(with batch.global_batch_size; docs/running.md), or set training.recompute true")
            return 2
        say(f"error: internal error ({type(e).__name__}: {_one_line(e)}); this is a bug: rerun with --debug for the "
             "traceback and report it")
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        say("error: interrupted: stopped at once; the checkpoints already written are intact")
        return 130


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = " ".join(str(error).split())
    # A long message keeps its head (what went wrong) and its tail (what to do).
    return text if len(text) <= 500 else f"{text[:297]} ... {text[-198:]}"


def _run(argv: list[str]) -> int:
    args, overrides = parse_command(argv)
    return args.run(args, overrides)


def parse_command(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """(the subcommand's arguments, the config overrides) of a command line."""
    parser = build_parser()
    rest, overrides = split_overrides(argv)
    rest = _command_first(rest)
    first = next((a for a in rest if a != "--debug"), None)
    if first is None:
        parser.error(f"name a subcommand ({', '.join(COMMANDS)})")
    if first not in COMMANDS and first not in ("-h", "--help"):
        rest = from_flags([a for a in rest if a != "--debug"])
    args, unknown = parser.parse_known_args(rest)
    if unknown:
        raise ValueError(f"unrecognised argument {unknown[0]!r}: {_unknown_option_fix(unknown[0], args.command)}")
    return args, parse_overrides(overrides)


def _command_first(rest: list[str]) -> list[str]:
    """`--config X train` as `train --config X`: options may come before the subcommand (but not
    the value of an earlier release's flag, `--sweep compare`, nor anything after `--help`)."""
    for i, arg in enumerate(rest):
        if arg in ("-h", "--help") or (arg in COMMANDS and i and rest[i - 1] in _ALIASES):
            return rest
        if arg in COMMANDS:
            return [arg, *rest[:i], *rest[i + 1 :]] if i else rest
    return rest


def _unknown_option_fix(option: str, command: str) -> str:
    """What to do about an argument the subcommand does not take: a config key given without its
    section (`--learning_rate`) is named with it."""
    from bert.config import Config, sections_of

    key = option.partition("=")[0].lstrip("-").replace("-", "_")
    homes = sections_of(key) if option.startswith("--") and key not in Config.model_fields else []
    if homes:
        return f"{key} is a config key of {' or '.join(homes)}: use " + " or ".join(f"--{s}.{key}" for s in homes)
    return f"python bert.py {command} --help lists its options; overrides look like --section.key value"


def command_config(args: argparse.Namespace, overrides: dict[str, Any]):
    """The config a subcommand runs with: its --config file under the overrides."""
    from bert import load_config, with_overrides

    config = load_config(args.config)
    if overrides:
        config = with_overrides(config, overrides, f"command line (over {args.config})", flags=True)
    return config


def _checked(config) -> None:
    """Before any model is built, and before torch is imported: the launch fits the config
    (processes = pipeline stages × replicas, one GPU per process), the data exists."""
    from bert.data import check_data, run_layout
    from session.ranks import process_device

    run_layout(config)
    process_device(config.training.device)
    check_data(config)


def train(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = command_config(args, overrides)
    _checked(config)
    run = config.model.task.spec.train_entry()  # the task's job (bert/tasks/spec.py)
    run(config, checkpoint_input=args.checkpoint_input, use_wandb=args.wandb)
    return 0


def evaluate(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    config = command_config(args, overrides)
    _checked(config)
    config.model.task.spec.evaluate_entry()(config, checkpoint_input=args.checkpoint_input)
    return 0


def export(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from bert.run.outputs import check_output

    check_output(args.output, "export --output", replace=True, suffix=".onnx")  # before anything is read or built
    from bert.io.export import export_run

    return _stoppable("export", args.output, lambda: export_run(
        command_config(args, overrides), args.output, checkpoint_input=args.checkpoint_input, outputs=args.outputs,
        optimize=args.optimize))


def export_hf(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from bert.io.hf_export import export_hf as write

    return _stoppable("export-hf", args.output, lambda: write(
        command_config(args, overrides), args.output, checkpoint_input=args.checkpoint_input))


class _Stopped(BaseException):
    """SIGINT or SIGTERM while a command writes its one output (export, export-hf): raised in
    the main thread by the handler; a BaseException, so that no `except Exception` on the way
    takes it for a failure, while the writers' clean-up (fileio.staged, export-hf's temporary
    directory) runs as it passes."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal = signum


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM raise _Stopped; the handlers before come back after.
    (Only the main thread can set handlers: a command run in another thread keeps them.)"""
    def stop(signum: int, frame) -> None:
        raise _Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stoppable(job: str, output: str, write: Callable[[], object]) -> int:
    """Run `write`; a SIGINT or SIGTERM stops it at once, with what it staged removed and one
    line that says so (exit status 128 + the signal, as the shell's for a signal)."""
    try:
        with _signals_stop():
            write()
    except _Stopped as e:  # the handlers are back: a second signal now ends the process as usual
        say(f"error: {job} stopped by {e}: nothing was written to {output} (the partial files were removed; what "
             "was there before is as it was)")
        return 128 + e.signal
    return 0


def summary(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from bert import build_model
    from bert.summary import summary as describe

    model = command_config(args, overrides).model
    if model.task.labelled and model.outputs is None:  # labels its training file gives
        model = model.model_copy(update={"num_labels": 2})
        print("note: model.num_labels is not set (a run takes its training file's labels): counted with 2", flush=True)
    print(describe(build_model(model)))
    return 0


def sweep(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    from bert.sweep import run_sweep

    try:
        spec, config, use_wandb = sweep_config(args, overrides)
        run_sweep(spec, config, sweep_dir=args.sweep_dir, storage=args.storage, trials=args.trials,
                  use_wandb=use_wandb, max_loss=args.max_loss)
    except KeyboardInterrupt:
        print("sweep interrupted: the same command continues it (finished runs are kept)", file=sys.stderr)
        return 130
    return 0


def sweep_config(args: argparse.Namespace, overrides: dict[str, Any]):
    """(the sweep spec, its base config, whether to log to W&B). The spec's `command` is
    parsed as `wandb agent` would run bert.py (its --config, the train subcommand or none);
    the command line's overrides go over it."""
    from bert import load_config, with_overrides
    from bert.sweep import load_spec

    spec = load_spec(args.spec)
    given, fixed = split_overrides(list(spec.program_args))
    if given[:1] == ["train"]:
        given = given[1:]
    try:
        run = build_parser().parse_args(["train", *given])
    except ValueError:
        raise ValueError(f"sweep {args.spec}: its command passes {' '.join(given)}; it can pass the base config "
                         "(--config FILE before ${args}), --wandb and overrides") from None
    if run.checkpoint_input:
        raise ValueError(f"sweep {args.spec}: its command cannot pass --checkpoint-input")
    config = load_config(run.config)
    if fixed:
        config = with_overrides(config, parse_overrides(fixed), f"sweep {args.spec} command", flags=True)
    if overrides:
        config = with_overrides(config, overrides, "command line", flags=True)
    return spec, config, args.wandb or run.wandb


def compare(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """The comparison; the overrides go over every config it names."""
    from bert.compare import compare as run_comparison

    try:
        run_comparison(args.spec, args.output_dir, overrides, use_wandb=args.wandb)
    except KeyboardInterrupt:
        print("comparison interrupted: the same command continues it (finished runs are kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
