"""A small SQuAD-format data set made from the demo generator's documents, for fine-tuning tests.

Each question asks for a fact that one fixed phrase of the document introduces
("was born in X", "founded in X", ...), so a tiny model learns to answer in a few
hundred steps; contexts are whole documents (longer than a window at sequence 64).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from data.demo import generate_documents
from data.vocab import Vocab, train_vocab

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


def squad_json(documents: list[list[str]], prefix: str) -> dict:
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


def write_tiny_squad(directory: Path, train_docs: int = 160, dev_docs: int = 24, vocab_size: int = 700) -> tuple[Path, Path, Vocab]:
    directory.mkdir(parents=True, exist_ok=True)
    train, dev = generate_documents(train_docs, seed=21), generate_documents(dev_docs, seed=22)
    files = []
    for name, docs in (("train.json", train), ("dev.json", dev)):
        blob = squad_json(docs, name[:-5])
        (directory / name).write_text(json.dumps(blob))
        files.append(directory / name)
    sentences = [s for doc in train for s in doc] + [q for _, q in QUESTIONS]
    return files[0], files[1], train_vocab(sentences, vocab_size, directory / "vocab.txt")
