"""bench/finetune_parity.py's arithmetic, against the libraries: the difference's interval
(scipy's Welch test), the figures and one-class runs (scikit-learn, seqeval), and the kept
runs that let a killed measurement continue. Its --smoke runs in tests/test_bench_smoke.py."""
import json

import pytest
import scipy.stats

from tests.helpers import load_bench


@pytest.fixture(scope="module")
def parity():
    return load_bench("finetune_parity")


def test_welch_interval_is_scipys(parity):
    # The 40-step era accuracies of the first full run (4 seeds a side).
    ours, theirs = [0.5267, 0.5433, 0.5167, 0.5233], [0.5167, 0.5433, 0.5633, 0.5300]
    diff, low, high, df = parity.welch_interval(ours, theirs)
    test = scipy.stats.ttest_ind(ours, theirs, equal_var=False)
    interval = test.confidence_interval(0.95)
    assert diff == pytest.approx(0.5275 - 0.538325) and df == pytest.approx(test.df)
    assert (low, high) == (pytest.approx(interval.low), pytest.approx(interval.high))
    assert parity.welch_interval([0.5, 0.5], [0.25, 0.25])[1:3] == (0.25, 0.25)  # no spread: the difference alone


def test_figures_and_one_class_runs(parity):
    assert parity.score("classification", ["a", "b", "b", "b"], ["a", "b", "a", "b"]) == 0.75
    gold = [["B-LOC", "I-LOC", "O"], ["O", "B-ORG"]]
    assert parity.score("tokens", [["B-LOC", "I-LOC", "O"], ["O", "O"]], gold) == pytest.approx(2 / 3)
    all_o = [["O", "O", "O"], ["O", "O"]]
    assert parity.score("tokens", all_o, gold) == 0.0
    assert parity.degenerate(all_o) and parity.degenerate(["b"] * 4) and not parity.degenerate(["a", "b"])
    assert parity.top_share(["a", "b", "b", "b"]) == 0.75 and parity.classes(gold) == 4


def test_kept_runs_resume_only_the_same_measurement(parity, tmp_path, capsys):
    path, key = tmp_path / "finetune_parity.json.partial", {"start": "minilm", "warmup_steps": None, "commit": "abc"}
    first = parity.Progress(path, key)
    assert first.get("tokens", 150, 0) is None
    first.put("tokens", 150, 0, {"product": {"figure": 0.8}, "transformers": {"figure": 0.87}})
    again = parity.Progress(path, key)
    assert again.resumed == 1 and again.get("tokens", 150, 0)["transformers"]["figure"] == 0.87
    assert "resuming: 1 finished pair(s) of runs kept" in capsys.readouterr().out
    other = parity.Progress(path, {**key, "commit": "def"})  # another commit's runs are not this one's
    assert other.resumed == 0 and other.get("tokens", 150, 0) is None
    assert "starting again" in capsys.readouterr().out
    assert json.loads(path.read_text())["key"] == key
    again.finish()
    assert not path.exists()
