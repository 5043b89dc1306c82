"""docs/data.md: the presets and the recipes name one shard layout, the output the page
quotes is what the tool prints, and (`check_docs_data_md`, after tests/test_docs.py ran
every shell block of the page, each recipe on the shipped samples in data/samples/
standing in for the public corpus it downloads, and a few addresses of the State of the
Union standing in for your own corpus) the shards land where the presets (configs/*.json)
look for them and load."""

import glob
import json
import re
from pathlib import Path

from data import PretrainingLoader
from tests.doc_commands import ROOT, shell_blocks

DOC = ROOT / "docs" / "data.md"


def _preset_globs():
    """The shard globs of every preset, by sequence length."""
    globs = {}
    for path in sorted((ROOT / "configs").glob("*.json")):
        config = json.loads(path.read_text())
        data, model = config.get("data", {}), config.get("model", {})
        if data.get("source") == "shards":
            key = (model["sequence_length"], tuple(data["files"]), tuple(data.get("eval_files", [])))
            globs.setdefault(key, []).append(path.name)
    return globs


def test_the_presets_name_one_layout():
    """The public corpora's recipes all write data/pretraining/seq{128,512}, which the presets
    read; your own corpus's recipe writes data/pretraining/own, which configs/own_corpus.json reads."""
    layouts = _preset_globs()
    own = (128, ("data/pretraining/own/train/*.hdf5",), ("data/pretraining/own/eval/*.hdf5",))
    assert layouts.pop(own) == ["own_corpus.json"]
    assert set(layouts) == {(128, ("data/pretraining/seq128/train/*.hdf5",), ("data/pretraining/seq128/eval/*.hdf5",)),
                            (512, ("data/pretraining/seq512/train/*.hdf5",), ("data/pretraining/seq512/eval/*.hdf5",))}
    text = DOC.read_text()
    assert "shards/phase" not in text
    for block in shell_blocks(DOC):
        if "--output-dir" in block.text:
            assert "--output-dir data/pretraining/seq" in block.text or \
                "--input my_corpus.txt" in block.text and "--output-dir data/pretraining/own" in block.text, block.text


def test_the_output_quoted_in_the_docs_is_what_the_tool_prints(tmp_path, capsys, monkeypatch):
    from data.create_pretraining_data import main

    quoted = [line.strip() for line in DOC.read_text().split("\n")
              if line.startswith(("    format ", "    read ", "    WARNING: "))]
    sample = "data/samples/wikitext/wiki.train.raw"
    common = ["--workers", "1", "--seq-len", "48", "--max-predictions", "6"]
    monkeypatch.chdir(ROOT)  # the docs name the sample relative to the repository
    assert main(["--input", sample, "--output-dir", str(tmp_path / "a"), "--vocab-size", "300", *common]) == 0
    assert main(["--input", sample, "--output-dir", str(tmp_path / "b"), "--vocab", str(tmp_path / "a" / "vocab.txt"),
                 "--format", "sentences", *common]) == 0
    out, err = capsys.readouterr()
    printed = {line.strip() for line in (out + err).split("\n")}
    assert len(quoted) == 4 and not set(quoted) - printed, set(quoted) - printed


def check_docs_data_md(ran) -> None:
    """After docs/data.md ran (tests/test_docs.py): each recipe on the shipped samples
    read its format without a warning, and the shards land where the presets
    (configs/*.json) look for them and load."""
    recipes = {r.sandbox for r in ran if "create_pretraining_data.py" in r.block.text}
    assert len(recipes) == 4, "Wikipedia, WikiText, books, your own corpus"
    own_layout = (128, ("data/pretraining/own/train/*.hdf5",), ("data/pretraining/own/eval/*.hdf5",))
    for sandbox in sorted(recipes):
        out = "\n".join(r.output for r in ran if r.sandbox == sandbox)
        assert "format " in out and "read " in out and "WARNING" not in out, out
        own = (sandbox / "my_corpus.txt").exists()
        for (seq, files, evals), presets in _preset_globs().items():
            if ((seq, files, evals) == own_layout) != own:
                continue
            train = sorted(f for g in files for f in glob.glob(str(sandbox / g)))
            held = sorted(f for g in evals for f in glob.glob(str(sandbox / g)))
            if seq == 512 and not train:
                continue  # only the Wikipedia recipe makes phase-2 shards
            assert train and held, f"{sandbox.name}: {presets} find no shards under {files} / {evals}"
            for shards in (train, held):
                loader = PretrainingLoader(shards, 2, prefetch=0, verbose=False,
                                           model_vocab_size=8192 if own else 30522)
                batch = next(iter(loader))
                assert loader.seq_len == seq and batch["input_ids"].shape == (2, seq)
        if own:  # the capped run trained on them and evaluated beside the baseline
            assert re.search(r"eval_mlm_accuracy [0-9.]+ \(unigram [0-9.]+\)", out), out
    assert any(Path(r.sandbox / "data/pretraining/seq512/train").is_dir() for r in ran)
