"""fileio, the one atomic writer: whole files or none, never overwriting what it must not,
every file and the directory naming it flushed before the write counts as done."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import fileio
from fileio import publish, publish_directory, staged, write_atomically


@pytest.fixture
def fsyncs(monkeypatch):
    """What os.fsync was called on, as (kind, path) in order: 'dir' or 'file'."""
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append(("dir" if os.path.isdir(path) else "file", path))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_staged_writes_are_atomic_and_never_overwrite(tmp_path):
    target = tmp_path / "out.onnx"
    with pytest.raises(RuntimeError):
        with staged(target) as path:  # a writer that fails half-way: nothing is left behind
            path.write_bytes(b"half")
            (path.parent / "out.onnx.data").write_bytes(b"weights")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with staged(target) as path:  # the file and its external data arrive together
        path.write_bytes(b"model")
        (path.parent / "out.onnx.data").write_bytes(b"weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "out.onnx.data"]
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's")
    with pytest.raises(ValueError, match="appeared while it was being written"):
        write_atomically(mine, "new", replace=False)
    assert mine.read_text() == "the user's" and sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.txt", "out.onnx", "out.onnx.data"]
    write_atomically(mine, "replaced")
    assert mine.read_text() == "replaced"
    write_atomically(mine, b"\x00bytes")
    assert mine.read_bytes() == b"\x00bytes"


def test_a_write_flushes_the_file_before_its_rename_and_the_directory_after(tmp_path, fsyncs, monkeypatch):
    renamed: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renamed.append(str(b)) or fsyncs.append(("rename", str(b)))
                        or real_replace(a, b))
    target = tmp_path / "sub" / "report.md"
    write_atomically(target, "text")
    assert target.read_text() == "text"
    kinds = [kind for kind, _ in fsyncs]
    assert kinds == ["file", "rename", "dir"], fsyncs
    assert fsyncs[-1][1] == str(target.parent), "the directory that names the new file"


def test_a_write_that_fills_the_disk_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    """A failed write or flush raises an OSError that names no file ("[Errno 28] No space left on
    device"): the error names the file being written."""
    import errno

    target = tmp_path / "runs.md"
    target.write_text("old\n")

    def full(self, data, encoding=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as error:
        write_atomically(target, "new\n")
    monkeypatch.undo()
    assert (error.value.errno, error.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [target]


def test_publish_moves_a_closed_file_into_place_or_refuses_to_overwrite(tmp_path, fsyncs):
    tmp = tmp_path / ".shard.h5.tmp"
    tmp.write_bytes(b"new")
    publish(tmp, tmp_path / "shard.h5")
    assert (tmp_path / "shard.h5").read_bytes() == b"new" and not tmp.exists()
    assert [k for k, _ in fsyncs] == ["file", "dir"]
    tmp.write_bytes(b"newer")
    with pytest.raises(ValueError, match="appeared while it was being written"):
        publish(tmp, tmp_path / "shard.h5", replace=False)
    assert (tmp_path / "shard.h5").read_bytes() == b"new"


def test_publish_directory_replaces_a_directory_whole(tmp_path, fsyncs):
    target = tmp_path / "checkpoint-4"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    tmp = tmp_path / ".checkpoint-4.tmp"
    (tmp / "inner").mkdir(parents=True)
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / "inner" / "state.json").write_text("{}")
    publish_directory(tmp, target)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["inner", "inner/state.json",
                                                                             "weights.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"], "the old one and the temporary are gone"
    flushed = {Path(p) for _, p in fsyncs}
    assert {tmp / "weights.bin", tmp / "inner" / "state.json", tmp / "inner", tmp} <= flushed
    assert fsyncs[-1] == ("dir", str(tmp_path)), "the parent, after the rename"


def test_every_writer_of_the_product_is_this_one():
    """No product module renames a file into place itself: they all go through fileio."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted(root.glob("*.py")) + sorted(p for d in ("bert", "session", "data", "custom_ops", "builder")
                                                   for p in (root / d).rglob("*.py")):
        text = path.read_text()
        for needle in ("os.replace(", "tmp.replace(", "f.replace(", "os.fsync(", "tmp.rename("):
            if needle in text:
                offenders.append(f"{path.relative_to(root)}: {needle}")
    assert not offenders, offenders
    assert fileio.__all__ == ["DiskFull", "disk_full", "fsync_directory", "publish", "publish_directory", "say",
                              "staged", "write_atomically"]


def test_say_writes_the_line_and_its_newline_at_once(monkeypatch):
    """Under PYTHONUNBUFFERED `print` writes a line and its newline apart, so the error lines of
    two processes sharing a stderr could join ('...output_direrror: ...'): one write each."""
    import sys

    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stderr", Stream())
    fileio.say("error: one")
    fileio.say("error: two")
    assert writes == ["error: one\n", "<flush>", "error: two\n", "<flush>"]
