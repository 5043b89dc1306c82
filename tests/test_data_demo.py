"""build_demo_data: deterministic, idempotent, never overwrites other data."""


import h5py
import numpy as np
import pytest

from data import DemoData, PretrainingLoader, build_demo_data
from data.demo import generate_documents
from data.pretraining import SAMPLE_KEYS


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    return build_demo_data(d, seq_len=128, max_predictions=20, seed=0)


@pytest.mark.slow
def test_demo_data_shape_and_size(demo):
    data = demo
    assert isinstance(data, DemoData)
    assert 20_000 <= data.num_train_samples <= 60_000 and data.num_eval_samples >= 1_000
    assert 1_000 <= data.vocab_size <= 4_096 and data.vocab_path.exists()
    loader = PretrainingLoader(data.train_files, 32)
    assert loader.num_samples == data.num_train_samples
    assert (loader.seq_len, loader.max_predictions, loader.vocab_size) == (128, 20, data.vocab_size)
    batch = next(iter(loader))
    assert batch["input_ids"].max() < data.vocab_size
    loader.close()


@pytest.mark.slow
def test_demo_data_is_idempotent_and_deterministic(demo, tmp_path):
    data = demo
    stamps = [f.stat().st_mtime_ns for f in data.train_files]
    again = build_demo_data(data.directory)
    assert again == data
    assert [f.stat().st_mtime_ns for f in data.train_files] == stamps, "reuse must not rewrite shards"
    other = build_demo_data(tmp_path / "second")
    assert other.vocab_path.read_bytes() == data.vocab_path.read_bytes()
    for a, b in zip(data.train_files + data.eval_files, other.train_files + other.eval_files):
        with h5py.File(a) as fa, h5py.File(b) as fb:
            for k in SAMPLE_KEYS:
                assert np.array_equal(fa[k][:], fb[k][:]), (a, k)


@pytest.mark.slow
def test_demo_data_refuses_to_overwrite(demo, tmp_path):
    data = demo
    with pytest.raises(ValueError, match="other settings"):
        build_demo_data(data.directory, seq_len=64)
    foreign = tmp_path / "foreign"
    (foreign / "train").mkdir(parents=True)
    (foreign / "train" / "shard_00000.hdf5").write_bytes(b"someone else's data")
    with pytest.raises(ValueError, match="exists but .*demo.json does not"):
        build_demo_data(foreign)
    assert (foreign / "train" / "shard_00000.hdf5").read_bytes() == b"someone else's data"


def test_generator_has_structure():
    docs = generate_documents(50, seed=3)
    assert docs == generate_documents(50, seed=3) and docs != generate_documents(50, seed=4)
    assert all(len(d) >= 5 for d in docs)
    # Each document names its subject in the first sentence and repeats it later.
    subject_repeats = sum(any(d[0].split()[0] in s for s in d[1:]) for d in docs)
    assert subject_repeats > 0.8 * len(docs)


def test_a_users_vocab_in_the_demo_directory_is_never_overwritten(tmp_path):
    # A data.directory holding the user's own vocab.txt but no train/ or eval/: refused, untouched.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "vocab.txt").write_text("[PAD]\n[UNK]\nmy\nown\n")
    with pytest.raises(ValueError, match=rf"{mine / 'vocab.txt'} exists but .*demo.json does not .* would overwrite"):
        build_demo_data(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["vocab.txt"]
    assert (mine / "vocab.txt").read_text() == "[PAD]\n[UNK]\nmy\nown\n"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        build_demo_data(tmp_path / "file")
