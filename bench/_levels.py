"""CPU kernel levels for the benchmarks: which this machine runs, how to force one, and
the CPU named beside every figure (with the date and the flags that decide the levels).

A level caps our kernels (GROUPBERT_CPU_CAPABILITY) and torch's the same way: ATen's
vectorised kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and MKL's
(MKL_ENABLE_INSTRUCTIONS: some of torch's grouped convolutions end in an MKL gemm).
They are read when the process starts, so each level runs in a child process (`run_child`).
"native" sets nothing: each library runs the best it has (ours adds AMX tiles for bf16
where the CPU has them, oneDNN its AVX-512 bf16/VNNI/AMX paths).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from custom_ops import load_library, supported_cpu_capabilities  # noqa: E402

NATIVE = "native"
LEVEL_ENV = {
    "generic": {"GROUPBERT_CPU_CAPABILITY": "generic", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"GROUPBERT_CPU_CAPABILITY": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    # AVX512_CORE is oneDNN's F/BW/VL/DQ level, the one our avx512 kernels use: no bf16
    # dot products on either side.
    "avx512": {"GROUPBERT_CPU_CAPABILITY": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    # AVX512_CORE_BF16 adds AVX512-BF16 (and VNNI) to oneDNN, as avx512_bf16 adds vdpbf16ps
    # to ours; no AMX on either side.
    "avx512_bf16": {"GROUPBERT_CPU_CAPABILITY": "avx512_bf16", "ATEN_CPU_CAPABILITY": "avx512",
                    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    NATIVE: {},
}
_CAPPING = ("GROUPBERT_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# /proc/cpuinfo flags that decide a level on either side (ours, ATen, oneDNN), named in the results.
FLAGS_OF_NOTE = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                 "avx512_fp16", "amx_tile", "amx_bf16")


def levels() -> list[str]:
    """Every level this machine runs, lowest first, then "native"."""
    load_library(required=True)  # benchmarks measure the compiled ops, never the fallbacks
    return supported_cpu_capabilities() + [NATIVE]


def cpu_description() -> dict:
    """The CPU as lscpu names it, its family/model, its flags of note, the features our
    dispatch saw, and when (the date and load average of this run)."""
    info = {"model": platform.processor() or "unknown", "family": None, "model_number": None, "flags_of_note": []}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and info["model"] == (platform.processor() or "unknown"):
                info["model"] = value
            elif key == "cpu family" and info["family"] is None:
                info["family"] = int(value)
            elif key == "model" and info["model_number"] is None:
                info["model_number"] = int(value)
            elif key == "flags" and not info["flags_of_note"]:
                info["flags_of_note"] = [f for f in FLAGS_OF_NOTE if f in value.split()]
    except OSError:
        pass
    load_library(required=True)
    features = torch.ops.groupbert.cpu_features()
    info.update(features=features, avx512="avx512f" in features, avx512_bf16="avx512bf16" in features,
                amx="amx-bf16" in features, levels=supported_cpu_capabilities(), torch=torch.__version__,
                threads=torch.get_num_threads(), cpus=os.cpu_count(),
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                load_average_at_start=os.getloadavg()[0])
    return info


def cpu_line(cpu: dict) -> str:
    def yes(key: str) -> str:
        return "yes" if cpu.get(key) else "no"

    return (f"{cpu['model']} (family {cpu['family']}, model {cpu['model_number']}), AVX-512 {yes('avx512')}, "
            f"AVX512-BF16 {yes('avx512_bf16')}, AMX {yes('amx')}; torch {cpu['torch']}, {cpu['threads']} threads; "
            f"{cpu.get('date', '')}, load average {cpu.get('load_average_at_start', float('nan')):.2f}")


def run_child(script: Path, level: str, extra_env: dict[str, str] | None = None, args: list[str] = ()) -> dict:
    """Runs `python script [args] --child LEVEL --json-out FILE` with the level's caps set, returns its JSON
    (args: e.g. ["--smoke"], which the child's `main` passes on to its `run_here`)."""
    env = {k: v for k, v in os.environ.items() if k not in _CAPPING}
    env.update(LEVEL_ENV[level], **(extra_env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, str(script), *args, "--child", level, "--json-out", str(out)], env=env,
                       check=True)
        return json.loads(out.read_text())


def run_children(script: Path, levels: list[str], extra_env: dict[str, str] | None = None, args: list[str] = (),
                 parallel: int = 1) -> dict[str, tuple[dict, str]]:
    """`run_child` for each level, up to `parallel` children at once, each on one thread (so they
    do not spin against each other): {level: (its JSON, its output)}, the output captured so
    that it can be printed in order. For --smoke, where no figure is quoted: the time of a
    smoke run is the children's start-up (torch's import), which runs side by side."""
    env = {k: v for k, v in os.environ.items() if k not in _CAPPING}
    env.update(extra_env or {}, OMP_NUM_THREADS="1")
    results: dict[str, tuple[dict, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        waiting, running = list(levels), {}
        while waiting or running:
            while waiting and len(running) < max(1, parallel):
                level = waiting.pop(0)
                out, log = Path(tmp) / f"{level}.json", Path(tmp) / f"{level}.log"
                with log.open("w") as sink:  # a file, not a pipe: a child is never blocked on its output
                    running[level] = (subprocess.Popen(
                        [sys.executable, str(script), *args, "--child", level, "--json-out", str(out)],
                        env={**env, **LEVEL_ENV[level]}, stdout=sink, stderr=subprocess.STDOUT), out, log)
            level = next(iter(running))  # the oldest: its output is printed first anyway
            child, out, log = running.pop(level)
            child.wait()
            output = log.read_text()
            if child.returncode != 0:
                for other, *_ in running.values():
                    other.kill()
                    other.wait()
                raise RuntimeError(f"{script.name} at level {level} exited {child.returncode}:\n{output[-4000:]}")
            results[level] = (json.loads(out.read_text()), output)
    return results


def check_child_level(level: str) -> None:
    """In a child: the level really in force for our kernels (a typo in the caps would be silent)."""
    load_library(required=True)
    if level != NATIVE:
        got = torch.ops.groupbert.cpu_capability()
        if got != level:
            raise RuntimeError(f"asked for kernel level {level}, the compiled ops run {got}")


def main(doc: str, run_here, run, detail_key: str) -> None:
    """The command line of bench/_conv.py and bench/_lamb.py: every level (or --level L),
    each by `run(level, smoke)` in a child process, which calls `run_here(level, smoke)`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", choices=list(LEVEL_ENV),
                        help="one kernel level (default: every level this machine runs, then native)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few repeats: checks that it runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the child process of run()
        Path(args.json_out).write_text(json.dumps(run_here(args.child, args.smoke)))
        return
    print(cpu_line(cpu_description()))
    for level in [args.level] if args.level else levels():
        result = run(level, args.smoke)
        print(json.dumps({k: v for k, v in result.items() if k != detail_key}, indent=1))
