"""One writer per run directory, and a resume that loses nothing (bert/run/rundir.py).

Two processes that meet one run — two resumes started at once (two `--checkpoint-input
auto`, or the same checkpoint twice), two fresh runs of one output_dir — never both
write it: the second is refused with one line naming the holder, or takes the next free
`runs/<name>.N`. A lock left by a killed holder blocks nothing. A continued run rebuilds
its metrics history by writing a new file and renaming it, so every record of the earlier
run survives, byte for byte, under `metrics.before-resume-<step>.jsonl`, and a reader of
the old file keeps it whole. Checkpoints without checksums, full disks and unwritable
places each end in one line that says what is there and what to do.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bert.run.claim import claim_fresh
from bert.run.rundir import (LOCK_FILE, METRICS_FILE, RunPlan, claim, configured_output_dir, newest_checkpoint,
                             prepare_run_dir, read_history)
from bert.tasks.pretraining import train
from session import checkpoint as checkpoints
from tests.test_faults_runs import snapshot
from tests.test_training import ROOT, run_config


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, **kwargs)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


HOLD = ("import sys, time; from pathlib import Path; from bert.run.rundir import claim; "
        "held = claim(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")


# ------------------------------------------------------------------ the claim
def test_a_second_claim_is_refused_naming_the_holder_and_the_lock_goes_with_the_run(tmp_path):
    run = tmp_path / "run"
    held = claim(run)
    record = json.loads((run / LOCK_FILE).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    with pytest.raises(ValueError, match=rf"^{run} is in use by another run \(host {socket.gethostname()}, pid "
                                         rf"{os.getpid()}, since .*\); wait for it to end or stop it") as error:
        claim(run)
    assert "\n" not in str(error.value)
    held.release()
    assert not run.exists(), "a directory claimed and left empty is removed with the claim"
    (run / "x").parent.mkdir()
    (run / "x").write_text("a file of the run")
    with claim(run) as again:
        assert again.stale is None
    assert sorted(p.name for p in run.iterdir()) == ["x"], "the lock file is removed, the run's files stay"


def test_a_lock_left_by_a_killed_holder_is_stale_and_blocks_nothing(tmp_path):
    run = tmp_path / "run"
    holder = _python(HOLD, str(run))
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        with pytest.raises(ValueError, match=rf"in use by another run \(host \S+, pid {holder.pid}, since"):
            claim(run)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    finally:
        _kill(holder)
    assert str(holder.pid) in (run / LOCK_FILE).read_text(), "SIGKILL left its record behind"
    with claim(run) as held:
        assert f"pid {holder.pid}" in held.stale
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_fresh_runs_started_together_take_distinct_directories(tmp_path):
    """Six processes claim a fresh directory of one output_dir at the same moment."""
    cfg = run_config(tmp_path)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    go = tmp_path / "go"
    code = ("import sys, time; from pathlib import Path; from bert import load_config; "
            "from bert.run.rundir import configured_output_dir; from bert.run.claim import claim_fresh; "
            "config = load_config(sys.argv[1]); go = Path(sys.argv[2])\n"
            "while not go.exists(): time.sleep(0.001)\n"
            "held = claim_fresh(configured_output_dir(config)); (held.directory / 'mine').write_text('x'); print(held.directory, flush=True); "
            "time.sleep(3); held.release()")
    processes = [_python(code, str(path), str(go)) for _ in range(6)]
    try:
        time.sleep(2)  # every process is waiting for the start
        go.write_text("")
        taken = [p.communicate(timeout=120)[0].strip() for p in processes]
    finally:
        for p in processes:
            _kill(p)
    assert all(p.returncode == 0 for p in processes), [p.stderr.read() for p in processes]
    names = sorted(Path(t).name for t in taken)
    assert names == ["run", "run.1", "run.2", "run.3", "run.4", "run.5"], taken


def test_an_unwritable_place_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=rf"^cannot create the run directory {blocker}/run \(Not a directory\)"):
        claim(blocker / "run")
    with pytest.raises(ValueError, match=rf"training.output_dir {blocker} is a file, not a directory"):
        claim(blocker)
    cfg = run_config(tmp_path, training=dict(output_dir=str(blocker / "run")))
    with pytest.raises(ValueError, match="cannot create the run directory"):
        train(cfg, progress=False)
    assert blocker.read_text() == "not a directory"


def test_a_read_only_disk_and_a_foreign_lock_file_are_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / LOCK_FILE).mkdir(parents=True)  # something else under the lock's name
    with pytest.raises(ValueError, match=rf"^cannot claim the run directory {run}: {run / LOCK_FILE}: Is a directory; "
                                         "remove it if it is no run's lock$"):
        claim(run)
    (run / LOCK_FILE).rmdir()
    opened = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return opened(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=rf"{run / LOCK_FILE}: Read-only file system; choose a training.output_dir"):
        claim(run)
    assert sorted(run.iterdir()) == [], "nothing was written"


# ------------------------------------------------------------ metrics history
def _records(path: Path, steps, torn: str = "") -> bytes:
    text = "".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in steps) + torn
    path.write_text(text)
    return text.encode()


def test_a_continued_run_keeps_every_earlier_record_and_never_shortens_a_file(tmp_path):
    cfg = run_config(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    metrics = out / METRICS_FILE
    before = _records(metrics, range(1, 7), torn='{"step": 7, "lo')  # the writer died mid-record
    reader = open(metrics, "rb")  # e.g. `tail -f`, or a dashboard
    plan = RunPlan(out, out / "checkpoint-4", 4)
    prepare_run_dir(plan, cfg)
    keep = out / "metrics.before-resume-4.jsonl"
    assert keep.read_bytes() == before and os.fstat(reader.fileno()).st_ino == keep.stat().st_ino
    assert reader.read() == before, "a reader of the earlier file reads it whole"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    # The continued run goes on to step 6 and dies again; it resumes from the same checkpoint.
    with open(metrics, "a") as f:
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (5, 6)))
    second = metrics.read_bytes()
    prepare_run_dir(plan, cfg)
    assert keep.read_bytes() == before, "the first history is never replaced"
    assert (out / "metrics.before-resume-4.2.jsonl").read_bytes() == second
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    # Nothing past the checkpoint: the file is kept all the same, under the next free name.
    third = _records(metrics, range(1, 5))
    prepare_run_dir(plan, cfg)
    assert (out / "metrics.before-resume-4.3.jsonl").read_bytes() == metrics.read_bytes() == third


def test_a_damaged_history_is_named_and_nothing_changes(tmp_path):
    cfg = run_config(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    before = snapshot(out)
    with pytest.raises(ValueError, match=rf"{out / METRICS_FILE}, line 2 is not a metrics record"):
        prepare_run_dir(RunPlan(out, out / "checkpoint-2", 2), cfg)
    assert snapshot(out) == before
    (out / METRICS_FILE).write_text('{"step": 1}\n{"step": true}\n')
    with pytest.raises(ValueError, match="line 2 is not a metrics record"):
        read_history(out / METRICS_FILE, 2)


# ------------------------------------------------------- two resumes at once
def _start(config: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "bert.py", "--config", str(config), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait(condition, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _training_steps(path: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture
def killed_run(tmp_path):
    """A long run killed by SIGKILL after its checkpoint at step 4 and a few steps more: its
    lock file is left behind, its metrics hold records past its newest checkpoint."""
    cfg = run_config(tmp_path, training=dict(steps=100000, checkpoint_every=4))
    path = tmp_path / "long.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    run = tmp_path / "run"
    first = _start(path)
    try:
        _wait(lambda: (run / METRICS_FILE).exists() and len(_training_steps(run / METRICS_FILE)) >= 10, first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        _kill(first)
    assert (run / LOCK_FILE).exists()
    recorded = max(_training_steps(run / METRICS_FILE))
    for checkpoint in run.glob("checkpoint-*"):  # killed before a checkpoint of its last step was written
        if checkpoints.read_state(checkpoint).step >= recorded:
            shutil.rmtree(checkpoint)
    return path, run, first.pid


@pytest.mark.slow
@pytest.mark.parametrize("how", ["auto", "the same checkpoint"])
def test_two_resumes_started_at_once_one_runs_the_other_is_refused_and_nothing_is_lost(killed_run, how):
    path, run, killed = killed_run
    newest = newest_checkpoint(run)
    step = checkpoints.read_state(newest).step
    before = (run / METRICS_FILE).read_bytes()
    assert max(_training_steps(run / METRICS_FILE)) > step, "records past the checkpoint"
    argument = "auto" if how == "auto" else str(newest)
    both = [_start(path, "--checkpoint-input", argument) for _ in range(2)]
    try:
        deadline = time.monotonic() + 240
        while all(p.poll() is None for p in both):
            assert time.monotonic() < deadline, "neither was refused"
            time.sleep(0.1)
        loser = next(p for p in both if p.poll() is not None)
        winner = next(p for p in both if p is not loser)
        _, err = loser.communicate()
        assert loser.returncode == 2, err
        assert err.strip().startswith(f"error: {run} is in use by another run (host {socket.gethostname()}, pid "
                                      f"{winner.pid}, since ") and len(err.strip().splitlines()) == 1, err
        kept = run / f"metrics.before-resume-{step}.jsonl"
        _wait(lambda: kept.exists() and max(_training_steps(run / METRICS_FILE)) >= step + 2, winner)
        winner.send_signal(signal.SIGTERM)
        out, err = winner.communicate(timeout=120)
    finally:
        for p in both:
            _kill(p)
    assert winner.returncode == 143, err
    assert f"resuming from {newest}" in out or how != "auto", out
    assert f"{run / LOCK_FILE} was left by a run that ended without releasing it (host {socket.gethostname()}, pid " \
           f"{killed}" in out, out
    assert kept.read_bytes() == before, "every record of the earlier run survives, byte for byte"
    assert sorted(p.name for p in run.glob("metrics.*")) == [kept.name, METRICS_FILE]
    now = (run / METRICS_FILE).read_text().splitlines()
    earlier = [line for line in before.decode().splitlines() if json.loads(line)["step"] <= step]
    assert now[: len(earlier)] == earlier, "the history up to the checkpoint, as it was"
    steps = _training_steps(run / METRICS_FILE)
    assert steps == list(range(1, max(steps) + 1)), "one writer: every step once, in order"
    assert not (run / LOCK_FILE).exists(), "the winner released its claim"


@pytest.mark.slow
def test_two_fresh_runs_of_one_output_dir_started_together_write_apart(tmp_path):
    cfg = run_config(tmp_path, training=dict(steps=3))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    both = [_start(path) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=300) for p in both]
    finally:
        for p in both:
            _kill(p)
    assert [p.returncode for p in both] == [0, 0], outputs
    dirs = sorted(out.splitlines()[0] for out, _ in outputs)
    assert dirs == [f"output_dir: {tmp_path / 'run'}", f"output_dir: {tmp_path / 'run.1'}"], outputs
    for name in ("run", "run.1"):
        assert _training_steps(tmp_path / name / METRICS_FILE) == [1, 2, 3]


# ------------------------------------------------- checksums, disks, messages
@pytest.fixture
def short_run(tmp_path):
    cfg = run_config(tmp_path, training=dict(steps=4, checkpoint_every=2))
    return cfg, train(cfg, progress=False).output_dir


def test_auto_names_checkpoints_without_checksums_instead_of_starting_afresh(short_run, capsys):
    cfg, run = short_run
    for name in ("checkpoint-2", "checkpoint-final"):
        (run / name / checkpoints.CHECKSUMS_FILE).unlink()
    before = snapshot(run.parent)
    with pytest.raises(ValueError, match=rf"{run} holds 2 checkpoint directories but none that verifies \(checkpoint "
                                         rf"{run}/checkpoint-2 has no checksums.json: .*\): resume from a good copy "
                                         "with --checkpoint-input, start from its weights with --training.init_from"):
        train(cfg, checkpoint_input="auto", progress=False)
    assert snapshot(run.parent) == before, "nothing written, no runs/<name>.1 started"
    (run / "checkpoint-final").rename(run.parent / "aside")
    with pytest.raises(ValueError, match=rf"{run} holds 1 checkpoint directory but none that verifies"):
        train(cfg, checkpoint_input="auto", progress=False)


def test_auto_notes_a_newer_checkpoint_that_does_not_verify(short_run, capsys):
    cfg, run = short_run
    (run / "checkpoint-final" / checkpoints.CHECKSUMS_FILE).unlink()
    longer = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 6})})
    result = train(longer, checkpoint_input="auto", progress=False)
    out = capsys.readouterr().out
    assert f"note: ignoring {run}/checkpoint-final: checkpoint {run}/checkpoint-final has no checksums.json" in out
    assert f"resuming from {run}/checkpoint-2" in out and result.output_dir.name == "run.1"  # steps differ: a branch


def test_a_full_disk_on_the_first_checkpoint_says_there_is_none_to_resume_from(tmp_path, monkeypatch):
    def full(path, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoints, "_write_weights", full)
    with pytest.raises(ValueError) as error:
        train(run_config(tmp_path, training=dict(steps=4, checkpoint_every=2)), progress=False)
    message = str(error.value)
    assert message.startswith(f"the disk is full: cannot write checkpoint {tmp_path}/run/checkpoint-2")
    assert message.endswith("; this run has no earlier checkpoint to resume from"), message
    assert not (tmp_path / "run" / "checkpoint-2").exists() and not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_full_disk_later_names_the_checkpoint_to_resume_from(tmp_path, monkeypatch):
    write, calls = checkpoints._write_weights, []

    def full_the_second_time(path, *args):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, *args)

    monkeypatch.setattr(checkpoints, "_write_weights", full_the_second_time)
    with pytest.raises(ValueError, match=rf"cannot write checkpoint {tmp_path}/run/checkpoint-4 .*; the run can "
                                         rf"resume from {tmp_path}/run/checkpoint-2 \(--checkpoint-input "):
        train(run_config(tmp_path, training=dict(steps=6, checkpoint_every=2)), progress=False)
    checkpoints.verify(tmp_path / "run" / "checkpoint-2", ("model.onnx",))


def test_claim_fresh_skips_a_directory_holding_a_file(tmp_path):
    cfg = run_config(tmp_path)
    (tmp_path / "run").write_text("a file where the run would go")
    with claim_fresh(configured_output_dir(cfg)) as held:
        assert held.directory == tmp_path / "run.1"


@pytest.mark.slow
def test_a_run_in_use_is_refused_on_every_process_of_a_launched_job_as_one_line(tmp_path):
    """Rank 0's refusal is every process's error, as it is: no process is named as failed, no
    class name, no step."""
    from tests.test_distributed import torchrun

    cfg = run_config(tmp_path, training=dict(steps=4))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    run = Path(cfg.training.output_dir)
    holder = _python(HOLD, str(run))
    try:
        assert holder.stdout.readline().strip() == "held"
        result = torchrun(2, "bert.py", "train", "--config", str(path), "--checkpoint-input", "auto")
    finally:
        _kill(holder)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 2, result.stdout[-4000:]
    assert all(line.startswith(f"error: {run} is in use by another run (host ") for line in errors), errors
    assert "_InUse" not in result.stdout and "failed in step" not in result.stdout, result.stdout[-4000:]


def _rewrite_state(checkpoint: Path, **fields) -> None:
    """session.json of `checkpoint` with `fields` changed, its checksum made to match (as a newer
    version, or damage that passes the checksum, would leave it)."""
    state = json.loads((checkpoint / checkpoints.STATE_FILE).read_text())
    state.update(fields)
    (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps(state))
    sums = json.loads((checkpoint / checkpoints.CHECKSUMS_FILE).read_text())
    sums[checkpoints.STATE_FILE] = checkpoints._sha256(checkpoint / checkpoints.STATE_FILE)
    (checkpoint / checkpoints.CHECKSUMS_FILE).write_text(json.dumps(sums))


@pytest.mark.parametrize("how", ["newer format", "damaged"])
def test_auto_never_writes_over_a_later_checkpoint_it_cannot_read(short_run, capsys, how):
    cfg, run = short_run
    shutil.rmtree(run / "checkpoint-final")
    four = run / "checkpoint-4"  # as a newer version of the project wrote it, or one damaged past reading
    shutil.copytree(run / "checkpoint-2", four)
    if how == "newer format":
        _rewrite_state(four, step=4, format=checkpoints.FORMAT + 1)
    else:
        (four / checkpoints.STATE_FILE).write_text("{")
    before = snapshot(four)
    result = train(cfg, checkpoint_input="auto", progress=False)
    out = capsys.readouterr().out
    assert f"note: ignoring {four}" in out and f"resuming from {run}/checkpoint-2" in out
    assert f"{four} cannot be read by this version and is kept as it is" in out
    assert result.output_dir == run.parent / "run.1", "the run continues beside it, as a branch"
    assert snapshot(four) == before, "the checkpoint it cannot read is as it was"


@pytest.mark.parametrize("fields, said", [
    ({"step": -3}, "says step -3, which is no step a run reaches"),
    ({"step": 2.5}, "says step 2.5, which is no step a run reaches"),
    ({"format": "3"}, "names checkpoint format '3', which no version of this project writes"),
    ({"format": None}, "names checkpoint format None, which no version of this project writes"),
    ({"format": -1}, "names checkpoint format -1, which no version of this project writes"),
    ({"format": 2.5}, "names checkpoint format 2.5, which no version of this project writes"),
    ({"format": 99}, "is in checkpoint format 99, newer than this version reads"),
], ids=["negative-step", "fractional-step", "format-string", "format-null", "format-negative", "format-fraction",
        "format-newer"])
def test_a_session_state_no_version_writes_is_named_and_nothing_is_started(short_run, fields, said):
    cfg, run = short_run
    checkpoint = run / "checkpoint-2"
    _rewrite_state(checkpoint, **fields)
    before = snapshot(run.parent)
    longer = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 8})})
    with pytest.raises(ValueError, match=re.escape(f"{checkpoint / checkpoints.STATE_FILE} {said}")):
        train(longer, checkpoint_input=str(checkpoint), progress=False)
    assert snapshot(run.parent) == before, "no branch directory is left behind"


def test_a_run_lock_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    run, target = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    target.write_text("not a lock\n")
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(ValueError, match=rf"{run / LOCK_FILE} is a symbolic link \(to {target}\), which no run "
                                         "writes; remove the link"):
        claim(run)
    assert target.read_text() == "not a lock\n"
