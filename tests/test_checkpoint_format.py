"""The checkpoint format (session/checkpoint.py): recorded in session.json, older formats
read and named, a newer one refused by name."""
import json
import re
import shutil
from pathlib import Path

import pytest

from bert.config import OLD_KEYS, load_config
from bert.tasks.pretraining import train
from session import checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "checkpoint_format2"


@pytest.mark.slow
@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_checkpoint_of_an_earlier_format_resumes_exactly(tmp_path, capsys, version):
    """A checkpoint written by earlier code, with its run's config.json and the metrics that
    run logged: format 2 (LAMB; commit eac6499, before checkpoints recorded their format) and
    format 3 (AdamW; commit ee209c5, before optimizers recorded their name and state kinds),
    checkpoint-20 of a demo-config run (model shrunk to hidden 32, 1 layer; 40 steps), their
    configs of version 1; format 4 (Lion; commit 8e7cba1, before each optimizer recorded its
    hyperparameters by its own names: Lion's β₁, β₂ as `betas`), checkpoint-3 of a 6-step
    synthetic run, its config of version 2 with every optimizer key written out (`epsilon` and
    `max_trust_ratio` too, which Lion never used). Resumed now, the following steps give the
    losses that run logged without interruption, it is named by its format, and new
    checkpoints record today's format with the optimizer's name and state kinds."""
    fixture = FIXTURES / f"checkpoint_format{version}"
    run = tmp_path / "run"
    shutil.copytree(fixture, run)
    raw = json.loads((run / "config.json").read_text())
    raw["training"]["output_dir"] = str(run)
    raw["data"]["directory"] = str(tmp_path / "demo_data")
    (run / "config.json").write_text(json.dumps(raw))
    (start,) = run.glob("checkpoint-*")
    resumed_at, steps = int(start.name.split("-")[1]), raw["training"]["steps"]
    result = train(load_config(run / "config.json"), checkpoint_input=str(start), progress=False)
    assert result.output_dir == run, "the run continues in place"
    out = capsys.readouterr().out
    assert f"{start} is in checkpoint format {version}" in out
    if version < 4:  # The run's config.json is version 1 (everything in `training`): its moves said in one line.
        moved = [line for line in out.splitlines() if "version-1 config" in line]
        assert len(moved) == 1 and moved[0].startswith(f"note: {run / 'config.json'} is a version-1 config, read as "
                                                       "version 3: "), out
        # Version 2's optimizer keys that version 3 names after the rule (LAMB's and AdamW's alike).
        renamed = {"optimizer.beta1": "optimizer.betas[0]", "optimizer.beta2": "optimizer.betas[1]",
                   "optimizer.epsilon": "optimizer.eps"}
        for key in raw["training"]:  # every key that moved is named, beside its new section
            new = OLD_KEYS.get(f"training.{key}")
            new = renamed.get(new, new)
            if new == "optimizer.max_trust_ratio" and raw["training"]["optimizer"] == "adamw":
                assert "max_trust_ratio" not in moved[0], "AdamW never used it; its default goes unsaid"
                continue
            assert new is None or (f"training.{key} → {new}" in moved[0] or re.search(
                rf"training\.\{{[^}}]*\b{key}\b[^}}]*\}} → {new.split('.')[0]}\.\*", moved[0])), (key, moved[0])
    else:  # version 2: Lion's keys keep their names, and those it never used held version 2's defaults
        assert "version-2 config" not in out, out
    before = {r["step"]: r for r in map(json.loads, (fixture / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    after = {r["step"]: r for r in result.metrics if "loss" in r}
    assert sorted(after) == list(range(resumed_at + 1, steps + 1))
    worst = max((abs(after[s][k] - before[s][k]) / abs(before[s][k]), s, k)
                for s in after for k in ("loss", "mlm_loss", "nsp_loss"))
    assert worst[0] <= 1e-6, f"step {worst[1]} {worst[2]}: relative difference {worst[0]:.3g}"
    written = json.loads((result.checkpoint / checkpoint.STATE_FILE).read_text())
    assert written["format"] == checkpoint.FORMAT == 5
    rule = raw["training"]["optimizer"] if version < 4 else raw["optimizer"]["name"]
    assert written["optimizer"]["optimizer"] == rule
    assert written["optimizer"]["state_kinds"] == (["exp_avg"] if rule == "lion" else ["exp_avg", "exp_avg_sq"])
    if rule == "lion":  # the pair recorded as `betas` is Lion's beta1 and beta2 again
        group = written["optimizer"]["param_groups"][0]
        assert (group["beta1"], group["beta2"], "betas" in group) == (0.95, 0.98, False), group


def _state(directory: Path) -> dict:
    return json.loads((directory / checkpoint.STATE_FILE).read_text())


def test_the_fixture_and_older_formats_parse_and_are_named():
    state = checkpoint.read_state(FIXTURE / "checkpoint-20")
    assert (state.format, state.step) == (2, 20) and "format 2" in state.old
    state3 = checkpoint.read_state(FIXTURES / "checkpoint_format3" / "checkpoint-20")
    assert (state3.format, state3.step) == (3, 20) and "format 3" in state3.old
    assert state3.optimizer["trust_ratio"] is False and "optimizer" not in state3.optimizer
    state4 = checkpoint.read_state(FIXTURES / "checkpoint_format4" / "checkpoint-3")
    assert (state4.format, state4.step) == (4, 3) and "format 4" in state4.old
    recorded = _state(FIXTURES / "checkpoint_format4" / "checkpoint-3")["optimizer"]["param_groups"][0]
    assert recorded["betas"] == [0.95, 0.98], "format 4 wrote Lion's two decays as one pair"
    group = state4.optimizer["param_groups"][0]
    assert (group["beta1"], group["beta2"], "betas" in group) == (0.95, 0.98, False), "read by Lion's own names"
    legacy = checkpoint.SessionState.from_json(
        {"step": 3, "loss_scale": 1.0, "loss_scale_clean_steps": 0, "torch_rng": [1, 2], "extra": {"m": 1}}, "x")
    assert legacy.format == 1 and legacy.files is None and "optimizer.pt" in legacy.old
    assert legacy.per_rank == [{"rng": {"cpu": [1, 2]}, "extra": {"m": 1}}]
    current = checkpoint.SessionState.from_json({**_state(FIXTURE / "checkpoint-20"), "format": checkpoint.FORMAT}, "x")
    assert current.old is None and current.to_json()["format"] == checkpoint.FORMAT


@pytest.mark.parametrize("raw, message", [
    ({"format": 99, "step": 1}, r"x is in checkpoint format 99, newer than this version reads \(1 to \d\)"),
    ({"format": "3", "step": 1}, r"checkpoint format '3'"),
    ({"format": 3, "step": "many", "loss_scale": 1, "loss_scale_clean_steps": 0}, r"x is not a session state"),
    ({"format": 3, "step": 1, "loss_scale": 1, "loss_scale_clean_steps": 0}, r"x names no weight and optimizer files"),
    ([1, 2], r"x holds a JSON list, not an object"),
    ({"format": 4, "step": 1, "loss_scale": 1, "loss_scale_clean_steps": 0, "files": {},
      "optimizer": {"optimizer": "lion", "param_groups": [{"betas": [0.9]}]}},
     r"x is not a session state .*Lion's betas"),
])
def test_unreadable_session_states_are_named(raw, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.SessionState.from_json(raw, "x")
