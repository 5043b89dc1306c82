"""bert.py's command line: subcommands with their own --help, overrides anywhere, and the
flags of earlier releases read as aliases of their subcommands, each said once."""
import pytest

from tests.tiny_runs import ROOT, bert_script

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
