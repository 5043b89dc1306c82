"""create_pretraining_data leaves no partial shard on any failure (data/create_pretraining_data.py).

Shards are staged in a hidden directory and moved into place only when the whole set is
written and checked: a held-out split that leaves one side empty, a bad input file read
by a worker, a full disk, and an interrupt each leave the output directory as it was
(no new shard, no replaced one, no staging left), and staging that a killed process
left is removed by the next run.
"""
from __future__ import annotations

import errno
import os
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
