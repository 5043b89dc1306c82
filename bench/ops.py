#!/usr/bin/env python3
"""Custom-op benchmarks in one run, at every CPU kernel level this machine runs:
GroupedConv1d (bench/_conv.py) and the fused LAMB step (bench/_lamb.py). Each checks
correctness first, then times against its peers and the roofline, printing the arithmetic.

    python bench/ops.py            # writes bench/results/ops.json
    python bench/ops.py --smoke    # tiny sizes, every level, checked then timed; seconds; writes nothing

--smoke runs both parts of a level in one child process, the levels side by side on one
thread each (their figures are not quoted; a smoke run's time is torch's start-up).

Levels (bench/_levels.py): every one the CPU supports, lowest first (generic, avx2,
avx512, avx512_bf16), each in child processes where our kernels (GROUPBERT_CPU_CAPABILITY)
and torch's (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) are capped
alike; then "native", nothing capped: the machine's own best on both sides (ours with
AVX512-BF16 dot products or AMX tiles for bf16 where the CPU has them). fp32 is timed at
every level; bf16 too, so that avx512 (ours widened to fp32, oneDNN without bf16
instructions) and avx512_bf16 (vdpbf16ps on both sides) stand side by side.

Keys: conv_vs_torch_{fp32,bf16} (native: speed-up over torch's grouped conv1d on (B, H, S)
data, transposes not timed), conv_vs_torch_channels_last_{fp32,bf16} (over a (B, S, H)
caller's transpose -> conv1d -> transpose), lamb_vs_torch_optimizer (speed-up),
lamb_vs_foreach, lamb_vs_floor (our time over the 40 B/param floor),
conv_vs_torch_fp32_peer_bf16 (bf16 against torch's fp32 conv on the same values: at the
avx2 level torch's own bf16 conv takes seconds), conv_vs_torch_{fp32,bf16,fp16}_1thread_cpu
(one thread each, process CPU time: the figure a loaded machine disturbs least), the same with a
_<level> suffix for each capped level (conv_vs_torch_fp32_avx2, lamb_vs_floor_avx2, ...),
"cpu" (model, flags of note, features, levels, date, load) and the details each part
reports under "levels" (conv: "bf16_kernel" names the kernel our bf16 ran on).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and 2 repeats at every level, to check that it runs; writes no results file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a --smoke level's process: both parts
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    return parser


_start.check_packages(build_parser, "torch_optimizer")  # before the imports that need the project's packages

import _conv  # noqa: E402
import _lamb  # noqa: E402
import _levels  # noqa: E402

CONV_KEYS = ("conv_vs_torch_fp32", "conv_vs_torch_bf16", "conv_vs_torch_fp16", "conv_vs_torch_channels_last_fp32",
             "conv_vs_torch_channels_last_bf16", "conv_vs_torch_fp32_peer_bf16", "conv_vs_torch_fp32_1thread_cpu",
             "conv_vs_torch_bf16_1thread_cpu", "conv_vs_torch_fp16_1thread_cpu")
LAMB_KEYS = ("lamb_vs_torch_optimizer", "lamb_vs_foreach", "lamb_vs_floor")


def _parts(smoke: bool) -> dict[str, tuple[dict, dict]]:
    """{level: (conv's result, LAMB's)}: a full run times each part in its own child process per
    level, one after another; a smoke run both parts in one, the levels side by side."""
    levels = _levels.levels()
    if not smoke:
        return {level: (_conv.run(level), _lamb.run(level)) for level in levels}
    children = _levels.run_children(Path(__file__), levels, _conv._MALLOC_ENV, ["--smoke"],
                                    parallel=os.cpu_count() or 1)
    parts = {}
    for level, (result, output) in children.items():
        print(output, end="", flush=True)
        parts[level] = (result["conv"], result["lamb"])
    return parts


def main() -> None:
    args = build_parser().parse_args()
    if args.child:  # one level of a smoke run: checks first, then times, as each part's own child does
        _levels.check_child_level(args.child)
        result = {"conv": _conv._run_here(args.child, args.smoke), "lamb": _lamb._run_here(args.child, args.smoke)}
        Path(args.json_out).write_text(json.dumps(result))
        return
    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    results: dict = {"cpu": cpu, "command": "python bench/ops.py" + (" --smoke" if args.smoke else ""), "levels": {}}
    for level, (conv, lamb) in _parts(args.smoke).items():
        results["levels"][level] = {"conv": conv["conv"], "lamb": lamb["lamb"]}
        suffix = "" if level == _levels.NATIVE else f"_{level}"
        for key in CONV_KEYS:
            results[key + suffix] = conv[key]
        for key in LAMB_KEYS:
            results[key + suffix] = lamb[key]
    print(f"\n{_levels.cpu_line(cpu)}{' (smoke: tiny sizes, no figure to quote)' if args.smoke else ''}")
    keys = CONV_KEYS[:2] + CONV_KEYS[6:8] + LAMB_KEYS[2:]
    print(f"{'level':<12} " + " ".join(f"{k:>32}" for k in keys) + "  bf16 kernel")
    for level in results["levels"]:
        suffix = "" if level == _levels.NATIVE else f"_{level}"
        print(f"{level:<12} " + " ".join(f"{results[k + suffix]:32.2f}" for k in keys)
              + f"  {results['levels'][level]['conv']['bf16_kernel']}")
    if args.smoke:
        print("smoke run: no results file written")
        return
    out = ROOT / "bench" / "results" / "ops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
