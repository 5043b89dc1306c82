"""Runs an op test at every CPU kernel level this machine supports (generic, avx2, avx512).

The compiled ops read GROUPBERT_CPU_CAPABILITY on every call, so a test that takes the
`cpu_level` fixture runs once per level in this process, each time through that level's
kernels: an AVX-512 CI machine tests the AVX2 and portable kernels too.
"""
from __future__ import annotations

import pytest
import torch

from custom_ops import library_status, load_library, supported_cpu_capabilities

LEVELS = supported_cpu_capabilities() if load_library() else []


@pytest.fixture(params=LEVELS or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"compiled ops unavailable: {library_status()}"))])
def cpu_level(request, monkeypatch) -> str:
    monkeypatch.setenv("GROUPBERT_CPU_CAPABILITY", request.param)
    assert torch.ops.groupbert.cpu_capability() == request.param, "the level did not take effect"
    return request.param
