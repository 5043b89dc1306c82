"""Every benchmark's --smoke mode runs (tiny sizes, seconds) and writes no results file, so a
broken import or a renamed key fails here rather than in the next full benchmark run."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_ops_smoke(tmp_path):
    # bench/ops.py: the compiled conv and LAMB against torch at every kernel level this CPU
    # runs, each level in child processes with both sides capped (about 10 s of CPU each).
    from custom_ops import library_status, load_library, supported_cpu_capabilities

    if not load_library():
        pytest.skip(f"compiled ops unavailable: {library_status()}")
    results = ROOT / "bench" / "results"
    before = {p.name: p.read_bytes() for p in sorted(results.glob("*.json"))}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ops.py"), "--smoke"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    table = out[out.rindex("bf16 kernel"):]
    for level in supported_cpu_capabilities() + ["native"]:
        assert f"\n{level} " in table, f"no row for level {level}:\n{table}"
        assert f"=== grouped_conv1d at level {level} (smoke" in out and f"=== LAMB step at level {level} (smoke" in out
    if "avx512_bf16" in supported_cpu_capabilities():
        row = next(line for line in table.splitlines() if line.startswith("avx512_bf16 "))
        assert row.endswith("avx512_bf16 dot products (vdpbf16ps)"), row
    assert "smoke run: no results file written" in out
    assert {p.name: p.read_bytes() for p in sorted(results.glob("*.json"))} == before, "--smoke wrote a results file"
    assert not list(tmp_path.iterdir()), "--smoke left files behind"
