#!/usr/bin/env python3
"""Entry point: python bert.py --config configs/<name>.json [--section.key value ...]

    --summary              build the graph, print parameters, FLOPs and placement; no training
    --checkpoint-input D   resume a run exactly from checkpoint directory D
    --wandb                also log metrics to Weights & Biases (offline without credentials)

Any config field can be overridden: `--training.steps 300`, `--model.hidden_size=256`,
`--data.files '["a.hdf5", "b.hdf5"]'` (values are read as JSON when they parse, else as text).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="JSON config file (configs/*.json)")
    parser.add_argument("--summary", action="store_true", help="print the model summary and exit")
    parser.add_argument("--checkpoint-input", help="resume exactly from this checkpoint directory")
    parser.add_argument("--wandb", action="store_true", help="log metrics to Weights & Biases too")
    args, extra = parser.parse_known_args(argv)

    from bert import build_model, load_config, with_overrides

    try:
        config = load_config(args.config)
        if extra:
            config = with_overrides(config, parse_overrides(extra), f"command line (over {args.config})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.summary:
        from bert.summary import summary

        print(summary(build_model(config.model)))
        return 0

    from bert.train import train

    try:
        train(config, checkpoint_input=args.checkpoint_input, use_wandb=args.wandb)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
