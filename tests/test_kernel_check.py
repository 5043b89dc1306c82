"""The known-answer runs of the compiled ops' instruction-set paths (custom_ops/csrc/kernel_check.cpp).

Before a path (a vector level above generic, or the AMX tiles) is first used, a tiny
convolution and LAMB step with an exact answer runs through its kernels in a forked child;
a child killed by a signal or a wrong answer takes the path out for the process, the next
level down runs, and one `note:` line says why. Each test runs in a fresh interpreter (the
outcome is kept for the process), with GROUPBERT_KERNEL_CHECK_FAULT making the child of a
named path raise SIGILL ("avx512") or compute a wrong answer ("avx512:wrong").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from custom_ops import library_status, load_library
from tests.ops_levels import LEVELS

ROOT = Path(__file__).resolve().parents[1]
requires_ops = pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")

# A fresh process: its level, its AMX state, its checks, and a bf16 and an fp32 convolution
# against F.conv1d (the op must still compute right on whatever level it fell back to).
PROBE = """
import json, torch, torch.nn.functional as F
import custom_ops
from custom_ops.grouped_conv1d import grouped_conv1d
custom_ops.load_library(required=True)
level = custom_ops.cpu_capability()
errors = {}
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 37, 48).to(dtype)
    w = (torch.randn(48, 16, 7) / 11).to(dtype)
    got = grouped_conv1d(x, w).double()
    want = F.conv1d(x.double().transpose(1, 2), w.double(), padding=3, groups=3).transpose(1, 2)
    errors[str(dtype)] = ((got - want).abs().max() / want.abs().max()).item()
print(json.dumps({"level": level, "amx": torch.ops.groupbert.amx_state(),
                  "checks": list(torch.ops.groupbert.kernel_checks()), "errors": errors}))
"""


def probe(**env: str) -> tuple[dict, list[str]]:
    """The fresh process's report and its stderr lines."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("GROUPBERT_CPU_CAPABILITY", "GROUPBERT_AMX", "GROUPBERT_KERNEL_CHECK_FAULT")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**environment, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["errors"]["torch.float32"] < 1e-5 and report["errors"]["torch.bfloat16"] < 2e-2, report
    return report, [line for line in done.stderr.splitlines() if line.strip()]


@requires_ops
def test_the_level_in_use_passed_its_run_and_says_nothing():
    report, stderr = probe()
    assert report["level"] == LEVELS[-1], report
    if report["level"] != "generic":  # generic is baseline code: nothing to check
        assert report["checks"] == [f"{report['level']}: passed"], report
    assert not [line for line in stderr if line.startswith("note:")], stderr


@requires_ops
@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU runs the generic kernels only")
@pytest.mark.parametrize("fault, why", [("", "was killed by SIGILL (Illegal instruction)"),
                                        (":wrong", "computed a wrong answer: an injected wrong answer "
                                                   "(GROUPBERT_KERNEL_CHECK_FAULT)")],
                         ids=["signal", "wrong-answer"])
def test_a_failing_level_falls_back_with_one_note(fault, why):
    best, next_down = LEVELS[-1], LEVELS[-2]
    report, stderr = probe(GROUPBERT_KERNEL_CHECK_FAULT=best + fault)
    assert report["level"] == next_down, report
    assert report["checks"] == [f"{level}: passed" for level in [next_down] if level != "generic"] + [
        f"{best}: failed: {why}"], report
    notes = [line for line in stderr if line.startswith("note:")]
    assert notes == [f"note: the {best} kernels failed their known-answer run: a child process running them {why}; "
                     f"the compiled ops fall back to the {next_down} level"], stderr


@requires_ops
@pytest.mark.skipif(len(LEVELS) < 3, reason="this CPU runs fewer than two levels above generic")
def test_every_failing_level_falls_back_in_turn():
    failing = LEVELS[1:]
    report, stderr = probe(GROUPBERT_KERNEL_CHECK_FAULT=",".join(failing))
    assert report["level"] == "generic", report
    assert len([line for line in stderr if line.startswith("note:")]) == len(failing), stderr


@requires_ops
@pytest.mark.skipif(len(LEVELS) < 3, reason="this CPU runs fewer than two levels above generic")
def test_a_forced_lower_level_checks_only_that_level():
    # GROUPBERT_CPU_CAPABILITY=avx2 on an AVX-512 CPU: a faulting avx512 is never run.
    report, stderr = probe(GROUPBERT_CPU_CAPABILITY=LEVELS[1], GROUPBERT_KERNEL_CHECK_FAULT=LEVELS[-1])
    assert report["level"] == LEVELS[1] and report["checks"] == [f"{LEVELS[1]}: passed"], report
    assert not [line for line in stderr if line.startswith("note:")], stderr


@requires_ops
def test_amx_state_names_the_reason():
    report, _ = probe(GROUPBERT_AMX="0")
    assert report["amx"] == "off: GROUPBERT_AMX=0 turns the tiles off"
    report, _ = probe(GROUPBERT_AMX="emulate")
    assert report["amx"] == "emulated (GROUPBERT_AMX=emulate)"
    report, _ = probe()
    features = torch.ops.groupbert.cpu_features().split()
    if "amx-bf16" not in features:
        assert report["amx"] in ("off: this CPU has no AMX-BF16",
                                 "off: Linux did not grant this process the AMX tile state (arch_prctl)",
                                 "off: this library has no hardware AMX kernels (another architecture, or built with "
                                 "GROUPBERT_X86_VARIANTS=OFF)"), report
    else:
        assert report["amx"] == "hardware" and "amx: passed" in report["checks"], report


@requires_ops
def test_failing_amx_tiles_fall_back_with_one_note():
    state = torch.ops.groupbert.amx_state()
    if state != "hardware":
        pytest.skip(f"AMX tiles {state}")
    report, stderr = probe(GROUPBERT_KERNEL_CHECK_FAULT="amx")
    assert report["amx"] == "off: the tiles failed their known-answer run", report
    notes = [line for line in stderr if line.startswith("note:")]
    assert notes == ["note: the amx kernels failed their known-answer run: a child process running them was killed by "
                     f"SIGILL (Illegal instruction); bf16 convolutions run the {report['level']} kernels instead"], stderr
