"""The optimizer section, one per rule (issue 52, step 3): tagged by `optimizer.name`, each rule's
keys its own (session/hyperparameters.py declares them), a key of another rule refused in one
line; version 2's keys, from config files, saved config.json and overrides, mapped once with a
note, so an existing config trains as it did."""
from __future__ import annotations

import json

import pytest

import bert.config
from bert.config import RULE_SECTIONS, config_from_dict, upgrade, with_overrides
from session.hyperparameters import HYPERPARAMETERS
from session.optimizers import OPTIMIZERS

MODEL = {"architecture": "groupbert", "hidden_size": 48, "num_layers": 1, "num_heads": 3, "vocab_size": 101,
         "sequence_length": 16, "max_predictions": 3, "max_positions": 32}

# What version 2 wrote into a run's config.json for each rule: every key, used or not.
V2_DUMPS = {
    "lamb": {"name": "lamb", "learning_rate": 0.01, "weight_decay": 0.01, "beta1": 0.85, "beta2": 0.98,
             "epsilon": 1e-07, "max_grad_norm": 1.0, "max_trust_ratio": 2.0},
    "adamw": {"name": "adamw", "learning_rate": 0.003, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99,
              "epsilon": 1e-08, "max_grad_norm": None, "max_trust_ratio": None},
    "lion": {"name": "lion", "learning_rate": 0.001, "weight_decay": 0.1, "beta1": 0.95, "beta2": 0.98,
             "epsilon": 1e-06, "max_grad_norm": None, "max_trust_ratio": None},
}
# The same settings by the rules' own names (version 3).
V3 = {
    "lamb": {"name": "lamb", "learning_rate": 0.01, "weight_decay": 0.01, "max_grad_norm": 1.0, "betas": [0.85, 0.98],
             "eps": 1e-07, "max_trust_ratio": 2.0},
    "adamw": {"name": "adamw", "learning_rate": 0.003, "weight_decay": 0.05, "max_grad_norm": None,
              "betas": [0.8, 0.99], "eps": 1e-08},
    "lion": {"name": "lion", "learning_rate": 0.001, "weight_decay": 0.1, "max_grad_norm": None, "beta1": 0.95,
             "beta2": 0.98},
}


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(bert.config, "_noted", set())  # a note is said once per process


def config(optimizer: dict, version: int = 3, source: str = "f.json"):
    return config_from_dict({"version": version, "model": MODEL, "optimizer": optimizer}, source)


def test_each_rule_is_a_section_of_the_common_keys_and_its_declared_ones():
    assert list(RULE_SECTIONS) == list(HYPERPARAMETERS) == list(OPTIMIZERS)
    for rule, section in RULE_SECTIONS.items():
        declared = HYPERPARAMETERS[rule].model_fields
        assert list(section.model_fields) == ["name", "learning_rate", "weight_decay", "max_grad_norm", *declared]
        for key, field in declared.items():  # made from the declaration: the same default, limits, description
            ours = section.model_fields[key]
            assert (ours.default, ours.metadata, ours.description) == (field.default, field.metadata,
                                                                       field.description), (rule, key)
        assert OPTIMIZERS[rule].hyperparameters is HYPERPARAMETERS[rule]
    assert config({}).optimizer.name == "lamb", "LAMB when the section names no rule"


@pytest.mark.parametrize("rule", V3)
def test_the_session_takes_each_rules_own_hyperparameters_by_name(rule):
    from bert.tasks.pretraining import make_session

    cfg = config(V3[rule])
    with make_session(cfg) as session:
        group = session.optimizer.param_groups[0]
        assert session.optimizer.kind == rule
        own = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.optimizer.hyperparameters.items()}
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k in own} == own
        assert set(group) - {"params"} == {"lr", "weight_decay", "max_grad_norm", *own}, "nothing of another rule's"
        assert (group["weight_decay"], group["max_grad_norm"]) == (V3[rule]["weight_decay"], V3[rule]["max_grad_norm"])


@pytest.mark.parametrize("optimizer, says", [
    ({"name": "lion", "eps": 1e-8}, "unknown key 'optimizer.eps' (value 1e-08) for optimizer.name 'lion': lion takes "
                                    "name, learning_rate, weight_decay, max_grad_norm, beta1, beta2 (eps is lamb's and "
                                    "adamw's)"),
    ({"name": "adamw", "max_trust_ratio": 2.0},
     "unknown key 'optimizer.max_trust_ratio' (value 2.0) for optimizer.name 'adamw': adamw takes name, learning_rate, "
     "weight_decay, max_grad_norm, betas, eps (max_trust_ratio is lamb's)"),
    ({"name": "lamb", "epsilon": 1e-8}, "unknown key 'optimizer.epsilon' (value 1e-08) for optimizer.name 'lamb': "
                                        "lamb takes name, learning_rate, weight_decay, max_grad_norm, betas, eps, "
                                        "max_trust_ratio (version 2's name of optimizer.eps)"),
    ({"name": "lion", "epsilon": 1e-8}, "(a version-2 key that lion never used)"),
    ({"name": "lamb", "betaz": [0.9, 0.9]}, "(did you mean optimizer.betas?)"),
    ({"name": "lamb", "momentum": 0.9}, "lamb takes name, learning_rate, weight_decay, max_grad_norm, betas, eps, "
                                        "max_trust_ratio"),
    ({"name": "sgdd"}, "optimizer.name = 'sgdd': no such rule; use one of 'lamb', 'adamw', 'lion'"),
    ({"name": 5}, "optimizer.name = 5: no such rule"),
    ({"name": "lamb", "betas": [0.9, 1.0]}, "optimizer.betas.1 = 1.0: Input should be less than 1"),
    ({"name": "lion", "beta2": "0.9"}, "optimizer.beta2 = '0.9': Input should be a valid number"),
], ids=["another rule's", "LAMB's on AdamW", "version 2's name", "version 2's, never used", "misspelt", "no rule's",
        "no such rule", "not a name", "out of range", "strict"])
def test_a_key_the_rule_does_not_take_is_refused_in_one_line(tmp_path, optimizer, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 3, "model": MODEL, "optimizer": optimizer}))
    with pytest.raises(ValueError) as error:
        bert.config.load_config(path)
    message = str(error.value)
    assert message.startswith(f"invalid config {path}: ") and says in message and "\n" not in message, message


@pytest.mark.parametrize("rule", V2_DUMPS)
def test_a_version_2_config_reads_as_its_rules_own_keys(rule, capsys):
    """A saved config.json of version 2 (every key written out): the same settings under the rule's
    names, so a run resumes in place (bert/run/rundir.py compares them) and a sweep's stored config is
    the same sweep (bert/sweep/worker.py compares the upgraded dict itself)."""
    cfg = config(V2_DUMPS[rule], version=2, source="run/config.json")
    assert cfg.optimizer.model_dump(mode="json") == V3[rule]
    assert cfg == config(V3[rule])
    said = capsys.readouterr().out
    expected = {
        "lamb": "note: run/config.json is a version-2 config, read as version 3: optimizer.beta1 → optimizer.betas[0]; "
                "optimizer.beta2 → optimizer.betas[1]; optimizer.epsilon → optimizer.eps\n",
        "adamw": "note: run/config.json is a version-2 config, read as version 3: optimizer.beta1 → "
                 "optimizer.betas[0]; optimizer.beta2 → optimizer.betas[1]; optimizer.epsilon → optimizer.eps\n",
        "lion": "",  # its names stay, and the keys it never used held version 2's defaults: nothing to say
    }
    assert said == expected[rule]
    stored = upgrade({"version": 2, "model": MODEL, "optimizer": V2_DUMPS[rule]}, "a sweep's stored config")
    assert stored["optimizer"] == V3[rule] and stored["version"] == 3


def test_version_2_values_that_change_what_runs_are_said(capsys):
    """Lion's own beta2 default (0.99, its paper's) is not version 2's (0.999): a version-2 Lion
    config that gave none keeps 0.999; a key Lion never used, given a value of its own, goes."""
    cfg = config({"name": "lion", "learning_rate": 1e-3, "epsilon": 1e-8}, version=2, source="old.json")
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2) == (0.9, 0.999)
    assert config({"name": "lion"}).optimizer.beta2 == 0.99
    assert capsys.readouterr().out == ("note: old.json is a version-2 config, read as version 3: optimizer.epsilon "
                                       "1e-08 dropped: lion never used it; optimizer.beta2 0.999 kept, version 2's "
                                       "default (lion's own is 0.99)\n")
    with pytest.raises(ValueError, match=r"optimizer\.epsilon and optimizer\.eps are the same setting"):
        config({"name": "lamb", "epsilon": 1e-8, "eps": 1e-8}, version=2)


def test_a_version_1_config_says_each_key_once_by_its_final_name(capsys):
    cfg = config_from_dict({"model": MODEL, "training": {"optimizer": "adamw", "learning_rate": 0.01, "beta2": 0.95,
                                                          "epsilon": 1e-7, "steps": 3}}, "v1.json")
    assert (cfg.optimizer.name, cfg.optimizer.betas, cfg.optimizer.eps) == ("adamw", (0.9, 0.95), 1e-7)
    assert capsys.readouterr().out == ("note: v1.json is a version-1 config, read as version 3: training.learning_rate "
                                       "→ optimizer.learning_rate; training.optimizer → optimizer.name; "
                                       "training.beta2 → optimizer.betas[1]; training.epsilon → optimizer.eps\n")


def test_version_2_keys_given_as_overrides_are_the_rules_own(capsys):
    base = config({"name": "lamb", "betas": [0.85, 0.98]})
    for _ in range(2):  # said once per process
        cfg = with_overrides(base, {"optimizer.beta2": 0.95, "training.epsilon": 1e-7}, "command line")
        assert (cfg.optimizer.betas, cfg.optimizer.eps) == ((0.85, 0.95), 1e-7)
    assert capsys.readouterr().out.splitlines() == [
        "note: training.epsilon is now optimizer.epsilon: command line gives its version-1 name, read for this release",
        "note: optimizer.beta2 is lamb's optimizer.betas[1]: command line gives its version-2 name, read for this "
        "release",
        "note: optimizer.epsilon is lamb's optimizer.eps: command line gives its version-2 name, read for this release"]
    lion = config({"name": "lion"})
    assert with_overrides(lion, {"optimizer.beta2": 0.95}, "command line").optimizer.beta2 == 0.95
    assert capsys.readouterr().out == "", "Lion's beta2 is its own name"
    with pytest.raises(ValueError, match=r"unknown key 'optimizer\.epsilon' \(value 1e-07\) for optimizer\.name "
                                         r"'lion': lion takes .*\(a version-2 key that lion never used\)"):
        with_overrides(lion, {"optimizer.epsilon": 1e-7}, "command line")


def test_another_rule_by_override_keeps_what_it_shares_and_says_what_it_drops(capsys):
    base = config({"name": "lamb", "learning_rate": 0.01, "betas": [0.85, 0.98], "eps": 1e-7})
    adamw = with_overrides(base, {"optimizer.name": "adamw"}, "command line")
    assert (adamw.optimizer.betas, adamw.optimizer.eps, adamw.optimizer.learning_rate) == ((0.85, 0.98), 1e-7, 0.01)
    assert capsys.readouterr().out == "", "LAMB's max_trust_ratio held its default: nothing is lost"
    lion = with_overrides(base, {"optimizer.name": "lion", "optimizer.beta1": 0.95}, "command line")
    assert (lion.optimizer.beta1, lion.optimizer.beta2, lion.optimizer.learning_rate) == (0.95, 0.99, 0.01)
    assert capsys.readouterr().out == ("note: optimizer.name 'lion' from command line replaces 'lamb': optimizer.betas "
                                       "[0.85, 0.98], optimizer.eps 1e-07 (lamb's own) dropped\n")
    with pytest.raises(ValueError, match=r"unknown key 'optimizer\.eps' \(value 1e-08\) for optimizer\.name 'lion'"):
        with_overrides(base, {"optimizer.name": "lion", "optimizer.eps": 1e-8}, "command line")
