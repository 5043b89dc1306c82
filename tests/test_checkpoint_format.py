"""The checkpoint format (session/checkpoint.py): recorded in session.json, older formats
read and named, a newer one refused by name."""
import json
import shutil
from pathlib import Path

import pytest

from bert.config import config_from_dict
from bert.train import train
from session import checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_format2"


@pytest.mark.slow
def test_a_checkpoint_written_before_formats_were_recorded_resumes_exactly(tmp_path, capsys):
    """checkpoint-20 of a demo-config run (model shrunk to hidden 32, 1 layer; 40 steps; a
    metrics record per step) written by the code before checkpoints recorded their format
    (commit eac6499): resumed now, steps 21-40 give the losses that run logged without
    interruption, it is named as format 2, and new checkpoints record today's format."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    raw = json.loads((run / "config.json").read_text())
    raw["training"]["output_dir"] = str(run)
    raw["data"]["directory"] = str(tmp_path / "demo_data")
    (run / "config.json").write_text(json.dumps(raw))
    result = train(config_from_dict(raw), checkpoint_input=str(run / "checkpoint-20"), progress=False)
    assert result.output_dir == run, "the run continues in place"
    assert f"{run / 'checkpoint-20'} is in checkpoint format 2" in capsys.readouterr().out
    before = {r["step"]: r for r in map(json.loads, (FIXTURE / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    after = {r["step"]: r for r in result.metrics if "loss" in r}
    assert sorted(after) == list(range(21, 41))
    worst = max((abs(after[s][k] - before[s][k]) / abs(before[s][k]), s, k)
                for s in after for k in ("loss", "mlm_loss", "nsp_loss"))
    assert worst[0] <= 1e-6, f"step {worst[1]} {worst[2]}: relative difference {worst[0]:.3g}"
    assert json.loads((result.checkpoint / checkpoint.STATE_FILE).read_text())["format"] == checkpoint.FORMAT


def _state(directory: Path) -> dict:
    return json.loads((directory / checkpoint.STATE_FILE).read_text())


def test_the_fixture_and_older_formats_parse_and_are_named():
    state = checkpoint.read_state(FIXTURE / "checkpoint-20")
    assert (state.format, state.step) == (2, 20) and "format 2" in state.old
    legacy = checkpoint.SessionState.from_json(
        {"step": 3, "loss_scale": 1.0, "loss_scale_clean_steps": 0, "torch_rng": [1, 2], "extra": {"m": 1}}, "x")
    assert legacy.format == 1 and legacy.files is None and "optimizer.pt" in legacy.old
    assert legacy.per_rank == [{"rng": {"cpu": [1, 2]}, "extra": {"m": 1}}]
    current = checkpoint.SessionState.from_json({**_state(FIXTURE / "checkpoint-20"), "format": checkpoint.FORMAT}, "x")
    assert current.old is None and current.to_json()["format"] == checkpoint.FORMAT


@pytest.mark.parametrize("raw, message", [
    ({"format": 99, "step": 1}, r"x is in checkpoint format 99; this version reads formats 1 to \d"),
    ({"format": "3", "step": 1}, r"checkpoint format '3'"),
    ({"format": 3, "step": "many", "loss_scale": 1, "loss_scale_clean_steps": 0}, r"x is not a session state"),
    ({"format": 3, "step": 1, "loss_scale": 1, "loss_scale_clean_steps": 0}, r"x names no weight and optimizer files"),
    ([1, 2], r"x holds a JSON list, not an object"),
])
def test_unreadable_session_states_are_named(raw, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.SessionState.from_json(raw, "x")
