"""Process-wide settings that make a training step fast, applied once by the product's entry
point (bert.py) before any work, so that what the benchmarks measure is what users get
(bench/train_throughput.py and bench/step_profile.py apply the same). Torch-free: bert.py
applies them before it imports torch.
"""
from __future__ import annotations

__all__ = ["retain_freed_memory"]

# glibc's malloc serves blocks above its mmap threshold (at most 32 MiB, adjusted as blocks
# are freed) from fresh pages and returns them on free, so every training step faults in
# its large tensors again: the MLM logits and their gradient (640 x 30522 fp32, 78 MB each)
# cost 68 ms of page faults per allocation on the 2-core Zen 4 VM, against 8 ms to fill
# memory already held; a BERT step (hidden 256, 4 layers, batch 32) spends 10 % of its
# CPU time so. Raising both thresholds keeps freed memory for the next step.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def retain_freed_memory(threshold: int = 1 << 30) -> bool:
    """glibc's malloc keeps freed blocks up to `threshold` bytes for reuse (mallopt
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) instead of returning them to the system. The
    process then holds its peak memory. Returns whether it applied (False where the C
    library is not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, min(2 * threshold, 2**31 - 1)))
