"""Finds, checks and loads custom_ops/lib/libgroupbert_ops.so."""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Callable

# The ONNX domain of every custom node the builder emits (one place).
DOMAIN = "ai.groupbert"
DOMAIN_VERSION = 1
GROUPED_CONV1D = "GroupedConv1d"
# The compiled kernels keep a group's channels in registers: C may be at most this
# (kMaxChannelsPerGroup in csrc/grouped_conv1d_cpu.h; configs are checked against it).
MAX_CHANNELS_PER_GROUP = 64

_HERE = Path(__file__).resolve().parent
# GROUPBERT_OPS_LIB points at a library built elsewhere (`make OPS_LIB_DIR=...`).
LIBRARY_PATH = Path(os.environ.get("GROUPBERT_OPS_LIB", _HERE / "lib" / "libgroupbert_ops.so"))


def _sources() -> list[Path]:
    """What the build compiles: C++ sources and headers, CUDA sources only for a CUDA torch."""
    import torch

    patterns = ["*.cpp", "*.h"] + (["*.cu", "*.cuh"] if torch.version.cuda else [])
    return sorted(p for pattern in patterns for p in (_HERE / "csrc").glob(pattern)) + [_HERE / "CMakeLists.txt"]


def library_status() -> str | None:
    """None when the compiled library is present and newer than every source, else why not."""
    if not LIBRARY_PATH.exists():
        return f"{LIBRARY_PATH} is missing; run `make` at the repository root"
    built = LIBRARY_PATH.stat().st_mtime
    stale = [s.name for s in _sources() if s.stat().st_mtime > built]
    if stale:
        return f"{LIBRARY_PATH.name} is older than {', '.join(stale)}; run `make` to rebuild it"
    return None


def cpu_capability() -> str | None:
    """The CPU kernel level the compiled ops run now: "generic", "avx2", "avx512" or
    "avx512_bf16" (avx512 plus AVX512-BF16 dot products for the bf16 convolution).

    The best this CPU supports, lowered by GROUPBERT_CPU_CAPABILITY (read on every call)
    to test or benchmark a lower level (avx512 on an AVX512-BF16 CPU: the AVX-512 kernels
    without bf16 products); None when the library is not built.
    """
    if not load_library():
        return None
    import torch

    return torch.ops.groupbert.cpu_capability()


def supported_cpu_capabilities() -> list[str]:
    """Every kernel level this machine can run, lowest first (empty without the library)."""
    if not load_library():
        return []
    import torch

    return list(torch.ops.groupbert.cpu_capabilities())


@functools.cache
def load_library(required: bool = False) -> bool:
    """Load the compiled ops into torch.ops.groupbert once.

    Returns False (after one warning) when the library is missing or stale, so callers
    fall back to the pure-torch versions; raises instead when `required`.
    """
    problem = library_status()
    if problem is None:
        import torch

        torch.ops.load_library(str(LIBRARY_PATH))
        return True
    if required:
        raise RuntimeError(f"compiled custom ops unavailable: {problem}")
    warnings.warn(f"compiled custom ops unavailable, using pure-torch fallbacks: {problem}", stacklevel=2)
    return False


def loader_with_fakes(register_fakes: Callable[[], None]) -> Callable[[], bool]:
    """An op module's `compiled()`: loads the library on first use (not at import) and then
    registers the module's fake kernels, once; False when the library is not built."""

    @functools.cache
    def compiled() -> bool:
        if not load_library():
            return False
        register_fakes()
        return True

    return compiled
