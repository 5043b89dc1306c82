#!/usr/bin/env python3
"""Custom-op benchmarks in one run: GroupedConv1d (bench/_conv.py) and the fused LAMB
step (bench/_lamb.py). Each checks correctness first, then times against its peers and
the roofline, printing the arithmetic.

    python bench/ops.py            # writes bench/results/ops.json

Keys: conv_vs_torch_fp32, conv_vs_torch_bf16 (speed-up over torch's grouped conv1d on
(B, H, S) data, transposes not timed), conv_vs_torch_channels_last_{fp32,bf16} (over a
(B, S, H) caller's transpose → conv1d → transpose, the layout the model has),
lamb_vs_torch_optimizer (speed-up), lamb_vs_floor (our time over the 40 B/param floor),
and the detail each part reports.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _conv  # noqa: E402
import _lamb  # noqa: E402

from custom_ops import load_library  # noqa: E402


def main() -> None:
    load_library(required=True)  # benchmarks measure the compiled ops, never the fallbacks
    results = {"conv": _conv.run(), "lamb": _lamb.run()}
    keys = ("conv_vs_torch_fp32", "conv_vs_torch_bf16", "conv_vs_torch_channels_last_fp32",
            "conv_vs_torch_channels_last_bf16", "lamb_vs_torch_optimizer", "lamb_vs_foreach", "lamb_vs_floor")
    for key in keys:
        part = results["conv"] if key.startswith("conv") else results["lamb"]
        results[key] = part[key]
    out = ROOT / "bench" / "results" / "ops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(f"{k}: {results[k]:.2f}" for k in keys))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
