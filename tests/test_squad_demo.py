"""`make squad-demo`'s files are the fine-tuning tests' own (data/squad_demo.py),
deterministic, in v1.1 and v2.0 form, and never written over a user's files; after
docs/finetuning.md's SQuAD commands ran as written (tests/test_docs.py, steps capped), the
fine-tune → eval → export → infer.py chain agrees on the scores (`check_squad_demo`)."""
import json

import pytest

from data.squad import load_squad
from data.squad_demo import as_v2, build, write_squad_demo
from tests.tiny_runs import one_thread  # noqa: F401 (an autouse fixture)


def test_demo_files_are_deterministic_v1_and_v2_and_never_overwrite_a_users_files(tmp_path):
    first = build(tmp_path / "a")
    assert "433 questions" in first and "(66)" in first
    write_squad_demo(tmp_path / "b")
    for name in ("train.json", "dev.json", "vocab.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert "there already" in build(tmp_path / "a")
    for split in ("train", "dev"):
        v1, v2 = load_squad(tmp_path / "a" / f"{split}.json"), load_squad(tmp_path / "a" / f"{split}-v2.0.json")
        paragraphs = len(json.loads((tmp_path / "a" / f"{split}.json").read_text())["data"][0]["paragraphs"])
        assert not v1.version_2 and v2.version_2 and len(v2.unanswerable) == paragraphs
        assert len(v2.examples) == len(v1.examples) + paragraphs
        blob = json.loads((tmp_path / "a" / f"{split}.json").read_text())
        assert json.loads((tmp_path / "a" / f"{split}-v2.0.json").read_text()) == as_v2(blob)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.json").write_text("the user's")
    with pytest.raises(ValueError, match=r"train.json exists but .*squad_demo.json does not"):
        build(mine)
    assert (mine / "train.json").read_text() == "the user's" and sorted(p.name for p in mine.iterdir()) == [
        "train.json"]


def check_squad_demo(ran) -> None:
    """After docs/finetuning.md ran (tests/test_docs.py): the SQuAD block's fine-tune → eval →
    export → infer.py chain agrees on the scores, and the v2.0 run reports v2.0's; the labelled
    demo runs report their tasks' figures, and `bert.py eval` of the classifier its run's."""
    (block,) = [r for r in ran if r.block.text.startswith("make squad-demo\n")]
    root = block.sandbox
    trained = json.loads((root / "runs/squad_tiny/eval_results.json").read_text())
    scored = json.loads((root / "runs/squad_tiny/eval-checkpoint-final/eval_results.json").read_text())  # eval's
    served = [json.loads(line) for line in block.output.splitlines() if line.startswith('{"exact_match"')]
    assert scored["f1"] == trained["f1"] and scored["exact_match"] == trained["exact_match"]
    assert served == [{k: round(trained[k], 4) for k in ("exact_match", "f1")}], block.output[-3000:]
    v2 = json.loads((root / "runs/squad_tiny_v2/eval_results.json").read_text())
    assert {"exact", "f1", "NoAns_total", "null_threshold", "best_f1"} <= set(v2)
    (labelled,) = [r for r in ran if r.block.text.startswith("MINILM=")]
    runs = labelled.sandbox / "runs"
    era = json.loads((runs / "classify_demo/eval_results.json").read_text())
    assert {"accuracy", "f1", "matthews_correlation"} <= set(era), era
    assert json.loads((runs / "classify_demo/eval-checkpoint-final/eval_results.json").read_text()) == era
    assert {"accuracy", "f1"} <= set(json.loads((runs / "pairs_demo/eval_results.json").read_text()))
    assert {"f1", "precision", "recall"} <= set(json.loads((runs / "tokens_demo/eval_results.json").read_text()))
    (serving,) = [r for r in ran if "--task classify --score" in r.block.text]
    fp32, int8 = [json.loads(line) for line in serving.output.splitlines() if line.startswith('{"accuracy"')]
    assert fp32 == pytest.approx({**{k: v for k, v in era.items() if k != "dev_file"}, "rows": 300}, abs=1e-6), \
        "the served export scores the run's own dev figures"
    assert set(int8) == set(fp32) and int8["rows"] == 300
    assert "The Congress met in Washington in December" in serving.output
