"""create_pretraining_data: samples, shards, determinism and every bad-input error."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import data.pretraining as data_pretraining
from data.corpus import read_documents
from data.create_pretraining_data import create_pretraining_data, main
from data.masking import unmask_rows
from data.pretraining import SAMPLE_KEYS, CreateOptions
from data.shards import inspect_shard
from data.vocab import load_vocab
from tests.helpers import write_small_corpus

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files, vocab = write_small_corpus(tmp_path_factory.mktemp("corpus"), [150] * 3, [100, 101, 102], 600)
    return files, vocab.path


def _load(shards):
    out = {k: [] for k in SAMPLE_KEYS}
    for s in shards:
        with h5py.File(s, "r") as f:
            for k in SAMPLE_KEYS:
                out[k].append(f[k][:])
    return {k: np.concatenate(v) for k, v in out.items()}


def _create(corpus, out, **kw):
    files, vocab = corpus
    opts = CreateOptions(**{"seq_len": 64, "max_predictions": 12, "dupe_factor": 2, **kw.pop("opts", {})})
    return create_pretraining_data(files, out, vocab=vocab, options=opts, progress=False, **kw)


def test_samples_are_consistent(corpus, tmp_path):
    r = _create(corpus, tmp_path / "out")
    vocab = load_vocab(corpus[1])
    d = _load(r.shards)
    n, s = d["input_ids"].shape
    assert n == r.samples > 100 and s == 64 and d["masked_lm_positions"].shape == (n, 12)
    tokens = d["input_ids"].copy()
    rows, cols = np.nonzero(d["masked_lm_positions"])
    tokens[rows, d["masked_lm_positions"][rows, cols]] = d["masked_lm_ids"][rows, cols]
    for i in range(n):
        length = int(d["input_mask"][i].sum())
        assert (d["input_mask"][i, :length] == 1).all() and (d["input_mask"][i, length:] == 0).all()
        assert (d["input_ids"][i, length:] == vocab.pad_id).all()
        row = tokens[i, :length]
        seps = np.flatnonzero(row == vocab.sep_id)
        assert row[0] == vocab.cls_id and len(seps) == 2 and seps[1] == length - 1 and seps[0] >= 2
        seg = d["segment_ids"][i]
        assert (seg[: seps[0] + 1] == 0).all() and (seg[seps[0] + 1 : length] == 1).all()
        assert (seg[length:] == 0).all()
        pos = d["masked_lm_positions"][i]
        k = int((pos != 0).sum())
        assert k >= 1 and (pos[k:] == 0).all() and (d["masked_lm_ids"][i, k:] == 0).all()
        assert (np.diff(pos[:k]) > 0).all() and pos[k - 1] < length
        assert not np.isin(row[pos[:k]], [vocab.cls_id, vocab.sep_id, vocab.pad_id]).any()
        cand = length - 3
        assert k == min(12, max(1, round(cand * 0.15)))
    assert set(np.unique(d["next_sentence_labels"])) <= {0, 1}


def test_masking_statistics_and_nsp_balance(corpus, tmp_path):
    r = _create(corpus, tmp_path / "out", opts={"seq_len": 128, "max_predictions": 40, "dupe_factor": 6})
    vocab = load_vocab(corpus[1])
    d = _load(r.shards)
    chosen = d["masked_lm_positions"] != 0
    cand = d["input_mask"].sum() - 3 * len(d["input_ids"])
    frac = chosen.sum() / cand
    assert abs(frac - 0.15) < 0.01, f"masked fraction {frac:.4f}"
    rows = np.broadcast_to(np.arange(len(chosen))[:, None], chosen.shape)[chosen]
    now = d["input_ids"][rows, d["masked_lm_positions"][chosen]]
    orig = d["masked_lm_ids"][chosen]
    shares = {"mask": (now == vocab.mask_id).mean(), "kept": (now == orig).mean(),
              "random": ((now != vocab.mask_id) & (now != orig)).mean()}
    for name, want in (("mask", 0.8), ("kept", 0.1), ("random", 0.1)):
        assert abs(shares[name] - want) < 0.02, f"{name}: {shares[name]:.4f} over {chosen.sum()} masks"
    nsp = d["next_sentence_labels"].mean()
    assert abs(nsp - 0.5) < 0.04, f"share of random-next pairs {nsp:.3f} over {len(chosen)} samples"


def test_random_next_comes_from_another_document(tmp_path):
    # Two documents over disjoint words: a pair is "is next" exactly when A and B
    # come from the same document.
    words_a, words_b = ["red", "green", "blue", "pink"], ["one", "two", "three", "four"]
    rnd = np.random.default_rng(0)
    doc_a = [" ".join(rnd.choice(words_a, 5)) for _ in range(60)]
    doc_b = [" ".join(rnd.choice(words_b, 5)) for _ in range(60)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(doc_a) + "\n\n" + "\n".join(doc_b) + "\n")
    vocab = tmp_path / "v.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words_a, *words_b]) + "\n")
    v = load_vocab(vocab)
    ids_a = {v.id(w) for w in words_a}
    ids_b = {v.id(w) for w in words_b}
    r = create_pretraining_data([corpus], tmp_path / "o", vocab=vocab,
                                options=CreateOptions(seq_len=32, max_predictions=5, dupe_factor=20,
                                                      short_seq_prob=0.3),
                                progress=False)
    d = _load(r.shards)
    tokens = unmask_rows(d["input_ids"], d["masked_lm_positions"], d["masked_lm_ids"])
    real = d["input_mask"] == 1
    for ids, seg, ok, label in zip(tokens, d["segment_ids"], real, d["next_sentence_labels"]):
        first = {int(t) for t in ids[(seg == 0) & ok]} - {v.cls_id, v.sep_id}
        second = {int(t) for t in ids[(seg == 1) & ok]} - {v.sep_id}
        assert first and second
        same = (first <= ids_a and second <= ids_a) or (first <= ids_b and second <= ids_b)
        assert same == (label == 0), (first, second, label)
    assert 0.4 < d["next_sentence_labels"].mean() < 0.6


def test_natural_lengths_end_samples_where_the_text_ends():
    # Synthetic tokenised documents: sentence k of document d is [d, k] * 4 (8 tokens).
    # With 64 tokens for A and B, a document of 20 sentences (160 tokens) fills two
    # samples and leaves 32 tokens; natural lengths cut it into three of about 53.
    docs = [[[d + 5, k + 5] * 4 for k in range(n)] for d, n in enumerate([3, 5, 20, 11, 9, 13] * 5)]
    seq = 67
    fill = data_pretraining.create_pairs(docs, seq, 0.0, random.Random(0))
    natural = data_pretraining.create_pairs(docs, seq, 0.0, random.Random(0), natural_lengths=True)
    lengths = lambda pairs: np.array([len(a) + len(b) for a, b, _ in pairs])  # noqa: E731
    for pairs in (fill, natural):
        assert lengths(pairs).max() <= seq - 3
        assert 0.3 < np.mean([label for *_, label in pairs]) < 0.7
    full = lambda pairs: [len(a) + len(b) == seq - 3 for a, b, label in pairs if label == 0]  # noqa: E731
    # (Natural samples are full only where the rest of a document splits into full halves.)
    assert np.mean(full(fill)) > 0.3 > 3 * np.mean(full(natural)), "filling tops long documents' samples up"
    # A random B is as long as the B it replaces, not topped up to the maximum.
    assert lengths(natural).mean() < 0.85 * lengths(fill).mean()


def test_natural_lengths_cli_writes_shorter_samples(corpus, tmp_path):
    fill = _load(_create(corpus, tmp_path / "fill", opts={"seq_len": 128}).shards)
    files, vocab = corpus
    out = tmp_path / "natural"
    assert main(["--input", *map(str, files), "--output-dir", str(out), "--vocab", str(vocab), "--seq-len", "128",
                 "--max-predictions", "12", "--dupe-factor", "2", "--natural-lengths", "--workers", "1"]) == 0
    natural = _load(sorted(out.glob("*.hdf5")))
    assert natural["input_mask"].mean() < fill["input_mask"].mean()
    assert inspect_shard(sorted(out.glob("*.hdf5"))[0]).attrs["natural_lengths"]


def test_shard_round_trip_and_attributes(corpus, tmp_path):
    r = _create(corpus, tmp_path / "out", opts={"seed": 3, "whole_word_masking": True})
    vocab = load_vocab(corpus[1])
    for shard, src in zip(r.shards, corpus[0]):
        info = inspect_shard(shard)
        a = info.attrs
        assert a["seq_len"] == 64 and a["max_predictions"] == 12 and a["seed"] == 3
        assert a["vocab_size"] == vocab.size and a["vocab_sha256"] == vocab.sha256
        assert a["whole_word_masking"] and a["source"] == str(src) and a["num_samples"] == info.num_samples
        with h5py.File(shard) as f:
            assert f["vocab"][()].decode() == vocab.text
            assert f["input_ids"].compression == "gzip"
            assert f["input_ids"].dtype == np.int32 and f["input_mask"].dtype == np.int8


def test_deterministic_for_seed_and_independent_of_workers(corpus, tmp_path):
    a = _load(_create(corpus, tmp_path / "a", opts={"seed": 5}).shards)
    b = _load(_create(corpus, tmp_path / "b", opts={"seed": 5}, workers=2).shards)
    c = _load(_create(corpus, tmp_path / "c", opts={"seed": 6}).shards)
    for k in SAMPLE_KEYS:
        assert np.array_equal(a[k], b[k]), k
    assert not np.array_equal(a["masked_lm_positions"][:50], c["masked_lm_positions"][:50])


def test_trains_vocab_and_reads_wikiextractor(tmp_path):
    text = "\n".join(
        f'<doc id="{i}" url="x" title="Title {i}">\nTitle {i}\n\n'
        + " ".join(f"Sentence {j} of article {i} tells about cats and dogs." for j in range(12))
        + "\n</doc>"
        for i in range(30)
    )
    wiki = tmp_path / "wiki_00"
    wiki.write_text(text + "\n")
    docs = read_documents(wiki)
    assert len(docs) == 30 and len(docs[0]) == 12 and docs[0][0].startswith("Sentence 0 of article 0")
    r = create_pretraining_data([str(tmp_path / "wiki_*")], tmp_path / "o", vocab_size=150,
                                options=CreateOptions(seq_len=48, max_predictions=8), progress=False)
    assert (tmp_path / "o" / "vocab.txt").exists() and load_vocab(r.vocab_path).size <= 150
    assert r.samples > 30


# --------------------------------------------------------------------------- bad input


def _expect(match, **kw):
    return pytest.raises(ValueError, match=match)


def test_missing_and_empty_input(corpus, tmp_path):
    _, vocab = corpus
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        create_pretraining_data([missing], tmp_path / "o", vocab=vocab, progress=False)
    with pytest.raises(ValueError, match="matches no file"):
        create_pretraining_data([str(tmp_path / "*.none")], tmp_path / "o", vocab=vocab, progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=f"{empty} is empty"):
        create_pretraining_data([empty], tmp_path / "o2", vocab=vocab, progress=False)


@pytest.mark.slow
def test_non_utf8_line_is_named(corpus, tmp_path):
    _, vocab = corpus
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line one.\nfine line two.\n\nbroken \xff\xfe here.\n")
    with pytest.raises(ValueError, match=rf"{bad}, line 4, column 8: not valid UTF-8"):
        create_pretraining_data([bad], tmp_path / "o", vocab=vocab, progress=False)
    # The same error through a worker process.
    good = tmp_path / "good.txt"
    good.write_text("one sentence.\nanother one.\n")
    with pytest.raises(ValueError, match=rf"{bad}, line 4"):
        create_pretraining_data([good, bad], tmp_path / "o2", vocab=vocab, workers=2, progress=False)


@pytest.mark.parametrize("drop", ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"])
def test_vocab_without_special_token(corpus, tmp_path, drop):
    files, vocab = corpus
    lines = [t for t in Path(vocab).read_text().splitlines() if t != drop]
    bad = tmp_path / "vocab.txt"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"vocab file {bad} lacks the special token\(s\) \{drop}".replace("{", "[").replace("}", "]")):
        create_pretraining_data(files, tmp_path / "o", vocab=bad, progress=False)


def test_vocab_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_vocab(tmp_path / "none.txt")
    v = tmp_path / "v.txt"
    v.write_bytes(b"[PAD]\n[UNK]\n\xc3\n")
    with pytest.raises(ValueError, match=f"{v}, line 3: not valid UTF-8"):
        load_vocab(v)
    v.write_text("[PAD]\n[UNK]\n[PAD]\n")
    with pytest.raises(ValueError, match=f"{v}, line 3: token '\\[PAD\\]' repeats line 1"):
        load_vocab(v)


def test_existing_shards_are_not_overwritten(corpus, tmp_path):
    r = _create(corpus, tmp_path / "out")
    before = r.shards[0].read_bytes()
    with pytest.raises(ValueError, match=rf"{r.shards[0]} already exists.*--overwrite"):
        _create(corpus, tmp_path / "out", opts={"seed": 9})
    assert r.shards[0].read_bytes() == before
    _create(corpus, tmp_path / "out", opts={"seed": 9}, overwrite=True)
    assert r.shards[0].read_bytes() != before


@pytest.mark.slow
def test_cli_as_script_and_module(corpus, tmp_path):
    files, vocab = corpus
    args = ["--input", str(files[0]), "--vocab", str(vocab), "--seq-len", "48", "--max-predictions", "7",
            "--workers", "1", "--seed", "2"]
    env = {**os.environ, "PYTHONPATH": ""}
    a = subprocess.run([sys.executable, "data/create_pretraining_data.py", *args, "--output-dir",
                        str(tmp_path / "a")], cwd=REPO, env=env, capture_output=True, text=True)
    assert a.returncode == 0, a.stderr
    b = subprocess.run([sys.executable, "-m", "data.create_pretraining_data", *args, "--output-dir",
                        str(tmp_path / "b")], cwd=REPO, env=env, capture_output=True, text=True)
    assert b.returncode == 0, b.stderr
    da, db = _load([tmp_path / "a" / "shard_00000.hdf5"]), _load([tmp_path / "b" / "shard_00000.hdf5"])
    assert all(np.array_equal(da[k], db[k]) for k in SAMPLE_KEYS)
    # Errors are one clear line and exit status 2.
    assert main(["--input", str(tmp_path / "missing.txt"), "--vocab", str(vocab), "--output-dir",
                 str(tmp_path / "c")]) == 2


def test_an_output_dir_that_is_a_file_is_one_error_line(corpus, tmp_path, capsys):
    files, vocab = corpus
    taken = tmp_path / "shards"
    taken.write_text("a file of the user's")
    assert main(["--input", str(files[0]), "--vocab", str(vocab),
                 "--output-dir", str(taken), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --output-dir {taken} is a file"), err
    assert taken.read_text() == "a file of the user's"
    assert main(["--input", str(files[0]), "--vocab", str(vocab),
                 "--output-dir", str(taken / "below"), "--workers", "1"]) == 2
    assert "cannot be created" in capsys.readouterr().err


def test_a_held_out_fraction_splits_by_document_into_eval_and_train_shards(corpus, tmp_path):
    """Each document writes one word of the vocab alone, so every token of a row names the
    document it came from: the held-out shards hold exactly the documents the hash picks,
    and no document reaches both sides."""
    vocab = load_vocab(corpus[1])
    words = [t for t in vocab.tokens if t.isalpha() and len(t) >= 3][:60]
    assert len(words) == 60
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join("\n".join(" ".join([w] * 6) for _ in range(4)) for w in words) + "\n")
    documents = read_documents(text)
    held = {words[i] for i, d in enumerate(documents) if data_pretraining.is_held_out(d, 0.25, seed=0)}
    assert 5 <= len(held) <= 25, "about a quarter of 60 documents"
    r = create_pretraining_data([text], tmp_path / "out", vocab=corpus[1], progress=False, held_out_fraction=0.25,
                                options=CreateOptions(seq_len=32, max_predictions=4))
    assert [p.relative_to(tmp_path / "out").as_posix() for p in r.shards + r.eval_shards] == [
        "train/shard_00000.hdf5", "eval/shard_00000.hdf5"]
    assert (r.documents, r.eval_documents) == (60 - len(held), len(held)) and r.eval_samples > 0

    def words_in(shards):
        d = _load(shards)
        tokens = unmask_rows(d["input_ids"], d["masked_lm_positions"], d["masked_lm_ids"])
        return {vocab.tokens[t] for t in np.unique(tokens[d["input_mask"] == 1])} - {"[CLS]", "[SEP]"}

    assert words_in(r.eval_shards) == held
    assert words_in(r.shards) == set(words) - held
    again = create_pretraining_data([text], tmp_path / "again", vocab=corpus[1], progress=False, held_out_fraction=0.25,
                                    options=CreateOptions(seq_len=32, max_predictions=4))
    assert _load(again.eval_shards)["input_ids"].tobytes() == _load(r.eval_shards)["input_ids"].tobytes()
    # A fraction too small for the corpus holds out its document of lowest hash, the same for any worker count.
    keys = [data_pretraining.held_out_key(d, 0) for d in documents]
    lowest = words[keys.index(min(keys))]
    tiny = create_pretraining_data([text], tmp_path / "tiny", vocab=corpus[1], progress=False, held_out_fraction=1e-9,
                                   options=CreateOptions(seq_len=32, max_predictions=4))
    assert min(keys) >= 1e-9 * 2**64 and (tiny.documents, tiny.eval_documents) == (59, 1)
    assert words_in(tiny.eval_shards) == {lowest} and words_in(tiny.shards) == set(words) - {lowest}
    one = tmp_path / "one.txt"
    one.write_text("\n".join(" ".join([words[0]] * 6) for _ in range(4)) + "\n")
    with pytest.raises(ValueError, match="no training sample is left after holding out"):
        create_pretraining_data([one], tmp_path / "one", vocab=corpus[1], progress=False, held_out_fraction=0.1,
                                options=CreateOptions(seq_len=32, max_predictions=4))


def test_the_summary_names_the_directory_of_the_shards_and_agrees_with_the_progress_bar(corpus, tmp_path, capsys):
    """With a held-out fraction the shards are in <output-dir>/train; a fraction too small for
    the corpus processes one shard again (its lowest document held out), after the bar's
    counts were shown: the bar's last counts are the summary's all the same."""
    files, vocab = corpus
    out = tmp_path / "out"
    assert main(["--input", *map(str, files), "--vocab", str(vocab), "--output-dir", str(out), "--seq-len", "32",
                 "--max-predictions", "4", "--workers", "1", "--held-out-fraction", "1e-9"]) == 0
    captured = capsys.readouterr()
    summary, held = captured.out.strip().splitlines()[-2:]
    m = re.fullmatch(rf"(\d+) samples from \d+ documents / (\d+) sentences in 3 shard\(s\) in {out / 'train'} .*",
                     summary)
    assert m, summary
    assert re.fullmatch(rf"held out: (\d+) samples from 1 documents in 1 shard\(s\) in {out / 'eval'} .*", held), held
    bar = re.findall(r"samples=(\d+), sentences=(\d+), held_out=(\d+)", captured.err)
    assert bar, captured.err[-2000:]
    assert bar[-1] == (m.group(1), m.group(2), re.match(r"held out: (\d+)", held).group(1)), (bar[-1], summary, held)
