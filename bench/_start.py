"""What every benchmark does before its heavy imports, in the standard library alone: in a
Python without the project's packages, its --help still prints, and anything else ends in
one line that says how to get them (rather than a traceback of the first failed import)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Callable

# The packages every benchmark imports first; the rest come with them from make setup-dev.
NEEDS = ("torch", "numpy")


def check_packages(build_parser: Callable[[], argparse.ArgumentParser], *also: str) -> None:
    """`also`: packages this benchmark imports beyond NEEDS (make setup-dev's, e.g. torch_optimizer)."""
    missing = [name for name in NEEDS + also if importlib.util.find_spec(name) is None]
    if not missing:
        return
    build_parser().parse_args()  # --help prints and exits 0; a flag it does not take is named
    sys.exit(f"error: {Path(sys.argv[0]).name} needs the project's packages and {sys.executable} lacks "
             f"{', '.join(missing)}: run it with the Python that `make setup-dev` installed them into "
             "(e.g. python3 -m venv .venv && . .venv/bin/activate && make setup-dev)")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch shape of the CPU training benchmarks (train_throughput, step_profile)
    and how many timed repeats, with the same defaults in both."""
    for flag, default in (("--hidden", 256), ("--layers", 4), ("--heads", 4), ("--seq", 128), ("--batch", 32),
                          ("--masks", 20), ("--repeats", 5)):
        parser.add_argument(flag, type=int, default=default)


def finish(results: dict, out: str, smoke: bool, smoke_line: str) -> int:
    """A benchmark's last words: the load average at its end into `results`, then under --smoke
    `smoke: <smoke_line>; no results file written`, else `results` written to `out` as JSON."""
    import json
    import os

    results["load_average_end"] = os.getloadavg()
    if smoke:
        print(f"smoke: {smoke_line}; no results file written")
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
