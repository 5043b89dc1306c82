"""The CPU kernel levels this machine supports (generic, avx2, avx512, avx512_bf16), lowest
first; the `cpu_level` fixture (tests/conftest.py) runs an op test once at each.

The compiled ops read GROUPBERT_CPU_CAPABILITY on every call, so a test that takes the
`cpu_level` fixture runs once per level in this process, each time through that level's
kernels: an AVX-512 CI machine tests the AVX2 and portable kernels too, and a CPU with
AVX512-BF16 tests the AVX-512 kernels without bf16 products at the avx512 level
(GROUPBERT_AMX=0 takes the AMX tiles out on a CPU that has them).
"""
from __future__ import annotations

from custom_ops import load_library, supported_cpu_capabilities

LEVELS = supported_cpu_capabilities() if load_library() else []
