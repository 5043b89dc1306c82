"""Every shell command of README.md and docs/*.md runs as written, so the docs cannot drift
from the code.

tests/doc_commands.py runs each document's fenced shell blocks in order, in a sandbox copy
of the repository, with the one documented cap (tests/doc_cap.py: a bert.py command trains
at most DOC_STEPS steps past where it starts and evaluates 64 samples). A command that cannot
run here carries a `doc-test: skip` (or `skip-command`) comment with its reason in the
markdown source; the fast tests below check that every directive parses, that no command
hides in an indented block (which nothing would run), and that skipped commands still name
files that exist. Each document's run is one slow test; the pages with checks of their
own (what the commands wrote) add them after it.
"""
from __future__ import annotations

import re
import subprocess
import tomllib

import pytest

from tests.doc_cap import cap
from tests.doc_commands import DOCUMENTS, ROOT, commands, run_markdown, shell_blocks
from tests.tiny_runs import bert_script
from tests.test_compare import check_docs_quality_md
from tests.test_docs_data import check_docs_data_md
from tests.test_squad_demo import check_squad_demo

FIXTURES = ROOT / "tests" / "fixtures"

# Generated pages: bench/gpu_check.py writes docs/gpu.md (tests/test_gpu_check.py checks it
# against the generator and runs its `make gpu-check DRY_RUN=1`); its commands are the
# device tool's and a lent GPU's.
GENERATED = {"gpu.md"}
_COMMAND = re.compile(r"(python3?|make|torchrun|pip|wget|bash|TORCH\w*=\S+ torchrun|for \w+ in|unshare)\b")
_FILE = re.compile(r"\b(?:bench|configs|data|docs|tests|custom_ops)/[\w./-]+\.(?:py|json|yaml|md)\b")


def _name(path) -> str:
    return path.relative_to(ROOT).as_posix()


def _tracked() -> set[str]:
    return set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split())


def _check_readme(ran) -> None:
    quick, running = ran[0].output, ran[2].output
    assert "doc-test cap: training.steps 300 → 4," in quick, quick[-3000:]
    assert "Brenmoor has a population of about 39000" in ran[1].output, ran[1].output[-3000:]
    # The resumes train 4 steps past their checkpoint (step 4): the cap counts from the start.
    assert running.count("doc-test cap: training.steps 300 → 8,") == 1, running[-3000:]
    assert "doc-test cap: training.steps 400 → 8," in running, running[-3000:]


def _check_distributed(ran) -> None:
    two = next(r.output for r in ran if "torchrun --nproc-per-node 2" in r.block.text)
    assert two.count("doc-test cap: training.steps 20 → 4,") == 1, "torchrun is capped once, before it starts"


def _check_running(ran) -> None:
    (auto,) = ran
    said = "batch.micro_batch_size auto: 16 (gradient accumulation 4 × 1 replica(s) = global batch 64)"
    assert said in auto.output and "global batch 64 = micro batch 16 × gradient accumulation 4" in auto.output, (
        auto.output[-3000:])


CHECKS = {"README.md": _check_readme, "docs/distributed.md": _check_distributed, "docs/finetuning.md": check_squad_demo,
          "docs/data.md": check_docs_data_md, "docs/quality.md": check_docs_quality_md,
          "docs/running.md": _check_running}


def test_the_doc_cap_appends_the_overrides_that_cap_a_run_and_counts_from_its_checkpoint():
    script, bert = ROOT / "bert.py", bert_script()
    demo = ["train", "--config", str(ROOT / "configs/demo.json")]
    extra, line = cap(script, demo)
    assert line == "doc-test cap: training.steps 300 → 4, schedule.warmup_steps 30 → 4, data.eval_samples 1024 → 64"
    capped = bert.command_config(*bert.parse_command([*demo, "--training.steps", "500", *extra]))
    assert (capped.training.steps, capped.schedule.warmup_steps, capped.data.eval_samples) == (4, 4, 64), \
        "the cap comes last, over the command's own override"
    short = [*demo, "--training.steps", "2", "--schedule.warmup_steps", "1"]
    assert cap(script, short) == (["--training.steps", "2", "--schedule.warmup_steps", "1", "--training.epochs", "null",
                                   "--data.eval_samples", "64"], "doc-test cap: data.eval_samples 1024 → 64")

    squad = ["train", "--config", str(ROOT / "configs/squad_tiny.json"), "--training.epochs", "2"]
    capped = bert.command_config(*bert.parse_command([*squad, *cap(script, squad)[0]]))
    assert (capped.training.steps, capped.training.epochs) == (4, None), "the capped steps decide"

    run = FIXTURES / "checkpoint_format3"  # a checkpoint at step 20 of a 40-step run
    for given in (str(run / "checkpoint-20"), "auto"):
        resumed = ["train", "--config", str(run / "config.json"), "--checkpoint-input", given,
                   "--training.output_dir", str(run)]
        assert cap(script, resumed)[1] == ("doc-test cap: training.steps 40 → 24, data.eval_samples 1024 → 64"), given
    evaluated = ["eval", "--config", str(run / "config.json"), "--checkpoint-input", str(run / "checkpoint-20")]
    assert cap(script, evaluated)[1].startswith("doc-test cap: training.steps 40 → 4,"), "an evaluation starts nothing"

    for uncapped in (["summary", "--config", str(ROOT / "configs/demo.json")], ["train", "--help"],
                     ["train", "--config", "missing.json"], ["export", "--config", str(ROOT / "configs/demo.json")]):
        assert cap(script, uncapped) == ([], ""), f"{uncapped}: runs as written (bert.py answers for itself)"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=_name)
def test_every_directive_parses_and_every_skip_says_why(doc):
    for block in shell_blocks(doc):  # raises on a malformed, misplaced or stale directive
        assert block.skip is None or block.skip.strip(), f"{_name(doc)}, line {block.line}"


def _indented_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each indented code block outside fences."""
    found: list[tuple[int, list[str]]] = []
    fenced, previous_blank, inside = False, True, False
    for i, line in enumerate(text.split("\n"), 1):
        if re.match(r"\s*(```|~~~)", line):
            fenced, inside = not fenced, False
        elif not fenced and line.startswith("    ") and line.strip() and (previous_blank or inside):
            if not inside:
                found.append((i, []))
            found[-1][1].append(line.strip())
            inside = True
        elif line.strip():
            inside = False
        previous_blank = not line.strip()
    return found


@pytest.mark.parametrize("doc", [d for d in DOCUMENTS if d.name not in GENERATED], ids=_name)
def test_no_command_hides_in_an_indented_block(doc):
    hidden = [f"line {i}: {lines[0]}" for i, lines in _indented_blocks(doc.read_text())
              if any(_COMMAND.match(line) for line in lines)]
    assert not hidden, (f"{_name(doc)}: indented code blocks are not run; put these commands in a fenced "
                        f"```sh block (with a doc-test directive if they cannot run here): {hidden}")


def test_skipped_commands_name_files_that_exist():
    tracked, missing = _tracked(), []
    for doc in DOCUMENTS:
        for block in shell_blocks(doc):
            skipped = ([block.text] if block.skip is not None else
                       [c for c in commands(block.text) if any(t in c for t, _ in block.skip_commands)])
            for command in skipped:
                missing += [f"{_name(doc)}, line {block.line}: {f}" for f in _FILE.findall(command)
                            if f not in tracked]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCUMENTS if any(b.skip is None for b in shell_blocks(d))], ids=_name)
def test_every_command_runs_as_written(doc, tmp_path):
    ran = run_markdown(doc, tmp_path, timeout=600)
    print("".join(f"\n{_name(doc)}, line {r.block.line}: {r.seconds:.0f} s" for r in ran))
    assert [r.block.line for r in ran] == [b.line for b in shell_blocks(doc) if b.skip is None], "every block ran"
    check = CHECKS.get(_name(doc))
    if check is not None:
        check(ran)


def test_the_config_reference_is_what_the_config_models_describe():
    """docs/config.md is generated (python -m bert.config.reference docs/config.md): every key of
    every section (of every optimizer rule, under its own heading), with its default, and every
    version-1 and version-2 key with the key it became."""
    from bert.config import OLD_KEYS, V2_OPTIMIZER_KEYS, Config, tagged_members
    from bert.config.reference import reference

    text = reference()
    assert (ROOT / "docs/config.md").read_text(encoding="utf-8") == text, \
        "docs/config.md is stale: run python -m bert.config.reference docs/config.md"
    for name, field in Config.model_fields.items():
        members = tagged_members(field.annotation) or {None: field.annotation}
        for tag, section in members.items():
            assert tag is None or f"### `{name}.name`: `{tag}`" in text
            keys = getattr(section, "model_fields", {name: field})
            for key, sub in keys.items():
                assert sub.description, f"{name}.{key} has no description"
                assert f"| `{key}` |" in text
    assert all(f"| `{old}` | `{new}` |" in text for old, new in OLD_KEYS.items())
    assert all(f"`optimizer.{new}`" in text for moves in V2_OPTIMIZER_KEYS.values() for new in moves.values())


@pytest.mark.slow
def test_the_python_inference_snippet_runs_from_another_directory(tmp_path):
    """docs/inference.md's Python snippet, as written, from a directory other than the
    checkout (a reader's script lives anywhere): in a miniature checkout (the packages
    pyproject.toml installs, a tiny export as model.onnx, tiny shards as demo_data/eval), so
    it runs in seconds; test_every_command_runs_as_written runs it after make train."""
    from bert import ModelConfig, build_model
    from bert.io.export import export_serving
    from data.create_pretraining_data import create_pretraining_data
    from data.pretraining import CreateOptions
    from tests.doc_commands import _environment
    from tests.helpers import write_small_corpus

    (block,) = [b for b in shell_blocks(ROOT / "docs/inference.md") if "InferenceSession" in b.text]
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in found["include"]:  # what `pip install -e .` makes importable: "bert*", ...
        (checkout / package.rstrip("*")).symlink_to(ROOT / package.rstrip("*"), target_is_directory=True)
    files, vocab = write_small_corpus(tmp_path / "corpus", [30], [1], 300)
    create_pretraining_data(files, checkout / "demo_data" / "eval", vocab=vocab.path, progress=False,
                            options=CreateOptions(seq_len=32, max_predictions=4))
    model = ModelConfig(architecture="bert", hidden_size=48, num_layers=1, num_heads=3, vocab_size=vocab.size,
                        sequence_length=32, max_predictions=4, max_positions=40)
    export_serving(build_model(model, with_loss=False).builder.model_proto(), checkout / "model.onnx")
    ran = subprocess.run(["bash", "-euo", "pipefail", "-c", block.command], cwd=checkout, env=_environment(tmp_path / "bin"),
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert re.fullmatch(r"MLM accuracy \d\.\d\d on \d+ masked tokens, mlm_logits \(16, 4, \d+\)", ran.stdout.strip()), \
        ran.stdout
