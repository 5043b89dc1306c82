"""A small generated SQuAD data set from the demo corpus's documents (`make squad-demo`).

    python -m data.squad_demo demo_data/squad

writes `train.json` and `dev.json` (SQuAD v1.1), `train-v2.0.json` and `dev-v2.0.json`
(the same questions plus one unanswerable question per paragraph: SQuAD v2.0) and the
WordPiece `vocab.txt` trained on the training documents: the files
`configs/squad_tiny.json` names. Nothing is downloaded; the bytes are the same on every
machine (data/demo.py's generator).

Each question asks for a fact that one fixed phrase of a document introduces ("was born
in X", "founded in X", ...), so a tiny model learns to answer in a few hundred steps;
contexts are whole documents (longer than a window at sequence 64). The unanswerable
question of a paragraph is the first question of the next one (about another entity),
with its answers kept as `plausible_answers`, as SQuAD v2.0 writes them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fileio import write_atomically
from data.demo import GENERATOR_VERSION, generate_documents
from data.vocab import Vocab, train_vocab

__all__ = ["QUESTIONS", "squad_json", "as_v2", "write_squad_demo"]

QUESTIONS = [
    (r"was born in (\w+)", "Where was {who} born?"),
    (r"\(born (\d+)\)", "In which year was {who} born?"),
    (r"married (\w+ \w+)\.", "Whom did {who} marry?"),
    (r"studied (\w+) at", "What did {who} study?"),
    (r"died in \w+ in (\d+)", "When did {who} die?"),
    (r"population of about (\d+)", "How many people live in {who}?"),
    (r"work in (\w+)\.", "In what do most people of {who} work?"),
    (r"founded in (\d+)", "When was {who} founded?"),
]

# The files of a demo directory; a directory holding any of them without the manifest is the user's.
FILES = ("train.json", "dev.json", "train-v2.0.json", "dev-v2.0.json", "vocab.txt")
MANIFEST = "squad_demo.json"


def squad_json(documents: list[list[str]], prefix: str) -> dict:
    """SQuAD v1.1 JSON: one paragraph per document, one question per fact phrase it holds."""
    paragraphs = []
    for d, doc in enumerate(documents):
        context = " ".join(doc)
        who = doc[0].split(" (")[0].split(" is ")[0]
        qas = []
        for q, (pattern, question) in enumerate(QUESTIONS):
            m = re.search(pattern, context)
            if m:
                qas.append({"id": f"{prefix}{d}-{q}", "question": question.format(who=who),
                            "answers": [{"text": m.group(1), "answer_start": m.start(1)}]})
        if qas:
            paragraphs.append({"context": context, "qas": qas})
    return {"version": "1.1", "data": [{"title": prefix, "paragraphs": paragraphs}]}


def as_v2(blob: dict) -> dict:
    """The SQuAD v2.0 form of `squad_json`'s output: every question marked answerable, and
    per paragraph one unanswerable question (the next paragraph's first, about another entity)."""
    blob = json.loads(json.dumps(blob))
    paragraphs = blob["data"][0]["paragraphs"]
    for i, para in enumerate(paragraphs):
        other = paragraphs[(i + 1) % len(paragraphs)]["qas"][0]
        for qa in para["qas"]:
            qa["is_impossible"] = False
        para["qas"].append({"id": f"no-{i}", "question": other["question"], "answers": [], "is_impossible": True,
                            "plausible_answers": other["answers"]})
    return {**blob, "version": "v2.0"}


def write_squad_demo(directory: Path, train_docs: int = 160, dev_docs: int = 24,
                     vocab_size: int = 700) -> tuple[Path, Path, Vocab]:
    """Write the demo files (module docstring) under `directory`; returns (train.json, dev.json, vocab)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, dev = generate_documents(train_docs, seed=21), generate_documents(dev_docs, seed=22)
    for name, docs in (("train", train), ("dev", dev)):
        blob = squad_json(docs, name)
        _write(directory / f"{name}.json", json.dumps(blob))
        _write(directory / f"{name}-v2.0.json", json.dumps(as_v2(blob)))
    sentences = [s for doc in train for s in doc] + [q for _, q in QUESTIONS]
    return directory / "train.json", directory / "dev.json", train_vocab(sentences, vocab_size, directory / "vocab.txt")


def _write(path: Path, text: str) -> None:
    write_atomically(path, text, replace=True)


def build(directory: Path) -> str:
    """`make squad-demo`: write the demo files, or keep them when the directory already holds
    them; never write over files of the user's (a directory with any of them but no manifest)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; choose a directory for the SQuAD demo files")
    settings = {"generator_version": GENERATOR_VERSION, "files": list(FILES)}
    if manifest.is_file():
        try:
            current = json.loads(manifest.read_text()) == settings
        except ValueError:
            current = False
        if current and all((directory / f).is_file() for f in FILES):
            return f"{directory}: the SQuAD demo files are there already ({', '.join(FILES)})"
    else:
        taken = [directory / f for f in FILES if (directory / f).exists()]
        if taken:
            raise ValueError(f"{taken[0]} exists but {manifest} does not (files of your own?): the SQuAD demo "
                             "would overwrite them; choose another directory or move them away")
    train, dev, vocab = write_squad_demo(directory)
    _write(manifest, json.dumps(settings, indent=2) + "\n")
    counts = [sum(len(p["qas"]) for a in json.loads((directory / f).read_text())["data"] for p in a["paragraphs"])
              for f in ("train.json", "dev.json")]
    return (f"{directory}: SQuAD v1.1 {train.name} ({counts[0]} questions) and {dev.name} ({counts[1]}), their v2.0 "
            f"forms (train-v2.0.json, dev-v2.0.json: one unanswerable question per paragraph added) and vocab.txt "
            f"({vocab.size} tokens)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", nargs="?", default="demo_data/squad", help="where to write (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(build(Path(args.directory)))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
