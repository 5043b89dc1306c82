"""Builds the compiled custom ops during `pip install` (editable or not).

The build is the one `make ops` runs: CMake + Ninja into custom_ops/lib/, against the
torch installed in the target environment. pip builds in an isolated environment
without that torch, so when torch is not importable here its location is asked of the
same interpreter with pip's isolation variables removed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Variables pip sets to hide the target environment's packages from the build.
_ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE")


def torch_cmake_prefix() -> str:
    """torch.utils.cmake_prefix_path of the target environment's torch."""
    query = "import torch; print(torch.utils.cmake_prefix_path)"
    try:
        import torch

        return torch.utils.cmake_prefix_path
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in _ISOLATION_VARIABLES}
    found = subprocess.run([sys.executable, "-c", query], env=env, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(
            "building the GroupBERT custom ops needs torch installed first: run `make setup` "
            "(or `pip install torch==2.13.0`), then `pip install -e .` again")
    return found.stdout.strip()


class BuildOpsThenPy(build_py):
    """Runs the CMake build of custom_ops/lib/libgroupbert_ops.so, then build_py."""

    def run(self) -> None:
        build_dir = ROOT / "build" / "pip"
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        f"-DGROUPBERT_OPS_OUTPUT_DIR={ROOT / 'custom_ops' / 'lib'}",
                        f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_PREFIX_PATH={torch_cmake_prefix()}"],
                       check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel"], check=True)
        super().run()


setup(cmdclass={"build_py": BuildOpsThenPy})
