"""Every Triton kernel the product launches, compiled for a GPU architecture on any machine, no
GPU needed (Triton's own compiler and the ptxas it ships): `make cuda-check` runs it beside nvcc,
tests/test_triton_check.py in the suite. A kernel that does not compile, or spills registers, is
found here rather than in a lent GPU's minutes.

    python -m custom_ops.triton_check [--arch 90]

One line per variant: the kernel, its dtype and mode, registers and spill bytes (from
`ptxas -v`). The variants are the launches' own: the grouped convolution's three passes at
GroupBERT's group (C 16, K 7) and at the padded shapes (C 4, K 3; C 64, K 5), unmasked, with a
float or bool mask and with packed sequence ids, in bf16, fp16 and fp32; the residual add + layer
norm at H 1024 with and without the sum read on, bf16 and fp32.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def variants() -> Iterator[tuple[str, Path, str, dict, dict, int]]:
    """(label, kernel file, kernel name, signature, constexprs, warps) of every launch variant."""
    from custom_ops.grouped_conv1d_triton import KERNELS as CONV, launch_facts, launch_warps

    for dtype, name in _TYPES.items():
        shapes = [(1024, 16, 7)] + ([(64, 4, 3), (128, 64, 5)] if dtype == torch.bfloat16 else [])
        marks = {0: f"*{name}", 1: f"*{name}", 2: "*i64"}
        if dtype == torch.bfloat16:
            marks["1-bool"] = "*u8"
        for shape in shapes:
            facts = launch_facts(dtype, shape, on_device=True)
            for mode, mark in marks.items():
                mode_value = int(str(mode)[0])
                label = f"{name} C{shape[1]} K{shape[2]} mode {mode}"
                rows = {"src_ptr": f"*{name}", "w_ptr": f"*{name}", "mask_ptr": mark, "out_ptr": f"*{name}",
                        "R": "i32", "S": "i32", "H": "i32"}
                for backward in (False, True):
                    yield (f"conv {'grad-input' if backward else 'forward'} {label}", CONV, "rows_pass", rows,
                           {**facts, "MODE": mode_value, "BACKWARD": backward}, launch_warps(facts, False))
                grad_w = {"dy_ptr": f"*{name}", "x_ptr": f"*{name}", "mask_ptr": mark, "part_ptr": "*fp32",
                          "R": "i32", "S": "i32", "H": "i32", "BLOCKS": "i32"}
                yield (f"conv grad-weight {label}", CONV, "grad_w", grad_w, {**facts, "MODE": mode_value},
                       launch_warps(facts, True))
    from session.add_norm import KERNELS as NORM, triton_block

    block = triton_block(1024)
    for name, out in (("bf16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")):
        forward = {"a_ptr": f"*{name}", "b_ptr": f"*{name}", "w_ptr": "*fp32", "bias_ptr": "*fp32", "s_ptr": f"*{name}",
                   "y_ptr": f"*{out}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "H": "i32", "eps": "fp32"}
        yield f"add_norm forward {name} -> {out}", NORM, "forward", forward, {"BLOCK": block}, 4
        backward = {"dy_ptr": f"*{out}", "s_ptr": f"*{name}", "w_ptr": "*fp32", "mean_ptr": "*fp32",
                    "rstd_ptr": "*fp32", "extra_ptr": f"*{name}", "ds_ptr": f"*{name}", "part_ptr": "*fp32",
                    "R": "i32", "H": "i32", "ROWS": "i32"}
        for extra in (False, True):
            yield (f"add_norm backward {name} {'sum read on' if extra else 'norm only'}", NORM, "backward", backward,
                   {"BLOCK": block, "EXTRA": extra}, 4)


def _ptxas() -> Optional[str]:
    """Triton's newest ptxas (it reads the PTX version Triton writes), else none."""
    import triton

    directory = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (directory / name).exists():
            return str(directory / name)
    return None


def check(arch: int = 90) -> list[str]:
    """Compile every variant for sm_`arch`; the problems found (one line each), printing a line per variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from custom_ops.triton_support import load_kernels

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said without its warning
    target, ptxas, problems = GPUTarget("cuda", arch, 32), _ptxas(), []
    for label, path, name, signature, constexprs, warps in variants():
        fn = getattr(load_kernels(path, False), name)
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                    options={"num_warps": warps})
        except Exception as e:  # a compile error is the finding
            problems.append(f"{label}: does not compile for sm_{arch}: {type(e).__name__}: {str(e).splitlines()[0]}")
            print(problems[-1], flush=True)
            continue
        registers = spill = "?"
        if ptxas is not None:
            with tempfile.TemporaryDirectory() as tmp:
                ptx = Path(tmp) / "kernel.ptx"
                ptx.write_text(kernel.asm["ptx"])
                report = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o", str(Path(tmp) / "k")],
                                        capture_output=True, text=True).stderr
            registers = (re.findall(r"Used (\d+) registers", report) or ["?"])[-1]
            spill = (re.findall(r"(\d+) bytes spill stores", report) or ["?"])[-1]
            if spill not in ("0", "?"):
                problems.append(f"{label}: spills {spill} bytes of registers on sm_{arch}")
        print(f"{label}: sm_{arch}, {warps} warps, {registers} registers, {spill} bytes spilled", flush=True)
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100, H200)")
    args = parser.parse_args(argv)
    problems = check(args.arch)
    if problems:
        print(f"{len(problems)} problem(s):\n" + "\n".join(problems), file=sys.stderr)
        return 1
    print("every Triton kernel variant compiles, none spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
