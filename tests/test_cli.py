"""bert.py's command line: subcommands with their own --help, overrides anywhere, and the
flags of earlier releases read as aliases of their subcommands, each said once."""
import json
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_runs import ROOT, bert_cli, bert_script, one_thread  # noqa: F401 (an autouse fixture)

COMMANDS = {  # each subcommand and an option only its --help lists
    "train": "--wandb", "eval": "--checkpoint-input", "export": "--outputs", "export-hf": "--output DIR",
    "summary": "--config", "sweep": "--max-loss", "compare": "--output-dir",
}


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    import bert.config

    monkeypatch.setattr(bert.config, "_noted", set())  # a note is said once per process


def _main(argv, capsys) -> tuple[int, str, str]:
    code = bert_script().main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_subcommand_has_its_own_help(capsys):
    script = bert_script()
    assert set(COMMANDS) == set(script.COMMANDS)
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    top = capsys.readouterr().out
    assert all(f"\n    {name}" in top for name in COMMANDS), top
    for name, option in COMMANDS.items():
        with pytest.raises(SystemExit) as done:
            script.main([name, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: bert.py {name} ") and option in text, text
        assert "--section.key value" in text, "each says that overrides go anywhere"


@pytest.mark.parametrize("argv, message", [
    (["train"], "the following arguments are required: --config (see python bert.py train --help)"),
    (["summary", "--config", "configs/demo.json", "--storage", "x"],
     "unrecognised argument '--storage': python bert.py summary --help lists its options"),
    (["export", "--config", "configs/demo.json"], "the following arguments are required: --output"),
    (["sweep"], "the following arguments are required: YAML"),
    (["trian", "--config", "configs/demo.json"], "unrecognised argument 'trian'"),
    ([], "name a subcommand (train, eval, export, export-hf, summary, sweep, compare)"),
])
def test_a_command_line_mistake_is_one_line_naming_the_subcommand(monkeypatch, capsys, argv, message):
    monkeypatch.chdir(ROOT)
    code, out, err = _main(argv, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flags, command", [
    (["--summary"], ["summary", "--config", "c.json"]),
    (["--eval-only", "--checkpoint-input", "c"], ["eval", "--config", "c.json", "--checkpoint-input", "c"]),
    (["--export", "m.onnx", "--export-outputs", "encoder"],
     ["export", "--output", "m.onnx", "--config", "c.json", "--outputs", "encoder"]),
    (["--export=m.onnx"], ["export", "--output", "m.onnx", "--config", "c.json"]),
    (["--export-hf", "hf"], ["export-hf", "--output", "hf", "--config", "c.json"]),
    (["--wandb"], ["train", "--config", "c.json", "--wandb"]),
])
def test_the_flags_of_earlier_releases_stand_for_their_subcommands(capsys, flags, command):
    script = bert_script()
    assert script.from_flags(["--config", "c.json", *flags]) == command
    out = capsys.readouterr().out
    if command[0] == "train":
        assert out == "", "--config alone trains, as users call it: nothing to say"
    else:
        assert out.count("\n") == 1 and f"stands for the subcommand {command[0]!r}" in out, out
    assert script.from_flags(["--sweep", "s.yaml", "--trials", "2"]) == ["sweep", "s.yaml", "--trials", "2"]
    assert script.from_flags(["--compare", "c.yaml"]) == ["compare", "c.yaml"]


def test_an_alias_runs_its_subcommand_and_says_so_once(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, new, _ = _main(["summary", "--config", "configs/demo.json", "--model.num_layers", "3"], capsys)
    assert code == 0
    said = []
    for _ in range(3):
        code, old, _ = _main(["--config", "configs/demo.json", "--summary", "--model.num_layers=3"], capsys)
        assert code == 0 and old.endswith(new), "the same summary"
        said += [line for line in old.splitlines() if line.startswith("note:")]
    assert said == ["note: --summary stands for the subcommand 'summary': python bert.py summary --config "
                    "configs/demo.json (the flag is read for this release)"]


def test_two_jobs_in_the_old_flags_are_refused(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, _, err = _main(["--config", "configs/demo.json", "--summary", "--compare", "x.yaml"], capsys)
    assert code == 2 and "--summary and --compare are separate jobs" in err and err.count("\n") == 1


def test_overrides_go_anywhere_and_old_keys_are_mapped(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, _ = _main(["summary", "--model.num_layers", "3", "--config", "configs/demo.json",
                          "--training.learning_rate=0.5"], capsys)
    assert code == 0 and "groupbert: hidden 128, 3 layers" in out
    assert out.splitlines()[0] == ("note: training.learning_rate is now optimizer.learning_rate: command line (over "
                                   "configs/demo.json) gives its version-1 name, read for this release")


def test_a_long_error_keeps_what_went_wrong_and_what_to_do():
    """The one line is capped at 500 characters by cutting its middle: a long path or setting
    must not cut off the advice at its end."""
    message = "sweep in /a/very/long/path was started with other settings: " + "x" * 800 + "; give it another name"
    line = bert_script()._one_line(ValueError(message))
    assert len(line) == 500 and line.startswith("sweep in /a/very/long/path was started") and \
        line.endswith("; give it another name") and " ... " in line
    assert bert_script()._one_line(ValueError("short\n  and plain")) == "short and plain"


# ------------------------------------------------------------------ issue 51, item 3
@pytest.mark.parametrize("argv, says", [
    (["--model.learning_rate", "0.1"], "unknown key 'model.learning_rate' (value 0.1): learning_rate belongs to "
                                       "optimizer, not model: use --optimizer.learning_rate"),
    (["--data.epochs=2"], "unknown key 'data.epochs' (value 2): epochs belongs to training, not data: use "
                          "--training.epochs"),
    (["--training.every", "5"], "every belongs to checkpoint or evaluation, not training: use --checkpoint.every or "
                                "--evaluation.every"),
    (["--model.hiden_size", "64"], "unknown key 'model.hiden_size' (value 64): did you mean --model.hidden_size?"),
    (["--model.learnin_rate", "0.1"], "unknown key 'model.learnin_rate' (value 0.1): did you mean "
                                      "--optimizer.learning_rate?"),
    (["--modle.num_layers", "3"], "'modle' is not a config section (sections: model, data, training, optimizer, "
                                  "schedule, batch, precision, checkpoint, evaluation, parallel, budget): did you mean "
                                  "--model.num_layers?"),
    (["--learning_rate", "0.1"], "unrecognised argument '--learning_rate': learning_rate is a config key of "
                                 "optimizer: use --optimizer.learning_rate"),
], ids=["model.learning_rate", "data.epochs", "two sections", "misspelt", "misspelt, other section",
        "misspelt section", "no section"])
def test_a_key_in_the_wrong_section_names_where_it_belongs(monkeypatch, capsys, argv, says):
    monkeypatch.chdir(ROOT)
    code, _, err = _main(["summary", "--config", "configs/demo.json", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err
    assert "check the spelling" not in err, "the fix is known: the line names it"


def test_options_may_come_before_the_subcommand(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, after, _ = _main(["summary", "--config", "configs/demo.json", "--model.num_layers", "3"], capsys)
    assert code == 0
    code, before, err = _main(["--config", "configs/demo.json", "--model.num_layers", "3", "summary"], capsys)
    assert code == 0 and before == after and err == "", "the same summary, nothing said"
    script = bert_script()
    args, _ = script.parse_command(["--debug", "--config", "c.json", "--checkpoint-input", "run", "train", "--wandb"])
    assert (args.command, args.config, args.checkpoint_input, args.wandb) == ("train", "c.json", "run", True)
    args, _ = script.parse_command(["--config", "c.json", "--export", "summary"])  # an earlier release's flag
    assert (args.command, args.output) == ("export", "summary"), "a flag's value is not taken for the subcommand"


def test_training_steps_given_on_the_command_line_replace_the_configs_epochs(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    script = bert_script()
    train = ["train", "--config", "configs/classify_demo.json"]  # training.epochs 3
    config = script.command_config(*script.parse_command([*train, "--training.steps", "40"]))
    assert (config.training.steps, config.training.epochs) == (40, None)
    assert capsys.readouterr().out == ("note: training.steps 40 from command line (over configs/classify_demo.json) "
                                       "replaces the config's training.epochs 3: the run takes 40 steps\n")
    config = script.command_config(*script.parse_command([*train, "--training.epochs", "2"]))
    assert config.training.epochs == 2 and capsys.readouterr().out == "", "epochs given alone still decide"
    code, _, err = _main([*train, "--training.steps", "40", "--training.epochs", "2"], capsys)
    assert code == 2 and err.count("\n") == 1 and \
        "training.steps 40 and training.epochs 2 both set the run's length: give one" in err, err


def test_a_run_takes_the_steps_given_over_its_configs_epochs(tmp_path, capsys):
    """Through training: the steps given are the steps run, where the epochs made 282 before; a
    warm-up longer than the steps the epochs make is refused before the run starts."""
    from tests.test_classify import labelled_rows, tiny_groupbert, write_tsv

    rows = labelled_rows(np.random.default_rng(0), 24)
    argv = tiny_groupbert(tmp_path, "classification", write_tsv(tmp_path / "train.tsv", rows),
                          text_columns=["sentence"], label_column="label")
    config = json.loads(Path(argv[2]).read_text())
    config["training"] = {**config["training"], "epochs": 4}  # 24 rows, batch 4: 24 steps
    del config["training"]["steps"]
    Path(argv[2]).write_text(json.dumps(config))
    assert bert_cli()([*argv, "--training.steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "replaces the config's training.epochs 4: the run takes 2 steps" in out and "epoch(s) of" not in out, out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "step" in r) == 2
    assert bert_cli()([*argv, "--schedule.warmup_steps", "30", "--training.output_dir", str(tmp_path / "late")]) == 2
    assert ("error: schedule.warmup_steps 30 exceeds the 24 steps of training.epochs 4 (24 rows in global batches of "
            "4): lower the warm-up or train longer") in capsys.readouterr().err
    assert not (tmp_path / "late").exists()
