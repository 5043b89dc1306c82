"""The reference pages of the sweep's and the comparison's YAML are generated from their models
(python -m bert.config.specfile FILE PAGE), as docs/config.md is from the config's: every key is on its
page with a description, and the committed page is what the models describe."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from bert.compare.spec import CompareFile
from bert.config.specfile import PAGES, held_model, main
from bert.sweep.spec import SweepFile

ROOT = Path(__file__).resolve().parents[1]
DOCS = {"sweep": "docs/sweep_spec.md", "comparison": "docs/compare_spec.md"}
MODELS = {"sweep": SweepFile, "comparison": CompareFile}


@pytest.mark.parametrize("file", sorted(PAGES))
def test_the_spec_reference_is_what_the_spec_models_describe(file):
    module = importlib.import_module(PAGES[file])
    text = module.reference()
    page = DOCS[file]
    assert (ROOT / page).read_text(encoding="utf-8") == text, \
        f"{page} is stale: run python -m bert.config.specfile {file} {page}"
    assert main(["--check", file, str(ROOT / page)]) == 0


def test_every_key_of_a_spec_has_a_description_on_its_page():
    for file in PAGES:
        module = importlib.import_module(PAGES[file])
        text = module.reference()
        pending = [("", MODELS[file])]
        while pending:
            key, model = pending.pop()
            for name, field in model.model_fields.items():
                inner, tail = held_model(field.annotation)
                dotted = (f"{key}.{name}" if key else name) + tail
                assert field.description, f"{file}: {dotted} has no description"
                assert f"| `{dotted}` |" in text, f"{file}: {dotted} is not on its page"
                if inner is not None:
                    pending.append((dotted, inner))


def test_a_stale_page_is_refused_naming_the_command(tmp_path, capsys):
    stale = tmp_path / "page.md"
    stale.write_text("old\n")
    assert main(["--check", "sweep", str(stale)]) == 1
    assert f"run python -m bert.config.specfile sweep {stale}" in capsys.readouterr().err
