"""`make squad-demo` and the README's SQuAD commands, run as written (steps capped) from a
fresh directory: the generated files are the fine-tuning tests' own (data/squad_demo.py),
deterministic, in v1.1 and v2.0 form, never written over a user's files, and the
fine-tune → --eval-only → --export → infer.py chain agrees on the scores."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from data.squad import load_squad
from data.squad_demo import as_v2, build, write_squad_demo
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)

STEPS = ["--training.steps", "8", "--training.warmup_steps", "2"]  # the cap on the README's training runs


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


def _readme_squad_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## SQuAD fine-tuning"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_squad_commands_run_as_written_after_make_squad_demo(tmp_path, monkeypatch, capsys):
    import infer

    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the README's paths are the repository's
    monkeypatch.chdir(tmp_path)
    commands = _readme_squad_commands()
    assert commands[0] == "make squad-demo"
    outputs = []
    for line in commands:
        argv = shlex.split(line, comments=True)
        if argv[0] == "make":  # `ops` is built already (the suite's custom-op tests need it)
            result = subprocess.run(["make", "-f", str(ROOT / "Makefile"), "-o", "ops", f"PYTHON={sys.executable}",
                                     *argv[1:]], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                                    text=True, timeout=600)
            assert result.returncode == 0, f"{line}\n{(result.stdout + result.stderr)[-3000:]}"
            outputs.append(result.stdout)
            continue
        assert argv[0] == "python" and argv[1] in ("bert.py", "infer.py"), line
        if argv[1] == "bert.py":  # bert.py's and infer.py's main, in this process (one torch import)
            code = bert_cli()(argv[2:] + (STEPS if "--checkpoint-input" not in argv else []))
        else:
            code = infer.main([*argv[2:], "--no-progress"])
        out, err = capsys.readouterr()
        assert code == 0, f"{line}\n{(out + err)[-3000:]}"
        outputs.append(out)
    run = tmp_path / "runs/squad_tiny"
    trained = json.loads((run / "eval_results.json").read_text())
    scored = json.loads((tmp_path / "runs/squad_tiny.1/eval_results.json").read_text())  # --eval-only's directory
    served = json.loads(outputs[4].splitlines()[-1])  # infer.py's scores
    assert scored["f1"] == trained["f1"] and scored["exact_match"] == trained["exact_match"]
    assert served == {k: round(trained[k], 4) for k in ("exact_match", "f1")}
    v2 = json.loads((tmp_path / "runs/squad_tiny_v2/eval_results.json").read_text())
    assert {"exact", "f1", "NoAns_total", "null_threshold", "best_f1"} <= set(v2)
