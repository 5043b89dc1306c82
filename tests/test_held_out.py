"""The held-out set is provably held out, for every data source (bert/data.py check_held_out).

An evaluation set that overlaps the training files (the same path, the same file under
another name, the same bytes), that was made with another vocabulary of the same size,
that has another sequence length, or one of whose globs matches nothing is refused
before step 1, naming the file, for the demo and the shards sources: by `check_data`
(bert.py's check before torch is imported) and by the run itself (`train`), which
writes nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bert import config_from_dict
from bert.data import check_data, eval_files
from bert.tasks.pretraining import train
from data.create_pretraining_data import create_pretraining_data
from data.demo import build_demo_data
from data.pretraining import CreateOptions
from data.vocab import load_vocab
from tests.helpers import sections, write_small_corpus

ROOT = Path(__file__).resolve().parents[1]
# The module's corpus (the demo data and held-out shards of every wrong kind) takes seconds to make.
pytestmark = pytest.mark.slow
MODEL = dict(architecture="groupbert", hidden_size=48, num_layers=1, num_heads=3, vocab_size=2048,
             sequence_length=32, max_predictions=5, max_positions=64)


def shuffled_vocab(vocab_path: Path, out: Path) -> Path:
    """The same tokens in another order: the same size, other ids (the special tokens kept)."""
    tokens = load_vocab(vocab_path).tokens
    special, words = tokens[:5], list(tokens[5:])
    out.write_text("\n".join([*special, *words[::-1]]) + "\n")
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo corpus at sequence 32, and held-out shards of every wrong kind beside good ones."""
    root = tmp_path_factory.mktemp("held_out")
    demo = build_demo_data(root / "demo", seq_len=32, max_predictions=5)
    text = root / "demo" / "corpus" / "eval_00.txt"
    options = CreateOptions(seq_len=32, max_predictions=5, seed=3)
    create_pretraining_data([text], root / "good", vocab=demo.vocab_path, progress=False, options=options)
    other = shuffled_vocab(demo.vocab_path, root / "shuffled_vocab.txt")
    assert load_vocab(other).size == demo.vocab_size
    create_pretraining_data([text], root / "other_vocab", vocab=other, progress=False, options=options)
    create_pretraining_data([text], root / "other_length", vocab=demo.vocab_path, progress=False,
                            options=CreateOptions(seq_len=48, max_predictions=5, seed=3))
    (root / "copy").mkdir()
    shutil.copy(demo.train_files[1], root / "copy" / "shard_00000.hdf5")  # a training shard under another name
    (root / "link").mkdir()
    os.link(demo.train_files[2], root / "link" / "shard_00000.hdf5")
    return root, demo


def config(root: Path, source: str, eval_globs: list[str]) -> dict:
    data = {"source": source, "eval_files": eval_globs, "eval_samples": 16}
    if source == "demo":
        data["directory"] = str(root / "demo")
    else:
        data["files"] = [str(root / "demo" / "train" / "*.hdf5")]
    return {"name": "held_out", "model": dict(MODEL), "data": data,
            **sections(steps=2, micro_batch_size=4, output_dir=str(root / "runs" / source))}


CASES = {
    # case: (eval globs under root, the message's pattern after "held-out shard <file>" or the glob's)
    "a training shard": (["demo/train/shard_00000.hdf5"], r"{file} is one the run trains on \({source}\)"),
    "a training shard's copy": (["copy/*.hdf5"], "{file} holds the same bytes as .*shard_00001.hdf5, one the run trains on"),
    "a training shard's hard link": (["link/*.hdf5"], "{file} is the same file as .*shard_00002.hdf5, one the run trains on"),
    "another vocabulary of the same size": (["other_vocab/*.hdf5"], "{file} was made with another vocabulary "
                                            r"\(shuffled_vocab.txt, sha256 \w+…, 2048 tokens\) than the training shards "
                                            r"\(vocab.txt, sha256 \w+…, 2048 tokens\)"),
    "another sequence length": (["other_length/*.hdf5"], "{file} holds sequences of 48 with 5 masks per row, the model "
                                "wants model.sequence_length 32"),
    "a glob that matches nothing": (["good/*.hdf5", "good/*.h5"], r"data.eval_files pattern '{root}/good/\*.h5' "
                                    "matches no file, although the others match"),
}
SOURCES = {"shards": "data.files", "demo": "the demo's training shards in {root}/demo"}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", CASES)
def test_a_bad_held_out_set_is_refused_before_step_1_naming_the_file(data, source, case):
    root, _ = data
    globs, pattern = CASES[case]
    cfg = config_from_dict(config(root, source, [str(root / g) for g in globs]))
    found = sorted(str(p) for g in globs for p in root.glob(g))
    expected = pattern.format(file=found[0] if found else "", root=root,
                              source=SOURCES[source].format(root=root))
    if "glob" not in case:
        expected = "held-out shard " + expected
    for check in (check_data, eval_files, lambda c: train(c, progress=False)):
        with pytest.raises(ValueError, match=expected) as error:
            check(cfg)
        assert "\n" not in str(error.value)
    assert not (root / "runs").exists(), "nothing was written: the run stopped before its first step"


@pytest.mark.parametrize("source", SOURCES)
def test_good_held_out_shards_pass_and_the_demo_default_is_its_own(data, source):
    root, demo = data
    cfg = config_from_dict(config(root, source, [str(root / "good" / "*.hdf5")]))
    check_data(cfg)
    assert eval_files(cfg) == [str(root / "good" / "shard_00000.hdf5")]
    own = config(root, "demo", [])
    assert eval_files(config_from_dict(own)) == [str(f) for f in demo.eval_files]


def test_held_out_shards_without_a_recorded_vocabulary_are_refused_beside_ones_with_it(data, tmp_path):
    import h5py

    root, _ = data
    bare = tmp_path / "bare.hdf5"
    shutil.copy(root / "good" / "shard_00000.hdf5", bare)
    with h5py.File(bare, "a") as f:
        del f.attrs["vocab_sha256"]
    cfg = config_from_dict(config(root, "shards", [str(bare)]))
    with pytest.raises(ValueError, match=f"held-out shard {bare} records no vocabulary"):
        check_data(cfg)


def test_training_shards_of_two_vocabularies_are_refused(data):
    root, _ = data
    cfg = config(root, "shards", [])
    cfg["data"]["files"].append(str(root / "other_vocab" / "*.hdf5"))
    cfg["data"]["eval_files"] = [str(root / "good" / "*.hdf5")]
    with pytest.raises(ValueError, match=r"training shard .*other_vocab/shard_00000.hdf5 was made with another "
                                         r"vocabulary .* a run trains on one vocabulary"):
        check_data(config_from_dict(cfg))


def test_the_check_runs_before_torch_is_imported(data, tmp_path):
    """bert.py's fast path: a bad held-out set of the demo ends the command before torch loads."""
    root, _ = data
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config(root, "demo", [str(root / "demo" / "train" / "shard_00000.hdf5")])))
    probe = ("import runpy, sys; code = runpy.run_path('bert.py')['main'](sys.argv[1:]); "
             "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, "--config", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.stderr.startswith(f"error: held-out shard {root}/demo/train/shard_00000.hdf5 is one the run trains "
                                  "on") and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout.split() == ["2", "False"], done.stdout


def test_one_training_glob_that_matches_nothing_is_refused(data):
    root, _ = data
    cfg = config(root, "shards", [str(root / "good" / "*.hdf5")])
    cfg["data"]["files"].append(str(root / "demo" / "train" / "*.h5"))
    with pytest.raises(ValueError, match=r"data.files pattern '.*\*.h5' matches no file, although the others match"):
        check_data(config_from_dict(cfg))


def test_a_small_held_out_corpus_split(tmp_path):
    """create_pretraining_data --held-out-fraction: the shards it writes pass the check as a pair."""
    files, vocab = write_small_corpus(tmp_path, [40], [4], 2048)
    r = create_pretraining_data(files, tmp_path / "out", vocab=vocab.path, progress=False, held_out_fraction=0.2,
                                options=CreateOptions(seq_len=32, max_predictions=5))
    cfg = {"name": "split", "model": dict(MODEL), "training": {"steps": 2, "output_dir": str(tmp_path / "run")},
           "data": {"source": "shards", "files": [str(p) for p in r.shards],
                    "eval_files": [str(p) for p in r.eval_shards]}}
    check_data(config_from_dict(cfg))
