"""Property-based fuzzing of every reader of a user file (Hypothesis, derandomized: a fixed
seed and a bounded number of examples, so CI runs the same cases every time).

Random and mutated structures go to the SQuAD reader, the config loader, the sweep YAML
reader, the attributes a sweep writes into its storage (an Optuna journal), the corpus readers (every
format, and format detection), `InferenceSession.run` and the run directory's best.json;
random byte corruption to the corpus samples (read whole and cut into shards), sweep
journals, checkpoints (through `TrainingSession.load`), HDF5 shards, `.onnx` files, a
run's lock file (read for the holder's name, then claimed over) and its metrics history
(rebuilt on resume). The only outcomes allowed are a
correct result (checked against what the input says) or a clean error: a ValueError
that names the file (or, for `run`, the input), on one line. Anything else — KeyError,
TypeError, AttributeError, an onnxruntime or protobuf exception — fails the test with
the input that caused it.

Examples per reader are listed in EXAMPLES; their sum is the suite's count (≥ 2,000).
`make test-fast` runs a quarter of each (GROUPBERT_FUZZ_SCALE=0.25); `make test` runs them all.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState

from bert import config_from_dict, load_config
from bert.sweep import load_spec, open_study, spec_from_dict, write_report
from data.corpus import plan_file, read_split
from data.readers import FORMATS, Where, detect_format, read_text
from data.squad import load_squad
from tests.helpers import random_batch, tiny_config
from tests.tiny_runs import ROOT, one_thread  # noqa: F401 (an autouse fixture)

EXAMPLES = {"squad": 500, "squad_bytes": 150, "config": 400, "config_file": 150, "sweep": 300, "sweep_file": 100,
            "inference": 250, "checkpoint": 60, "shard": 80, "onnx": 60, "corpus": 300, "corpus_bytes": 150,
            "journal_records": 150, "journal_bytes": 150, "run_lock": 150, "best": 250, "history": 200}
assert sum(EXAMPLES.values()) >= 2000
SCALE = float(os.environ.get("GROUPBERT_FUZZ_SCALE", "1"))


def fuzz(name: str):
    return settings(max_examples=max(10, round(EXAMPLES[name] * SCALE)), derandomize=True, deadline=None,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def clean(error: ValueError, *names) -> None:
    """A clean error: one line, naming (one of) `names`."""
    message = str(error)
    assert message and "\n" not in message, f"not one line: {message!r}"
    assert any(str(n) in message for n in names), f"{message!r} names none of {names}"


# ------------------------------------------------------------ structures
_KEYS = ["data", "title", "paragraphs", "context", "qas", "id", "question", "answers", "text", "answer_start",
         "is_impossible", "plausible_answers", "version", "model", "training", "data", "name", "method", "metric",
         "parameters", "values", "min", "max", "goal", "program", "command", "x"]
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=False),
                  st.text(max_size=12), st.sampled_from(["true", "false", "", " ", "5", "-1", "nan", "1e400"]))
json_value = st.recursive(
    _leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                   st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=6)), inner,
                                                   max_size=4)),
    max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


@st.composite
def mutated(draw, valid):
    """`valid` with 1-3 nodes replaced by random JSON, deleted, or given an extra key."""
    blob = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(blob) if p]
        if not paths:
            return draw(json_value)
        path = draw(st.sampled_from(paths))
        parent = blob
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        if op == "replace":
            parent[path[-1]] = draw(json_value)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(_KEYS))] = draw(json_value)
        else:
            parent.append(draw(json_value))
    return blob


def _flip(data: bytes, draw) -> bytes:
    """Truncate, flip, overwrite or delete bytes of `data`."""
    op = draw(st.sampled_from(["truncate", "flip", "flip", "overwrite", "delete"]))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if op == "truncate":
        return data[:at]
    if op == "flip":
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1:]
    if op == "overwrite":
        junk = draw(st.binary(min_size=1, max_size=16))
        return data[:at] + junk + data[at + len(junk):]
    return data[:at] + data[at + draw(st.integers(1, 64)):]


# ------------------------------------------------------------------ SQuAD
SQUAD = {"version": "v2.0", "data": [{"title": "Tala", "paragraphs": [
    {"context": "The river  Tala flows past Brenmoor. Brenmoor is a busy town.", "qas": [
        {"id": "a", "question": "Which river?", "answers": [{"text": "river Tala", "answer_start": 4}],
         "is_impossible": False},
        {"id": "b", "question": "What town?", "answers": [{"text": "brenmoor", "answer_start": None},
                                                         {"text": "Brenmoor", "answer_start": "27"}]},
        {"id": "c", "question": "Who?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Tala", "answer_start": 11}]},
        {"id": "d", "question": "Why?"}]}]}]}


def _check_squad(path: Path) -> None:
    try:
        data = load_squad(path)
    except ValueError as e:
        clean(e, path)
        return
    for ex in data.examples:  # a correct result: every located answer is its text in the context
        assert isinstance(ex.context, str) and isinstance(ex.question, str)
        for text, start, end in zip(ex.answers, ex.answer_starts, ex.answer_ends):
            if start is not None:
                assert ex.context[start:end].lower().split() == text.lower().split(), (text, ex.context[start:end])
        assert not (ex.is_impossible and ex.answers)
    assert len(data.examples) == len(data.unanswerable) + len(data.ungraded) + len(data.answerable)


@fuzz("squad")
@given(st.one_of(mutated(SQUAD), json_value))
def test_squad_reader_on_mutated_structures(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("squad") / "f.json"
    path.write_text(json.dumps(blob))
    _check_squad(path)


@fuzz("squad_bytes")
@given(st.data())
def test_squad_reader_on_corrupted_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("squad") / "f.json"
    path.write_bytes(_flip(json.dumps(SQUAD, indent=1).encode(), data.draw))
    _check_squad(path)


# ---------------------------------------------------------------- corpora
SAMPLES = sorted(p for p in (ROOT / "data" / "samples").rglob("*")  # the corpus samples, not the labelled sets
                 if p.is_file() and p.suffix != ".md" and "labelled" not in p.parts)
_CORPUS_LINES = sorted({line for p in SAMPLES for line in p.read_text(encoding="utf-8").split("\n")[:12]} | {
    "", " ", "\r", '<doc id="1" url="u" title="a > "b"">', "<doc>", "</doc>", " = T = ", " = = S = = ", " = = = = ",
    " = =", "=  =", '{"text": "One. Two.\\nThree."}', '{"text": 5}', '{"text": "\\ud800"}', "[" * 50, "{}", "{",
    " a @-@ b @,@ c @.@ d <unk> ' s \" q \" ( x ) $ 5 % . ", "Dr. Vey. St. Oren? Yes! No…", "\u2028\xa0\x0b\x0c"})
corpus_line = st.one_of(st.sampled_from(_CORPUS_LINES), st.text(max_size=30),
                        st.text(alphabet=" .!?=@-,<>/\"'\\{}[]()adoc\n\r\t", max_size=30))
corpus_text = st.lists(corpus_line, max_size=25).map("\n".join)


def _check_documents(docs, stats) -> None:
    """A correct result: documents of non-empty, stripped sentences that the counts describe."""
    assert all(d and all(isinstance(s, str) and s and s == s.strip() for s in d) for d in docs), docs
    assert (stats.documents, stats.sentences) == (len(docs), sum(map(len, docs)))


@fuzz("corpus")
@given(corpus_text)
def test_corpus_readers_on_random_text(text):
    for fmt in FORMATS:
        try:
            docs, stats = read_text(text, fmt, Where("fuzz.txt"))
        except ValueError as e:
            clean(e, "fuzz.txt")
            continue
        _check_documents(docs, stats)
    if any(line.strip() for line in text.split("\n")):
        assert detect_format(text).format in FORMATS


@fuzz("corpus_bytes")
@given(st.data())
def test_corpus_files_on_corrupted_bytes_whole_and_in_shards(tmp_path_factory, data):
    """A corrupted sample reads as a whole, or fails with a clean error; cut into shards of any
    size, it reads the same documents (or fails the same way)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(_flip(data.draw(st.sampled_from(SAMPLES)).read_bytes(), data.draw))
    fmt = data.draw(st.sampled_from(["auto", *FORMATS]))
    try:
        whole = plan_file(path, fmt, shard_bytes=1 << 40)
        docs, stats = read_split(whole.splits[0])
    except ValueError as e:
        clean(e, path)
        docs = None
    else:
        _check_documents(docs, stats)
    try:
        plan = plan_file(path, fmt, shard_bytes=data.draw(st.integers(1, 4096)))
        pieces = [read_split(s)[0] for s in plan.splits]
    except ValueError as e:
        clean(e, path)
        assert docs is None, f"{e} in a shard, but the whole file reads"
        return
    assert [s.start for s in plan.splits[1:]] == [s.end for s in plan.splits[:-1]]
    if docs is not None and plan.cuts_inside_documents:  # a document longer than a shard was cut at a line
        assert [s for d in sum(pieces, []) for s in d] == [s for d in docs for s in d]
    elif docs is not None:
        assert sum(pieces, []) == docs


# ----------------------------------------------------------------- config
CONFIG = json.loads((ROOT / "configs/squad_tiny.json").read_text())


@fuzz("config")
@given(st.one_of(mutated(CONFIG), json_value))
def test_config_from_dict_on_mutated_structures(blob):
    try:
        config = config_from_dict(blob, "fuzz.json") if isinstance(blob, dict) else None
    except ValueError as e:
        clean(e, "fuzz.json")
        return
    if config is None:
        return
    assert config.model.sequence_length <= config.model.max_positions  # a valid config keeps its rules
    assert config_from_dict(config.model_dump(mode="json")) == config


@fuzz("config_file")
@given(st.data())
def test_load_config_on_corrupted_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("config") / "c.json"
    path.write_bytes(_flip(json.dumps(CONFIG, indent=1).encode(), data.draw))
    try:
        load_config(path)
    except ValueError as e:
        clean(e, path)


# ------------------------------------------------------------------ sweep
SWEEP = yaml.safe_load((ROOT / "configs/sweeps/tiny.yaml").read_text())


@fuzz("sweep")
@given(st.one_of(mutated(SWEEP), json_value))
def test_sweep_spec_on_mutated_structures(blob):
    try:
        spec_from_dict(blob, "fuzz.yaml")
    except ValueError as e:
        clean(e, "fuzz.yaml")


@fuzz("sweep_file")
@given(st.data())
def test_load_spec_on_corrupted_text(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("sweep") / "s.yaml"
    path.write_bytes(_flip(yaml.safe_dump(SWEEP).encode(), data.draw))  # bytes that are not UTF-8 too
    try:
        load_spec(path)
    except ValueError as e:
        message = str(e)
        assert str(path) in message, message  # YAML's own messages span lines: named, as the sweep reader words them


def test_load_spec_names_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"\x80" + yaml.safe_dump(SWEEP).encode())
    with pytest.raises(ValueError, match=str(path)):
        load_spec(path)


# ------------------------------------------------------ a sweep's storage
@pytest.fixture(scope="module")
def sweep_journal(tmp_path_factory):
    """A real sweep's journal: a grid of three, trial 0 finished with a curve, trial 1 running with a
    heartbeat, trial 2 interrupted and queued again as trial 3."""
    from bert.sweep.storage import BEAT, quiet_optuna, requeue
    from bert.sweep.worker import _Worker

    root = tmp_path_factory.mktemp("journal")
    spec, base = load_spec(ROOT / "configs/sweeps/tiny.yaml"), load_config(ROOT / "configs/sweeps/tiny.json")
    with quiet_optuna():
        study, storage = open_study(spec, base, str(root / "optuna.journal"))
        worker = _Worker(spec, base, root, study, storage, False, False, 10.0)
        first, _ = worker._claim()
        first.report(4.5, 1)
        first.report(4.25, 2)
        first.set_user_attr("output_dir", str(root / "trial-0"))
        study.tell(first, 4.0)
        second, _ = worker._claim()
        storage.set_trial_system_attr(worker._id(second.number), BEAT, 1.0e9)
        third, _ = worker._claim()
        third.set_user_attr("error", "interrupted: stopped by SIGINT at step 3")
        study.tell(third, state=TrialState.FAIL)
        requeue(study, storage.get_trial(worker._id(third.number)))
    return spec, base, (root / "optuna.journal").read_bytes()


def _read_sweep(spec, base, journal: Path) -> None:
    """What a worker reads before it runs anything, and the report: a clean error or a readable sweep."""
    from bert.sweep.storage import quiet_optuna

    try:
        with quiet_optuna():
            study, _ = open_study(spec, base, str(journal))
            rows, _, _ = write_report(study, spec, journal.parent, plots=False)
    except ValueError as e:
        clean(e, journal)
        return
    assert {r["state"] for r in rows} <= {"finished", "pruned", "running", "waiting", "interrupted", "failed",
                                         "diverged"}
    assert (journal.parent / "runs.csv").exists()


# What the sweep writes itself: its study's attribute and its trials' attributes. The records around
# them are Optuna's to read (bert/sweep/storage.py); a record Optuna refuses is a clean error too.
_ATTRIBUTE_FIELDS = {2: "user_attr", 8: "user_attr", 9: "system_attr", 4: "user_attrs"}


@fuzz("journal_records")
@given(st.data())
def test_sweep_journal_with_mutated_attributes(sweep_journal, tmp_path_factory, data):
    spec, base, good = sweep_journal
    lines = good.splitlines(keepends=True)
    at = data.draw(st.sampled_from([i for i, line in enumerate(lines)
                                    if json.loads(line)["op_code"] in _ATTRIBUTE_FIELDS]))
    record = json.loads(lines[at])
    field = _ATTRIBUTE_FIELDS[record["op_code"]]
    if record["op_code"] == 4:
        field = data.draw(st.sampled_from(["user_attrs", "system_attrs"]))
    attributes = record[field]
    if attributes:
        name = data.draw(st.sampled_from(sorted(attributes)))
        attributes[name] = data.draw(st.one_of(mutated(attributes[name]), json_value))
    else:
        attributes[data.draw(st.sampled_from(["values", "output_dir", "error", "heartbeat", "requeued"]))] = \
            data.draw(json_value)
    changed = json.dumps(record).encode() + b"\n"
    where = data.draw(st.sampled_from(["replace", "insert", "append"]))
    lines = (lines[:at] + [changed] + lines[at + (where == "replace"):]) if where != "append" else lines + [changed]
    journal = tmp_path_factory.mktemp("journal") / "optuna.journal"
    journal.write_bytes(b"".join(lines))
    _read_sweep(spec, base, journal)


def test_a_stored_grid_point_holding_a_line_break_is_named_on_one_line(sweep_journal, tmp_path):
    """The case the byte fuzzer found once (the journal's record times make its inputs vary run to
    run): a damaged grid point with a line break in it, named in the refusal as it is stored."""
    spec, base, good = sweep_journal
    point = b'{\\"optimizer.learning_rate\\": 0.001}'
    assert good.count(point) == 1, "the fixture's sweep record no longer holds this grid point"
    journal = tmp_path / "optuna.journal"
    journal.write_bytes(good.replace(point, b'{\\n\\"optimizer.learning_rate\\": 0.001}'))
    from bert.sweep.storage import quiet_optuna

    with quiet_optuna(), pytest.raises(ValueError, match="the grid lost 1 of its points") as e:
        open_study(spec, base, str(journal))
    assert "\n" not in str(e.value), str(e.value)
    clean(e.value, journal)


def test_a_journal_that_lost_the_sweeps_attribute_after_trials_ran_is_refused_at_once(sweep_journal, tmp_path):
    """The record that sets the study's 'sweep' attribute (settings and grid), damaged or lost
    in a journal whose trials have run, is named at once: a worker waited 60 s for a creator
    still enqueueing the grid (two such flips made the byte fuzzer take two minutes)."""
    spec, base, good = sweep_journal
    lines = good.splitlines(keepends=True)
    kept = [line for line in lines if not (b'"op_code":2' in line and b'"sweep"' in line)]
    assert len(kept) == len(lines) - 1, "the fixture's journal no longer sets the attribute in one record"
    journal = tmp_path / "optuna.journal"
    journal.write_bytes(b"".join(kept))
    from bert.sweep.storage import quiet_optuna

    with quiet_optuna(), pytest.raises(ValueError, match="trials have run, but its attribute 'sweep'") as e:
        open_study(spec, base, str(journal))
    clean(e.value, journal)


@fuzz("journal_bytes")
@given(st.data())
def test_sweep_journal_with_corrupted_bytes(sweep_journal, tmp_path_factory, data):
    spec, base, good = sweep_journal
    journal = tmp_path_factory.mktemp("journal") / "optuna.journal"
    journal.write_bytes(_flip(good, data.draw))
    _read_sweep(spec, base, journal)


# ------------------------------------------------------------- inference
@pytest.fixture(scope="module")
def inference():
    from bert import build_model
    from session import InferenceSession

    cfg = tiny_config("groupbert")
    session = InferenceSession(build_model(cfg).builder.model_proto())
    return cfg, session, session.run(random_batch(cfg, 2))


_arrays = st.sampled_from(["int64", "int32", "int8", "uint8", "float32", "bool", "float64"])


@st.composite
def feeds(draw, cfg):
    batch = random_batch(cfg, draw(st.integers(1, 3)), seed=draw(st.integers(0, 5)))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(batch) + ["extra"]))
        op = draw(st.sampled_from(["value", "dtype", "shape", "drop", "list", "scalar"]))
        if op in ("value", "dtype", "list") and key in batch and not isinstance(batch[key], np.ndarray):
            op = "shape"  # already replaced by a non-array
        if op == "value" and batch.get(key) is not None and batch[key].size == 0:
            op = "dtype"
        if key == "extra" or op == "drop":
            batch.pop(key, None) if op == "drop" else batch.__setitem__("extra", np.zeros(2))
        elif op == "value":
            arr = batch[key].copy()
            arr.flat[draw(st.integers(0, arr.size - 1))] = draw(st.integers(-2**31, 2**31 - 1))
            batch[key] = arr
        elif op == "dtype":
            batch[key] = batch[key].astype(draw(_arrays))
        elif op == "shape":
            shape = draw(st.lists(st.integers(0, 25), min_size=0, max_size=3))
            batch[key] = np.zeros(shape, np.int64)
        elif op == "list":
            batch[key] = batch[key].tolist() if draw(st.booleans()) else [[1, 2], [3]]
        else:
            batch[key] = draw(st.one_of(st.integers(), st.text(max_size=3), st.none()))
    return batch


@fuzz("inference")
@given(st.data())
def test_inference_session_run_on_random_feeds(inference, data):
    cfg, session, _ = inference
    batch = data.draw(feeds(cfg))
    before = {k: copy.deepcopy(v) for k, v in batch.items()}
    try:
        out = session.run(batch)
    except ValueError as e:
        clean(e, *session.input_names, "inputs")
    else:
        assert set(out) >= {"mlm_logits", "loss"} and all(bool(v.isfinite().all()) for v in out.values())
    for k, v in before.items():  # the caller's arrays are never changed
        assert type(batch[k]) is type(v) and np.array_equal(np.asarray(batch[k], dtype=object),
                                                            np.asarray(v, dtype=object))


# --------------------------------------------------------- files on disk
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from bert import build_model
    from session.schedules import Schedule
    from session.training import OptimizerSpec, TrainingSession

    cfg = tiny_config("bert", num_layers=1)
    make = lambda: TrainingSession(build_model(cfg).builder.model_proto(),  # noqa: E731
                                   optimizer=OptimizerSpec(kind="adamw", schedule=Schedule(1e-3, 0, 10)))
    session = make()
    session.run(random_batch(cfg, 2))
    directory = session.save(tmp_path_factory.mktemp("ckpt") / "checkpoint-1", {"data": {"position": 1}})
    return make, directory


@fuzz("checkpoint")
@given(st.data())
def test_training_session_load_of_a_corrupted_checkpoint(checkpoint, tmp_path_factory, data):
    make, directory = checkpoint
    copy_ = tmp_path_factory.mktemp("corrupt") / "checkpoint-1"
    shutil.copytree(directory, copy_)
    # checksums.json itself: see test_a_checksum_file_that_is_not_utf8_is_named below.
    files = sorted(p for p in copy_.rglob("*") if p.is_file() and p.name != "checksums.json")
    victim = data.draw(st.sampled_from(files))
    changed = _flip(victim.read_bytes(), data.draw)
    victim.write_bytes(changed)
    try:
        extra = make().load(copy_)
    except ValueError as e:
        clean(e, victim, copy_)
    else:  # only a change that left the bytes as they were may load
        assert changed == (directory / victim.relative_to(copy_)).read_bytes(), victim
        assert extra["data"] == {"position": 1}


def test_a_checksum_file_that_is_not_utf8_is_named(checkpoint, tmp_path):
    make, directory = checkpoint
    copy_ = tmp_path / "checkpoint-1"
    shutil.copytree(directory, copy_)
    sums = copy_ / "checksums.json"
    sums.write_bytes(b"\xfb" + sums.read_bytes()[1:])
    with pytest.raises(ValueError, match=re.escape(f"{copy_}: checksums.json is corrupt")):
        make().load(copy_)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from tests.test_faults_inputs import write_shard

    return write_shard(tmp_path_factory.mktemp("shard") / "good.hdf5")


@fuzz("shard")
@given(st.data())
def test_loader_on_a_corrupted_shard(shard, tmp_path_factory, data):
    from data import PretrainingLoader
    from tests.test_faults_inputs import P, S, V

    path = tmp_path_factory.mktemp("shard") / "bad.hdf5"
    path.write_bytes(_flip(shard.read_bytes(), data.draw))
    try:
        loader = PretrainingLoader([path], 4, prefetch=0, verbose=False, drop_last=False)
        batches = [next(iter(loader)) for _ in range(1)]
        loader.close()
    except ValueError as e:
        clean(e, path)
        return
    for b in batches:  # read as valid: every value within what the shard declares
        assert b["input_ids"].shape[1] == S and b["masked_lm_positions"].shape[1] == P
        assert int(b["input_ids"].max()) < V and int(b["input_ids"].min()) >= 0
        assert set(np.unique(b["input_mask"].numpy())) <= {0, 1}


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory):
    from bert import build_model
    from bert.io.export import export_serving

    cfg = tiny_config("bert", task="squad", num_layers=1)
    path = tmp_path_factory.mktemp("onnx") / "m.onnx"
    export_serving(build_model(cfg, with_loss=False).builder.model_proto(),
        path, extra_metadata={"task": "squad", "config": json.dumps(cfg.model_dump(mode="json"))})
    return cfg, path


@fuzz("onnx")
@given(st.data())
def test_onnx_readers_on_corrupted_files(onnx_export, tmp_path_factory, data):
    import infer
    from session import InferenceSession

    cfg, good = onnx_export
    path = tmp_path_factory.mktemp("onnx") / "bad.onnx"
    path.write_bytes(_flip(good.read_bytes(), data.draw))
    feeds_ = {k: np.ones((1, 7), np.int64) for k in ("input_ids", "segment_ids", "input_mask")}
    for load in (InferenceSession, infer.OnnxModel):
        try:
            model = load(path)
        except ValueError as e:
            clean(e, path)
            continue
        try:
            out = model.run(feeds_)
        except ValueError as e:  # a graph that loads but whose inputs changed: named by the input check
            clean(e, *feeds_, "input", path)
            continue
        assert {"start_logits", "end_logits"} <= set(out)


# ------------------------------------------------------------ the run directory
_HOLDER = json.dumps({"host": "node-7", "pid": 4242, "since": "2026-11-24 10:00:00 +0000",
                      "command": "python3 bert.py --config configs/demo.json"}).encode() + b"\n"


@fuzz("run_lock")
@given(st.data())
def test_a_run_lock_of_any_content_names_its_holder_in_one_line_and_is_claimed_over(tmp_path_factory, data):
    """A lock file left by a killed holder (torn, foreign, empty): its holder is named in one
    line and the directory is claimed all the same."""
    from bert.run.rundir import LOCK_FILE, claim, read_holder

    raw = data.draw(st.one_of(st.binary(max_size=200), st.builds(lambda d: d, st.just(_HOLDER)).map(
        lambda b: _flip(b, data.draw)), mutated(json.loads(_HOLDER)).map(lambda v: json.dumps(v).encode())))
    run = tmp_path_factory.mktemp("run")
    (run / LOCK_FILE).write_bytes(raw)
    text = read_holder(run / LOCK_FILE)
    assert text and "\n" not in text, repr(text)
    with claim(run) as held:
        assert held.stale is None if not raw.strip() else held.stale and "\n" not in held.stale, (raw, held.stale)
    assert not (run / LOCK_FILE).exists()


_BEST = {"checkpoint": "checkpoint-best", "step": 1200, "metric": "eval_loss", "value": 5.19, "goal": "minimize"}


@fuzz("best")
@given(st.data())
def test_best_json_of_any_content_is_read_checked_or_named(tmp_path_factory, data):
    from bert.run.rundir import BEST_FILE, read_best

    run = tmp_path_factory.mktemp("run")
    blob = data.draw(st.one_of(mutated(_BEST), json_value))
    raw = json.dumps(blob).encode()
    if data.draw(st.booleans()):
        raw = _flip(raw, data.draw)
    (run / BEST_FILE).write_bytes(raw)
    try:
        best = read_best(run)
    except ValueError as e:
        clean(e, run / BEST_FILE)
        return
    assert best["checkpoint"] is None or isinstance(best["checkpoint"], str) and "/" not in best["checkpoint"]
    assert isinstance(best["step"], int) and isinstance(best["value"], (int, float)) and math.isfinite(best["value"])
    assert best["goal"] in ("minimize", "maximize") and isinstance(best["metric"], str)


@fuzz("history")
@given(st.data())
def test_a_metrics_history_of_any_content_is_split_at_the_checkpoint_or_named(tmp_path_factory, data):
    """Resume's reader of metrics.jsonl: the records up to the step and a count of the rest, or
    one line naming the file and the line; never a record past the step kept."""
    from bert.run.rundir import read_history

    records = data.draw(st.lists(st.fixed_dictionaries({"step": st.integers(0, 30)}, optional={
        "loss": st.floats(allow_nan=False), "eval_loss": st.floats(0, 10)}), max_size=12))
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    if raw and data.draw(st.booleans()):
        raw = _flip(raw, data.draw)
    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    path.write_bytes(raw)
    step = data.draw(st.integers(0, 30))
    try:
        kept, dropped = read_history(path, step)
    except ValueError as e:
        clean(e, path)
        return
    lines = raw.decode().split("\n")
    assert kept == [line + "\n" for line in lines[:-1] if json.loads(line)["step"] <= step], "the records, as written"
    assert len(kept) + dropped == len(lines) - (lines[-1] == ""), "every line is kept or counted"
