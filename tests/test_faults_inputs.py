"""Bad inputs a user can give: config files and overrides, the command line, shards, and
InferenceSession feeds. Each case asserts that the error names the culprit (key and
file, shard + dataset + row, input name) and, where a run directory exists, that
nothing already written changed. Each fails if its check is removed: the fault would
pass silently or end in an error that names nothing.
"""
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import data.shards
from bert import build_model, config_from_dict, load_config, with_overrides
from bert.tasks.pretraining import train
from custom_ops.grouped_conv1d import MAX_CHANNELS_PER_GROUP
from data import PretrainingLoader
from data.pretraining import SAMPLE_KEYS
from session import InferenceSession
from tests.helpers import merge_settings, random_batch, sections, tiny_bert_source, tiny_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"architecture": "groupbert", "hidden_size": 48, "num_layers": 1, "num_heads": 3, "vocab_size": 101,
         "sequence_length": 16, "max_predictions": 3, "max_positions": 32}


def tiny_run_config(output_dir, **training) -> dict:
    return {"name": "faults", "model": dict(MODEL),
            **sections(steps=2, micro_batch_size=2, output_dir=str(output_dir), log_every=1, **training),
            "data": {"source": "synthetic"}}


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------- config files

def _write(tmp_path, text: str | bytes, name="bad.json") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _with(section: str, **fields) -> str:
    cfg = tiny_run_config("runs/x")
    cfg.setdefault(section, {}).update(fields)
    return json.dumps(cfg)


CONFIG_FAULTS = {
    # case: (file text, pattern the message must match besides the file name)
    "unknown key": (_with("training", stepz=3), r"unknown key 'training\.stepz' \(value 3\)"),
    "true for an int": (_with("training", steps=True), r"training\.steps = true: .*valid integer"),
    "string for an int": (_with("model", num_layers="5"), r"model\.num_layers = '5': .*valid integer"),
    "fraction for an int": (_with("batch", micro_batch_size=1.5), r"batch\.micro_batch_size = 1\.5: .*integer"),
    "1 for a bool": (_with("training", recompute=1), r"training\.recompute = 1: .*valid boolean"),
    "NaN": (_with("optimizer", learning_rate=1.0).replace('"learning_rate": 1.0', '"learning_rate": NaN'),
            r"optimizer\.learning_rate = NaN: .*finite"),
    "duplicate key": (_with("training").replace('"steps": 2', '"steps": 2, "steps": 5'), r"key 'steps' appears more"),
    "bad JSON": ('{"name": "x",\n "model": {', r"not valid JSON: .*line 2"),
    "array at top level": ("[1, 2]", r"holds a JSON list, not an object"),
    "not UTF-8": (b'{"name": "\xff"}', r"not UTF-8 text \(byte 10\)"),
    "missing section key": (json.dumps({"model": {"architecture": "bert"}}), r"missing key 'model\.hidden_size'"),
    "union value": (_with("precision", dtype="fp16", loss_scaling="5"), r"precision\.loss_scaling = '5'"),
    "channels per conv group over the kernels' limit":
        (_with("model", hidden_size=2 * 2 * MAX_CHANNELS_PER_GROUP, num_heads=4, conv_group_size=2 * MAX_CHANNELS_PER_GROUP),
         rf"conv_group_size {2 * MAX_CHANNELS_PER_GROUP} exceeds {MAX_CHANNELS_PER_GROUP}"),
    "every position masked": (_with("model", max_predictions=16), r"max_predictions 16 must be below sequence_length 16"),
    "one segment type": (_with("model", type_vocab_size=1), r"model\.type_vocab_size 1 is below 2"),
    "not a torch device": (_with("training", device="gpu0"), r"training\.device = 'gpu0': .*not a torch device"),
    "unknown placeholder in output_dir": (_with("training", output_dir="runs/{nam}"),
                                          r"training\.output_dir = 'runs/\{nam\}': .*only the placeholder \{name\}"),
    "loss scale without fp16": (_with("precision", loss_scaling=1024),
                                r"precision: loss_scaling 1024\.0 applies to dtype 'fp16' only"),
    "warm-up longer than the run": (_with("schedule", warmup_steps=10),
                                    r"schedule\.warmup_steps 10 exceeds training\.steps 2"),
    "a version-1 key in a version-2 file": (_with("training", learning_rate=0.1).replace('{', '{"version": 2, ', 1),
                                            r"unknown key 'training\.learning_rate' \(value 0\.1\): version 2 "
                                            r"names it optimizer\.learning_rate"),
    "both names of one setting": (json.dumps(merge_settings({**tiny_run_config("runs/x"), "training": {
                                      "steps": 2, "learning_rate": 0.1}}, learning_rate=0.2)),
                                  r"training\.learning_rate and optimizer\.learning_rate are the same setting"),
    "a newer version": (_with("training").replace('{', '{"version": 4, ', 1),
                        r"version 4 is newer than this bert\.py reads \(version 3\)"),
    "negative seed": (_with("training", seed=-1), r"training\.seed = -1"),
}


@pytest.mark.parametrize("case", CONFIG_FAULTS)
def test_config_file_faults_name_the_key_and_file(tmp_path, case):
    text, pattern = CONFIG_FAULTS[case]
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and "\n" not in message, message
    assert __import__("re").search(pattern, message), f"{case}: {message!r} does not match {pattern!r}"


@pytest.mark.parametrize("section, key, value, says", [
    ("model", "learning_rate", 0.1, "unknown key 'model.learning_rate' (value 0.1): learning_rate belongs to optimizer, "
                                    'not model: move it into the "optimizer" section'),
    ("data", "epochs", 2, "unknown key 'data.epochs' (value 2): epochs belongs to training, not data: move it into the "
                          '"training" section'),
    (None, "warmup_steps", 5, "unknown key 'warmup_steps' (value 5): warmup_steps belongs to schedule, not the top "
                              'level: move it into the "schedule" section'),
    ("training", "every", 5, 'every belongs to checkpoint or evaluation, not training: move it into the "checkpoint" '
                             'or "evaluation" section'),
    ("model", "name", "x", 'name belongs to the top level or optimizer, not model: move it to the top level or into '
                           'the "optimizer" section'),
    ("training", "stepz", 3, "unknown key 'training.stepz' (value 3): did you mean training.steps?"),
    ("model", "learnin_rate", 0.1, "unknown key 'model.learnin_rate' (value 0.1): did you mean optimizer.learning_rate?"),
], ids=["model.learning_rate", "data.epochs", "top level", "two sections", "a top-level key", "misspelt",
        "misspelt, other section"])
def test_a_key_in_the_wrong_section_of_a_file_names_where_it_belongs(tmp_path, section, key, value, says):
    """Issue 51: a key in the wrong section said "unknown, check the spelling" and named no section."""
    config = tiny_run_config("runs/x")
    (config if section is None else config.setdefault(section, {}))[key] = value
    path = _write(tmp_path, json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"invalid config {path}: ") and says in message and "\n" not in message, message
    assert "check the spelling" not in message, "the fix is known: the line names it"


def test_an_int_is_a_fine_float_and_the_presets_load_as_version_3(tmp_path, capsys):
    cfg = load_config(_write(tmp_path, _with("optimizer", learning_rate=1)))
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)
    for preset in sorted((ROOT / "configs").rglob("*.json")):
        assert json.loads(preset.read_text())["version"] == 3, preset
        load_config(preset)
    assert capsys.readouterr().out == "", "a shipped config needed its keys mapped"


def test_old_keys_as_overrides_are_mapped_each_with_one_line(monkeypatch, capsys):
    import bert.config

    monkeypatch.setattr(bert.config, "_noted", set())
    base = config_from_dict(tiny_run_config("runs/x"))
    for _ in range(2):  # said once per process
        cfg = with_overrides(base, {"training.learning_rate": 0.5, "training.precision": "bf16",
                                    "training.eval_every": 3, "training.steps": 4})
        assert (cfg.optimizer.learning_rate, cfg.precision.dtype, cfg.evaluation.every) == (0.5, "bf16", 3)
        assert cfg.training.steps == 4
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [
        "training.learning_rate is now optimizer.learning_rate", "training.precision is now precision.dtype",
        "training.eval_every is now evaluation.every"], lines
    assert all(line.startswith("note: ") and "command line gives its version-1 name" in line for line in lines)


def test_config_path_faults(tmp_path):
    with pytest.raises(ValueError, match=f"config file {tmp_path / 'none.json'} does not exist"):
        load_config(tmp_path / "none.json")
    with pytest.raises(ValueError, match=f"config file {tmp_path} is not a file"):
        load_config(tmp_path)


def test_device_not_offered_by_torch_is_named():
    if torch.version.cuda is None:
        device, pattern = "cuda", r"training\.device = 'cuda': .*CPU-only"
    else:  # a CUDA build: ask for a device index it does not have
        device, pattern = "cuda:999", r"training\.device = 'cuda:999': .*(sees only|no CUDA device)"
    with pytest.raises(ValueError, match=pattern):
        config_from_dict(json.loads(_with("training", device=device)))


@pytest.mark.parametrize("override, pattern", [
    ({"trainer.steps": 3}, r"'trainer' is not a config section \(sections: model, data, training, optimizer, "
                           r"schedule, batch, precision, checkpoint, evaluation, parallel, budget\)"),
    ({"model.hidden_size.x": 3}, r"'hidden_size' is not a config section"),
    ({"training.steps": "5"}, r"command line: training\.steps = '5'"),
])
def test_override_faults_name_the_override(override, pattern):
    cfg = config_from_dict(tiny_run_config("runs/x"))
    with pytest.raises(ValueError, match=pattern):
        with_overrides(cfg, override, "command line")


# ----------------------------------------------------------------------- CLI

def _cli():
    """bert.py's main(); the package `bert/` shadows the script's module name."""
    spec = importlib.util.spec_from_file_location("bert_cli", ROOT / "bert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A finished run (config, metrics, checkpoint) that later bad commands must not touch."""
    runs = tmp_path_factory.mktemp("runs")
    config = runs / "faults.json"
    config.write_text(json.dumps(tiny_run_config(runs / "faults")))
    result = train(load_config(config), progress=False)
    return runs, config, result


@pytest.mark.parametrize("argv, pattern", [
    ([], r"error: name a subcommand \(train, eval, export, export-hf, summary, sweep, compare\)"),
    (["--config"], r"error: argument --config: expected one argument"),
    (["--sumary"], r"error: unrecognised argument '--sumary'"),
    (["--training.steps"], r"error: override --training\.steps needs a value"),
    (["--training.steps", "true"], r"error: invalid config command line .*training\.steps = true"),
    (["--model.hidden_size=50"], r"error: invalid config command line .*hidden_size 50 is not divisible"),
    (["--nosuch.key", "1"], r"error: invalid override 'nosuch\.key'"),
    (["--data.source", "shards", "--data.files", '["nothing-*.hdf5"]'], r"error: data\.files \['nothing-\*\.hdf5'\] match no file"),
    (["--training.init_from", "missing-checkpoint"], r"error: .*missing-checkpoint"),
], ids=["no config", "config without value", "misspelt flag", "override without value", "bad override value",
        "inconsistent sizes", "unknown section", "shard glob matches nothing", "missing init_from"])
def test_cli_mistakes_end_in_one_error_line_and_touch_nothing(earlier_run, capsys, argv, pattern):
    runs, config, _ = earlier_run
    before = snapshot(runs)
    full = argv if argv[:1] == ["--config"] or not argv else ["--config", str(config), *argv]
    assert _cli()(full) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert __import__("re").search(pattern, err), f"{err!r} does not match {pattern!r}"
    assert snapshot(runs) == before, "a rejected command changed files of the earlier run"


def test_bad_shard_stops_a_resume_before_anything_is_written(earlier_run, tmp_path, capsys):
    runs, config, result = earlier_run
    bad = write_shard(tmp_path / "bad.hdf5", lambda d: d["input_ids"].__setitem__((5, 2), 101))
    before = snapshot(runs)
    argv = ["--config", str(config), "--checkpoint-input", str(result.checkpoint), "--training.steps", "4",
            "--data.source", "shards", "--data.files", json.dumps([str(bad)])]
    assert _cli()(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"error: shard {bad}: dataset input_ids, row 5: token id 101 (column 2)" in err, err
    assert snapshot(runs) == before, "the resumed run's files changed"


def test_internal_errors_are_one_line_and_debug_shows_the_traceback(earlier_run, monkeypatch, capsys):
    _, config, _ = earlier_run

    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr("bert.tasks.pretraining.train", broken)
    main = _cli()
    assert main(["--config", str(config)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: internal error (RuntimeError: a bug over two lines); this is a bug: rerun with --debug "
                   "for the traceback and report it")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["--config", str(config), "--debug"])


@pytest.mark.slow
def test_cli_process_exit_code_and_stderr(tmp_path):
    path = _write(tmp_path, _with("training", steps="many"))
    result = subprocess.run([sys.executable, "bert.py", "summary", "--config", str(path)],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: invalid config {path}: training.steps = 'many': Input should be a valid integer"


# ---------------------------------------------------------------------- shards

N, S, P, V = 40, 16, 3, 101


def write_shard(path: Path, mutate=None, dtypes=None) -> Path:
    """A valid shard of N rows (NVIDIA layout, chunks of 8 rows), changed by `mutate(arrays)`."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(P + 3, S + 1, N)
    real = np.arange(S)[None, :] < lengths[:, None]
    arrays = {
        "input_ids": np.where(real, rng.integers(5, V, (N, S)), 0).astype(np.int32),
        "input_mask": real.astype(np.int8),
        "segment_ids": (real & (np.arange(S)[None, :] >= lengths[:, None] // 2)).astype(np.int8),
        "masked_lm_positions": np.sort(np.stack([rng.choice(np.arange(1, n), P, replace=False) for n in lengths]),
                                       axis=1).astype(np.int32),
        "masked_lm_ids": rng.integers(5, V, (N, P)).astype(np.int32),
        "next_sentence_labels": rng.integers(0, 2, N).astype(np.int8),
    }
    arrays["masked_lm_positions"][N - 1, P - 1] = 0  # an unused slot, last
    arrays["masked_lm_ids"][N - 1, P - 1] = 0
    if mutate is not None:
        mutate(arrays)
    with h5py.File(path, "w") as f:
        for key in SAMPLE_KEYS:
            value = arrays[key].astype((dtypes or {}).get(key, arrays[key].dtype))
            f.create_dataset(key, data=value, chunks=(8,) + value.shape[1:], compression="gzip")
        f.attrs["seq_len"], f.attrs["max_predictions"], f.attrs["vocab_size"] = S, P, V
    return path


def _set(key, index, value):
    return lambda d: d[key].__setitem__(index, value)


def _both(*changes):
    def mutate(d):
        for change in changes:
            change(d)
    return mutate


SHARD_FAULTS = {
    # case: (mutation, model vocab or None, dataset, row, pattern)
    "token id past the model's vocab": (_both(_set("input_ids", (29, 3), 160), _set("input_ids", (35, 1), 170)), V,
                                        "input_ids", 29, r"token id 160 \(column 3\) is outside the model's vocab \[0, 101\)"),
    "token id past the shard's vocab": (_set("input_ids", (12, 0), V), None, "input_ids", 12,
                                        r"token id 101 \(column 0\) is outside the shard's vocab \[0, 101\)"),
    "negative token id": (_set("input_ids", (3, 4), -7), None, "input_ids", 3, r"token id -7"),
    "mask value 2": (_set("input_mask", (30, 0), 2), None, "input_mask", 30, r"mask value 2 \(column 0\) is not 0 or 1"),
    "token after padding": (_set("input_mask", (8, S - 1), 1), None, "input_mask", 8,
                            r"a real token \(column 15\) follows padding"),
    "segment id 2": (_set("segment_ids", (17, 1), 2), None, "segment_ids", 17, r"segment id 2 \(column 1\)"),
    "position past the sequence": (_set("masked_lm_positions", (21, 2), S), None, "masked_lm_positions", 21,
                                   r"position 16 \(slot 2\) is outside the sequence \[0, 16\)"),
    "position on padding": (_both(_set("input_mask", (6, slice(5, None)), 0), _set("masked_lm_positions", (6, 0), 1),
                                  _set("masked_lm_positions", (6, 1), 2), _set("masked_lm_positions", (6, 2), 9)),
                            None, "masked_lm_positions", 6, r"position 9 \(slot 2\) points at padding"),
    "used slot after an unused one": (_set("masked_lm_positions", (20, 0), 0), None, "masked_lm_positions", 20,
                                      r"a used slot \(1\) follows an unused one"),
    "masked_lm_id past the vocab": (_set("masked_lm_ids", (33, 1), 500), 200, "masked_lm_ids", 33,
                                    r"id 500 \(slot 1\) is outside the model's vocab \[0, 200\)"),
    "NSP label 2": (_set("next_sentence_labels", 26, 2), None, "next_sentence_labels", 26, r"label 2 is not 0 or 1"),
}


@pytest.mark.parametrize("case", SHARD_FAULTS)
def test_shard_faults_name_shard_dataset_and_first_bad_row(tmp_path, monkeypatch, case):
    mutate, vocab, dataset, row, pattern = SHARD_FAULTS[case]
    monkeypatch.setattr(data.shards, "_CHECK_ELEMENTS", 8 * S)  # blocks of 8 rows: row numbers cross blocks
    good = write_shard(tmp_path / "good.hdf5")
    bad = write_shard(tmp_path / "bad.hdf5", mutate)
    with pytest.raises(ValueError) as error:
        PretrainingLoader([good, bad], 4, model_vocab_size=vocab, verbose=False)
    message = str(error.value)
    assert message.startswith(f"shard {bad}: dataset {dataset}, row {row}: "), message
    assert __import__("re").search(pattern, message), f"{case}: {message!r} does not match {pattern!r}"


def test_the_valid_shard_loads_and_float_ids_are_refused_not_rounded(tmp_path):
    good = write_shard(tmp_path / "good.hdf5")
    batch = next(iter(PretrainingLoader([good], 4, model_vocab_size=V, prefetch=0)))
    assert batch["input_ids"].shape == (4, S)
    bool_mask = write_shard(tmp_path / "bool_mask.hdf5", dtypes={"input_mask": bool})
    PretrainingLoader([bool_mask], 4, model_vocab_size=V, prefetch=0).close()
    floats = write_shard(tmp_path / "floats.hdf5", _set("input_ids", (2, 2), 7.6), dtypes={"input_ids": np.float32})
    with pytest.raises(ValueError, match=f"shard {floats}: dataset input_ids holds float32 values; .*never rounded"):
        PretrainingLoader([floats], 4)


def test_truncated_shard_is_named(tmp_path):
    good = write_shard(tmp_path / "good.hdf5")
    cut = tmp_path / "cut.hdf5"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(ValueError, match=f"shard {cut}: .*corrupt or truncated"):
        PretrainingLoader([good, cut], 4)


# ------------------------------------------------------------------- inference

@pytest.fixture(scope="module")
def inference():
    cfg = tiny_config("groupbert")
    return cfg, InferenceSession(build_model(cfg).builder.model_proto())


def _change(key, fn):
    def mutate(batch):
        batch[key] = fn(batch[key])
    return mutate


def _poke(key, index, value):
    def mutate(batch):
        batch[key] = batch[key].copy()
        batch[key][index] = value
    return mutate


INFERENCE_FAULTS = {
    "1-D where 2-D is declared": (_change("input_ids", lambda v: v[0]),
                                  r"input 'input_ids' has shape \(19,\) \(rank 1\), but the graph declares \(batch, 19\)"),
    "extra axis": (_change("next_sentence_labels", lambda v: v[:, None]), r"input 'next_sentence_labels' has shape \(4, 1\)"),
    "float ids": (_change("input_ids", lambda v: v.astype(np.float64)), r"input 'input_ids' holds float64 values"),
    "unknown name": (lambda b: b.update(input_idz=b["input_ids"]), r"unknown input\(s\) \['input_idz'\]"),
    "missing name": (lambda b: b.pop("segment_ids"), r"missing input\(s\) \['segment_ids'\]"),
    "batch sizes disagree": (_change("input_mask", lambda v: v[:3]),
                             r"input 'input_mask' has batch = 3 .*but input 'input_ids' has batch = 4"),
    "wrong sequence length": (_change("segment_ids", lambda v: v[:, :10]), r"input 'segment_ids' .*dimension 1 must be 19"),
    "token id past the table": (_poke("input_ids", (2, 5), 101), r"input 'input_ids' holds 101 at \[2, 5\]; .*\[0, 101\)"),
    "segment id 2": (_poke("segment_ids", (1, 1), 2), r"input 'segment_ids' holds 2 at \[1, 1\]; .*\[0, 2\)"),
    "mask value 3": (_poke("input_mask", (0, 0), 3), r"input 'input_mask' holds 3 at \[0, 0\]; values must be 0 or 1"),
    "position past the sequence": (_poke("masked_lm_positions", (3, 1), 19), r"input 'masked_lm_positions' holds 19"),
    "label past the vocab": (_poke("masked_lm_ids", (0, 2), -5), r"input 'masked_lm_ids' holds -5 .*\[0, 101\) or -100"),
    "NSP label 2": (_poke("next_sentence_labels", 1, 2), r"input 'next_sentence_labels' holds 2 at \[1\]"),
}


@pytest.mark.parametrize("case", INFERENCE_FAULTS)
def test_inference_faults_name_the_input_and_leave_the_callers_arrays(inference, case):
    cfg, session = inference
    mutate, pattern = INFERENCE_FAULTS[case]
    batch = random_batch(cfg, 4, pad_from=2)
    mutate(batch)
    before = {k: np.array(v, copy=True) for k, v in batch.items()}
    with pytest.raises(ValueError, match=pattern):
        session.run(batch)
    assert all(np.array_equal(batch[k], before[k]) for k in before)


# ----------------------------------------------------------------------- wandb

@pytest.mark.slow
def test_wandb_with_a_key_and_no_network_logs_offline_promptly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a well-formed, fake key
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.invalid")  # a name that never resolves
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from bert.run import wandb_run

    probes, probe = [], wandb_run._unreachable
    monkeypatch.setattr(wandb_run, "_unreachable", lambda url, **kw: probes.append(url) or probe(url, **kw))
    result = train(config_from_dict(tiny_run_config(tmp_path / "run")), use_wandb=True, progress=False)
    assert probes == ["https://api.wandb.invalid"], "one bounded probe of the host decides, before any online init"
    out = capsys.readouterr().out
    assert "wandb: https://api.wandb.invalid is unreachable" in out and "logging offline" in out, out
    runs = list((result.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), f"no offline wandb run in {result.output_dir}"
    assert len(result.metrics) == 2


def test_wandb_says_so_in_every_offline_case(tmp_path, monkeypatch, capsys):
    """Without credentials (no WANDB_API_KEY, nothing from `wandb login` in the netrc file) the
    run logs offline and says why in one line, as it does for an unreachable host."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    result = train(config_from_dict(tiny_run_config(tmp_path / "run")), use_wandb=True, progress=False)
    out = capsys.readouterr().out
    line = (f"wandb: no W&B credentials (set WANDB_API_KEY or run `wandb login`); logging offline into "
            f"{result.output_dir / 'wandb'} (upload later with `wandb sync`)")
    assert line in out.splitlines(), out
    assert list((result.output_dir / "wandb").glob("offline-run-*/*.wandb")), "the offline run holds the records"

    import wandb

    from bert.run import wandb_run

    modes = []
    monkeypatch.setattr(wandb, "init", lambda **kw: modes.append(kw["mode"]))
    monkeypatch.setattr(wandb_run, "_unreachable", lambda url, **kw: "is unreachable (no route)")
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    cfg = config_from_dict(tiny_run_config(tmp_path / "x"))
    for env, expected in [({"WANDB_MODE": "offline"}, "wandb: mode offline (WANDB_MODE or wandb settings); "
                                                       "logging offline into"),
                          ({"WANDB_MODE": "disabled"}, "wandb: disabled (WANDB_MODE or wandb settings)"),
                          ({}, "wandb: https://api.wandb.ai is unreachable (no route); logging offline into")]:
        monkeypatch.delenv("WANDB_MODE", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        netrc.write_text("machine api.wandb.ai login user password " + "0" * 40 + "\n")  # as `wandb login` writes
        wandb_run.start_wandb(tmp_path / "x", cfg)
        assert capsys.readouterr().out.startswith(expected)
    assert modes == ["offline", "disabled", "offline"]


# ------------------------------------------------------------------- corpus files

def _create_shards_measured(text, vocab, out) -> tuple[subprocess.CompletedProcess, int]:
    """data/create_pretraining_data.py in a process of its own (one worker, 512 KB shards):
    what it printed, and its peak resident memory in MB (VmHWM: the high-water mark of its
    own memory; ru_maxrss would count the pytest process it was forked from)."""
    code = ("import re, sys\nfrom pathlib import Path\nfrom data.create_pretraining_data import main\n"
            "rc = main(sys.argv[1:])\n"
            "kb = int(re.search(r'VmHWM:\\s*(\\d+)', Path('/proc/self/status').read_text()).group(1))\n"
            "print('peak_rss_mb', kb // 1024, file=sys.stderr)\nsys.exit(rc)")
    ran = subprocess.run([sys.executable, "-c", code, "--input", str(text), "--vocab", str(vocab), "--output-dir",
                          str(out), "--seq-len", "32", "--max-predictions", "4", "--workers", "1", "--shard-size", "512K"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran, int(ran.stderr.rsplit("peak_rss_mb ", 1)[1])


def test_a_corpus_line_of_millions_of_characters_is_split_in_bounded_memory_and_warned_about_once(tmp_path):
    """A file without line breaks was one "sentence" of millions of words: tokenised at once
    (memory past 8 GB for 50 MB) and trimmed a token at a time (no progress), and no warning.
    Now the shards are cut inside the line and the line is split into sentences: memory stays
    that of the work in flight (as for the same words with line breaks), and one warning
    names the file and the line."""
    from data.demo import generate_documents
    from tests.helpers import write_small_corpus

    if not Path("/proc/self/status").is_file():
        pytest.skip("the peak memory of a process is read from /proc (Linux)")
    _, vocab = write_small_corpus(tmp_path, [200], [4], 300)
    words = [w for doc in generate_documents(200, seed=4) for s in doc for w in s.replace(".", "").split()]
    words = words * (3_000_000 // len(" ".join(words)))  # 3 MB
    path, lines = tmp_path / "no_line_breaks.txt", tmp_path / "lines.txt"
    path.write_text("The first line is short.\nSo is the second.\n" + " ".join(words) + "\n")
    lines.write_text("".join(" ".join(words[i:i + 15]) + "\n" for i in range(0, len(words), 15)))
    ran, peak = _create_shards_measured(path, vocab.path, tmp_path / "out")
    _, baseline = _create_shards_measured(lines, vocab.path, tmp_path / "baseline")
    assert peak < 1.5 * baseline + 50, f"{peak} MB resident; {baseline} MB for the same words with line breaks"
    warned = [line for line in ran.stderr.splitlines() if "a line of more than" in line]
    assert warned == [f"WARNING: {path}, line 3: a line of more than 65,536 characters (read as sentences): no line "
                      "breaks? it is read as a paragraph, not as one sentence: split into sentences of at most 4,000 "
                      "characters at pySBD's sentence ends, else at white space, and the shards are cut inside it; "
                      "put each sentence on a line of its own"], ran.stderr[-3000:]
    assert len(list((tmp_path / "out").glob("shard_*.hdf5"))) >= 5, "cut into shards of about 512 KB"


def test_a_corpus_line_over_the_limit_is_refused_before_any_work(tmp_path, capsys):
    """50 MB on one line ran for minutes at 2 GB and rising before any warning; a line longer
    than --max-line-bytes (4 MiB by default, here 1M) is now one error line naming the file,
    the line and the flag, before a worker starts, and the output directory is not made."""
    from data.create_pretraining_data import main
    from tests.helpers import write_small_corpus

    _, vocab = write_small_corpus(tmp_path, [20], [4], 300)
    path = tmp_path / "one_line.txt"
    path.write_text("A short line.\n" + "word " * ((3 << 20) // 5) + "\nAnother line.\n")
    argv = ["--input", str(path), "--vocab", str(vocab.path), "--output-dir", str(tmp_path / "out"), "--workers", "1"]
    assert main([*argv, "--max-line-bytes", "1M"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}, line 2: a line of more than 1,048,576 bytes (--max-line-bytes), no sentence or "
                   "paragraph: put each on a line of its own, or raise --max-line-bytes to read it in pieces of 4,000 "
                   "characters"), err
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--max-line-bytes", "a lot"]) == 2
    assert "--max-line-bytes 'a lot' is not a size" in capsys.readouterr().err


# ---------------------------------------------------------------------- exports

@pytest.fixture(scope="module")
def export_source(tmp_path_factory) -> list[str]:
    """bert.py arguments that export a tiny BERT (an .onnx as training.init_from, a vocab)."""
    return tiny_bert_source(tmp_path_factory.mktemp("export_source"))


# In a private mount namespace: a tmpfs that holds one export, an export there, the disk
# filled up, then `export` over it and `export-hf` beside it.
_FULL_DISK_EXPORTS = r"""
import errno, hashlib, json, subprocess, sys
from pathlib import Path
disk, source = Path(sys.argv[1]), sys.argv[2:]
def bert(*argv):
    ran = subprocess.run([sys.executable, "bert.py", *argv, *source], capture_output=True, text=True)
    return {"rc": ran.returncode, "stderr": ran.stderr}
first = bert("export", "--output", str(disk / "model.onnx"))
before = hashlib.sha256((disk / "model.onnx").read_bytes()).hexdigest()
with open(disk / "filler", "wb", buffering=0) as f:  # the rest of the disk
    try:
        while True:
            f.write(bytes(1 << 12))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
export = bert("export", "--output", str(disk / "model.onnx"))
hf = bert("export-hf", "--output", str(disk / "hf"))
print(json.dumps({"first": first, "export": export, "hf": hf, "names": sorted(p.name for p in disk.iterdir()),
                  "same": hashlib.sha256((disk / "model.onnx").read_bytes()).hexdigest() == before}))
"""


def test_exports_on_a_full_disk_end_in_one_line_naming_the_path_and_lose_nothing(export_source, tmp_path):
    """export-hf ended in "internal error ... this is a bug" (safetensors' own error type), export
    in "error: [Errno 28] No space left on device" naming no path."""
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(disk)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("mounting a tmpfs in a private mount namespace needs root (unshare --mount)")
    ran = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs -o size=512k tmpfs "$1" && shift && exec "$@"', "sh", str(disk),
                          sys.executable, "-c", _FULL_DISK_EXPORTS, str(disk), *export_source],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout)
    assert result["first"]["rc"] == 0, result["first"]["stderr"][-3000:]
    for job, path, what in (("export", disk / "model.onnx", "file was removed, the earlier model.onnx is as it was"),
                            ("hf", disk / "hf", "directory was removed")):
        rc, err = result[job]["rc"], result[job]["stderr"].strip()
        assert rc == 2 and len(err.splitlines()) == 1, (job, err[-3000:])
        kind = "the export" if job == "export" else "the HuggingFace directory"
        assert err == (f"error: the disk is full: cannot write {kind} {path} (No space left on device); nothing "
                       f"earlier was lost (the partial {what}): free space and run again"), err
    assert result["same"], "the earlier export changed"
    assert result["names"] == ["filler", "model.onnx"], "a partial file or staging directory was left"


_SLOW_EXPORT = ("import runpy, sys, time\nimport session.export\nsave = session.export.save_model\n"
                "def slow(proto, path):\n    save(proto, path)\n    print('staged', flush=True)\n    time.sleep(60)\n"
                "session.export.save_model = slow\nsys.argv = ['bert.py', *sys.argv[1:]]\n"
                "runpy.run_path('bert.py', run_name='__main__')")


def _stop_a_staged_export(out: Path, export_source: list[str], signum: int) -> tuple[int, str]:
    """`bert.py export` to `out`, sent `signum` once its model is staged: its status and stderr."""
    process = subprocess.Popen([sys.executable, "-c", _SLOW_EXPORT, "export", "--output", str(out), *export_source],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.strip() == "staged":
                break
        assert process.poll() is None, process.stderr.read()
        assert [p.name.startswith(".model.onnx.") for p in out.parent.iterdir()] == [True], "the export is staged"
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def test_sigterm_during_an_export_removes_its_staging_and_says_so(export_source, tmp_path):
    """SIGTERM ended `bert.py export` with no line, its `.model.onnx.*` staging directory left
    for good; one that a SIGKILL leaves is removed by the next export."""
    out = tmp_path / "model.onnx"
    status, err = _stop_a_staged_export(out, export_source, signal.SIGTERM)
    assert status == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"error: export stopped by SIGTERM: nothing was written to {out} (the "
                                            "partial files were removed; what was there before is as it was)"), err
    assert list(tmp_path.iterdir()) == [], "the staging directory was left"
    # A SIGKILL leaves the staging (no clean-up can run): the next export removes it.
    _stop_a_staged_export(out, export_source, signal.SIGKILL)
    (stale,) = tmp_path.iterdir()
    assert stale.name.startswith(".model.onnx.") and stale.is_dir()
    assert subprocess.run([sys.executable, "bert.py", "export", "--output", str(out), *export_source], cwd=ROOT,
                          capture_output=True, text=True).returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"], "the killed export's staging is still there"


def test_a_checkpoint_under_another_task_or_architecture_names_its_own(tmp_path, capsys):
    """A run's checkpoint exported under a config of another task asked for model.num_labels,
    and under a GroupBERT config said the weights hold "another architecture"; both now name
    what the checkpoint's run was (its config.json) and the flag that fixes it."""
    from bert.config import ModelConfig
    from tests.tiny_runs import bert_cli

    model = ModelConfig(architecture="bert", hidden_size=48, num_layers=1, num_heads=3, vocab_size=101,
                        sequence_length=24, max_predictions=5, max_positions=40)
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "checkpoint-3" / "model.onnx").write_bytes(
        build_model(model, with_loss=False).builder.model_proto().SerializeToString())
    (run / "config.json").write_text(json.dumps({"version": 2, "name": "run", "model": model.model_dump(mode="json")}))
    sizes = ["--model.num_layers", "1", "--model.hidden_size", "48", "--model.num_heads", "3", "--model.vocab_size",
             "101", "--checkpoint-input", str(run / "checkpoint-3"), "--output", str(tmp_path / "m.onnx")]
    for config, says in (
        ("classify_demo.json", f"{run / 'checkpoint-3'} was trained for model.task 'pretraining' (its run's "
                               "config.json) and the config given to bert.py export says 'classification': pass "
                               "--model.task pretraining"),
        ("groupbert_tiny.json", f"the checkpoints of {run} are of a bert (its config.json's model.architecture) and "
                                "this run's model.architecture is 'groupbert': set --model.architecture bert"),
    ):
        assert bert_cli()(["export", "--config", str(ROOT / "configs" / config), *sizes]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
        assert not (tmp_path / "m.onnx").exists()


def test_a_resume_from_a_checkpoint_of_other_sizes_names_the_checkpoint_and_the_fix(tmp_path, capsys):
    """training.init_from (sizes 64) with --checkpoint-input of a run of sizes 48 ended in "weight
    ...: graph wants (2048, 64), got (2048, 48)", naming no file; now the checkpoint and where
    the run's sizes came from are named, with both fixes, and nothing is written."""
    from tests.tiny_runs import bert_cli

    def run(out, hidden, heads, *extra):
        return bert_cli()(["train", "--config", str(ROOT / "configs/demo.json"), "--data.source", "synthetic",
                           "--training.steps", "2", "--schedule.warmup_steps", "0", "--model.num_layers", "1",
                           "--model.hidden_size", str(hidden), "--model.num_heads", str(heads),
                           "--model.sequence_length", "32", "--training.output_dir", str(out), *extra])

    assert run(tmp_path / "a", 48, 3) == 0 and run(tmp_path / "b", 64, 4) == 0
    capsys.readouterr()
    checkpoint = tmp_path / "a" / "checkpoint-final"
    before = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert run(tmp_path / "c", 64, 4, "--training.init_from", str(tmp_path / "b" / "checkpoint-final"),
               "--checkpoint-input", str(checkpoint), "--training.steps", "4") == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: {checkpoint} does not fit the model of the config and training.init_from (weight "
                           "'bert.embeddings.word_embeddings.weight': graph wants (2048, 64), got (2048, 48)): a resume "
                           "continues that checkpoint's own run; resume with its run's config.json as --config, or "
                           "start a new run from it with --training.init_from instead of --checkpoint-input"), err
    assert not (tmp_path / "c").exists() and sorted(p.name for p in (tmp_path / "a").iterdir()) == before
