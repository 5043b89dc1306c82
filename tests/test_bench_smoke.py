"""Every benchmark's --smoke mode runs (tiny sizes, seconds) and writes no results file, so a
broken import or a renamed key fails here rather than in the next full benchmark run."""
import subprocess
import sys

import pytest

from tests.tiny_runs import ROOT


def _results(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.json"))}


@pytest.mark.slow
def test_bench_squad_smoke(tmp_path):
    before = _results(ROOT / "bench/results")
    result = subprocess.run([sys.executable, str(ROOT / "bench/squad.py"), "--smoke", "--threads", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-4000:]
    assert "exact match: ours" in out and "F1: ours" in out and "within 2 points" in out, out[-2000:]
    assert "smoke: both sides trained 3 steps and were scored" in out
    assert _results(ROOT / "bench/results") == before, "--smoke writes no results file"
    assert not list(tmp_path.iterdir()), "--smoke leaves nothing behind"
