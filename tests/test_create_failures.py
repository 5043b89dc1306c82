"""create_pretraining_data leaves no partial shard on any failure (data/create_pretraining_data.py).

Shards are staged in a hidden directory and moved into place only when the whole set is
written and checked: a held-out split that leaves one side empty, a bad input file read
by a worker, a full disk, and an interrupt each leave the output directory as it was
(no new shard, no replaced one, no staging left), and staging that a killed process
left is removed by the next run.
"""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import data.pretraining
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.helpers import write_small_corpus

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = CreateOptions(seq_len=32, max_predictions=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_small_corpus(tmp_path_factory.mktemp("corpus"), [30, 30], [1, 2], 300)


def everything(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()} \
        if directory.exists() else {}


def test_a_held_out_split_that_leaves_no_training_document_leaves_nothing(corpus, tmp_path):
    _, vocab = corpus
    one = tmp_path / "one.txt"
    one.write_text("\n".join("alpha beta gamma delta." for _ in range(4)) + "\n")
    with pytest.raises(ValueError, match="no training sample is left after holding out"):
        create_pretraining_data([one], tmp_path / "out", vocab=vocab.path, progress=False, held_out_fraction=0.1,
                                options=OPTIONS)
    assert not (tmp_path / "out").exists(), "the eval shard written for the one document is not left behind"


def test_a_bad_file_read_by_a_worker_leaves_no_shard_of_the_good_ones(corpus, tmp_path):
    files, vocab = corpus
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line.\n\nbroken \xff here.\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match=rf"{bad}, line 3"):
        create_pretraining_data([*files, bad], out, vocab=vocab.path, progress=False, workers=2, options=OPTIONS)
    assert everything(out) == {"notes.txt": b"the user's"} and not list(out.iterdir())[1:]


def test_workers_that_cannot_start_end_the_run_with_one_line_not_a_hang(corpus, tmp_path):
    """A spawned worker imports this module again, from the parent's sys.path: a directory there
    with a data.py of its own (as bench/ had) makes every worker die at start. A Pool started
    another for ever (the suite hung 600 s twice); the run now stops, leaving nothing."""
    files, vocab = corpus
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "data.py").write_text("raise SystemExit('not the data package')\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    script = ("import sys\nfrom data.create_pretraining_data import main\n"  # the parent has the package
              f"sys.path.insert(0, {str(shadow)!r})\n"
              f"sys.exit(main(['--input', *{[str(f) for f in files]!r}, '--vocab', {str(vocab.path)!r}, "
              f"'--output-dir', {str(out)!r}, '--seq-len', '32', '--max-predictions', '4', '--workers', '2']))")
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and "Traceback" not in lines[-1], ran.stderr[-3000:]
    assert re.fullmatch(rf"error: a worker process ended without its result \(killed, out of memory, or it could not "
                        rf"start: its own message is above\); no shard under {out} was written or replaced: fix the "
                        r"cause and run again, or give --workers 1", lines[-1]), ran.stderr[-3000:]
    assert everything(out) == {"notes.txt": b"the user's"}


def test_a_full_disk_replaces_nothing_and_says_so(corpus, tmp_path, monkeypatch):
    files, vocab = corpus
    first = create_pretraining_data(files, tmp_path / "out", vocab=vocab.path, progress=False, options=OPTIONS)
    before = everything(tmp_path / "out")
    write, written = data.pretraining.write_shard, []

    def full_at_the_second(path, *args):
        written.append(path)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, *args)

    monkeypatch.setattr(data.pretraining, "write_shard", full_at_the_second)
    with pytest.raises(ValueError, match=rf"^the disk is full: cannot create the shards under {tmp_path / 'out'} "
                                         r"\(No space left on device\); no shard was written or replaced"):
        create_pretraining_data(files, tmp_path / "out", vocab=vocab.path, progress=False, overwrite=True,
                                options=CreateOptions(seq_len=32, max_predictions=4, seed=7))
    assert everything(tmp_path / "out") == before and len(first.shards) == 2
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_an_interrupt_leaves_nothing_and_a_killed_runs_staging_is_removed_next_time(corpus, tmp_path):
    files, vocab = corpus
    out = tmp_path / "out"
    # SIGINT as a terminal's Ctrl-C delivers it: a shell without job control starts a
    # background job (this suite under `cmd &`) with SIGINT ignored, and children inherit that.
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import sys, data.pretraining as p; from data.create_pretraining_data import main\n"
            "write = p.write_shard\n"
            "def slow(*a):\n    write(*a); print('wrote', flush=True); import time; time.sleep(60)\n"
            "p.write_shard = slow\nsys.exit(main(sys.argv[1:]))")
    process = subprocess.Popen([sys.executable, "-c", code, "--input", *map(str, files), "--vocab", str(vocab.path),
                                "--output-dir", str(out), "--workers", "1", "--seq-len", "32", "--max-predictions",
                                "4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:  # the detected format first, then the first shard staged
            if line.strip() == "wrote":
                break
        assert process.poll() is None, process.stderr.read()
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0 and not out.exists(), sorted(out.rglob("*"))
    # A staging directory of a process that was killed outright (no clean-up ran).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out / f".staging-{socket.gethostname()}-{dead.stdout.strip()}" / "train"
    stale.mkdir(parents=True)
    (stale / "shard_00000.hdf5").write_bytes(b"half a shard")
    create_pretraining_data(files, out, vocab=vocab.path, progress=False, options=OPTIONS)
    assert sorted(p.name for p in out.iterdir()) == ["shard_00000.hdf5", "shard_00001.hdf5"]
    assert os.path.getsize(out / "shard_00000.hdf5") > 100


# A full disk for real: a tmpfs of a few pages mounted in a private mount namespace (no other
# process sees it, and it goes when the namespace's last process ends).
_DISK_RUN = r"""
import hashlib, json, subprocess, sys
from pathlib import Path
disk, files, vocab = Path(sys.argv[1]), sys.argv[2:4], sys.argv[4]
out = disk / "out"
common = ["--input", *files, "--vocab", vocab, "--output-dir", str(out), "--seq-len", "32", "--max-predictions", "4",
          "--workers", "1"]
def snapshot():
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file()}
first = subprocess.run([sys.executable, "-m", "data.create_pretraining_data", *common], capture_output=True, text=True)
before = snapshot()
# Twenty maskings of each pair: shards five times as large, more than the disk holds.
full = subprocess.run([sys.executable, "-m", "data.create_pretraining_data", *common, "--overwrite", "--dupe-factor",
                       "20", "--seed", "7"], capture_output=True, text=True)
print(json.dumps({"first": first.returncode, "before": before, "rc": full.returncode, "stderr": full.stderr,
                  "after": snapshot(), "names": sorted(p.name for p in out.iterdir())}))
"""


def _unshare_mount_permitted(directory: Path) -> bool:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(directory)], capture_output=True)
    return probe.returncode == 0


def test_a_really_full_disk_ends_in_one_line_naming_the_shard_and_keeps_the_earlier_shards(corpus, tmp_path):
    """HDF5 meeting ENOSPC itself printed a dozen tracebacks and crashed the process (rc 139)."""
    files, vocab = corpus
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("unshare") is None or not _unshare_mount_permitted(disk):
        pytest.skip("mounting a tmpfs in a private mount namespace needs root (unshare --mount)")
    # 160 KB: the first run's two shards (30 KB each) fit, the second run's (145 KB each) do not.
    ran = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs -o size=160k tmpfs "$1" && shift && exec "$@"', "sh", str(disk),
                          sys.executable, "-c", _DISK_RUN, str(disk), *map(str, files), str(vocab.path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["first"] == 0 and len(result["before"]) == 2, result
    out = disk / "out"
    lines = result["stderr"].strip().splitlines()
    assert result["rc"] == 2, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] and lines[-1].startswith("error: "), result["stderr"][-3000:]
    assert sum(line.startswith("error") for line in lines) == 1, lines
    assert re.fullmatch(rf"error: the disk is full: cannot create the shards under {out} \(No space left on device, "
                        rf"writing {out}/shard_0000[01]\.hdf5\); no shard was written or replaced \(the files already "
                        r"there are intact, the ones staged were removed\): free space and run again", lines[-1]), lines[-1]
    assert result["after"] == result["before"], "the earlier shards changed"
    assert result["names"] == ["shard_00000.hdf5", "shard_00001.hdf5"], "a partial or staged file was left"


def test_a_file_size_limit_ends_in_one_line_naming_the_shard(corpus, tmp_path):
    """RLIMIT_FSIZE (EFBIG, not ENOSPC): the other way a write stops half-way, without root."""
    files, vocab = corpus
    out = tmp_path / "out"
    create_pretraining_data(files, out, vocab=vocab.path, progress=False, options=OPTIONS)
    before = everything(out)

    def limit_file_size() -> None:  # 64 KB: the shards of 20 maskings are 145 KB
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    ran = subprocess.run([sys.executable, "-m", "data.create_pretraining_data", "--input", *map(str, files), "--vocab",
                          str(vocab.path), "--output-dir", str(out), "--seq-len", "32", "--max-predictions", "4",
                          "--workers", "1", "--overwrite", "--dupe-factor", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert re.fullmatch(rf"error: cannot create the shards under {out} \(File too large, writing {out}/shard_00000"
                        r"\.hdf5\); no shard was written or replaced \(.*\): raise the file size limit \(ulimit -f\) "
                        r"or give a smaller --shard-size and run again", lines[-1]), lines[-1]
    assert everything(out) == before and not [p for p in out.iterdir() if p.name.startswith(".")]
