"""`python -m custom_ops.triton_check`: every Triton kernel variant the product launches compiles
for an H100/H200 (sm_90) on this machine, with Triton's compiler and ptxas and no GPU, and none
spills registers: what would otherwise first show on a lent GPU."""
import importlib.util

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")]


def test_every_kernel_variant_compiles_for_sm90_without_spilling(capsys):
    from custom_ops.triton_check import check, variants

    assert check(90) == []
    lines = [line for line in capsys.readouterr().out.splitlines() if ": sm_90, " in line]
    assert len(lines) == len(list(variants())) >= 60, lines[:3]
    assert all(line.endswith(" 0 bytes spilled") for line in lines), [line for line in lines if "?" in line][:3]
