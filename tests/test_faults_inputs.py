"""Bad inputs a user can give: config files and overrides, the command line, shards, and
InferenceSession feeds. Each case asserts that the error names the culprit (key and
file, shard + dataset + row, input name) and, where a run directory exists, that
nothing already written changed. Each fails if its check is removed: the fault would
pass silently or end in an error that names nothing.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import data.shards
from bert import build_model, config_from_dict, load_config, with_overrides
from bert.train import train
from custom_ops.grouped_conv1d import MAX_CHANNELS_PER_GROUP
from data import PretrainingLoader
from data.pretraining import SAMPLE_KEYS
from session import InferenceSession
from tests.helpers import merge_settings, random_batch, sections, tiny_config

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
    "a newer version": (_with("training").replace('{', '{"version": 3, ', 1),
                        r"version 3 is newer than this bert\.py reads \(version 2\)"),
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


def test_an_int_is_a_fine_float_and_the_presets_load_as_version_2(tmp_path, capsys):
    cfg = load_config(_write(tmp_path, _with("optimizer", learning_rate=1)))
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)
    for preset in sorted((ROOT / "configs").rglob("*.json")):
        assert json.loads(preset.read_text())["version"] == 2, preset
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

    monkeypatch.setattr("bert.train.train", broken)
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
    from bert import wandb_run

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

    from bert import wandb_run

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
