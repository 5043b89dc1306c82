"""The built-in demo corpus: a deterministic generator of a small fictional encyclopedia.

Why generated text: nothing may be downloaded, and text that ships with Python
(docstrings) differs between Python versions, so shards built from it would differ
between machines. The generator gives the same bytes everywhere for a seed and has
the structure masked-LM and NSP need to be learnable by a tiny model in a few hundred
steps:

* a small fixed world (seeded): 8 regions, 40 towns on 12 rivers, 100 people born
  in towns, 30 companies, 20 animals, with short lists of slot fillers; invented
  two-syllable names recur often enough to become whole WordPiece tokens, and the
  facts about an entity never change (a town is always in the same region), so a
  masked name or fact can be copied from the document or recalled from the world;
* each document describes one entity in several sentences drawn from templates with
  agreement (he/she/it, plural/singular) and repeated facts: the entity name and its
  facts recur inside a document, so many masked tokens can be recovered from context
  (copying through attention), and the template words from local grammar;
* documents about different kinds of entity use different templates, so whether B
  follows A (NSP) is decidable from topic and names.

`build_demo_data` writes the corpus as text under `<dir>/corpus/`, trains a small
WordPiece vocab on it and runs the regular create_pretraining_data pipeline, so the
demo exercises exactly the code a real corpus goes through.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from fileio import write_atomically
from data.corpus import read_documents
from data.pretraining import CreateOptions
from data.vocab import load_vocab, train_vocab

GENERATOR_VERSION = 1

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
           "kr", "st", "tr", "sh", "th", "ch", "h", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "oa"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "nd", "rt", "ck", "st"]

_REGIONS_N = 8
_TOWNS_N = 40
_RIVERS_N = 12
_PEOPLE_N = 100
_COMPANIES_N = 30
_ANIMALS_N = 20

# Short slot lists keep the text low in entropy, so a tiny model learns it quickly.
_SIZES = ["small", "large", "quiet", "busy", "old", "coastal"]
_INDUSTRIES = ["farming", "fishing", "mining", "weaving", "trade", "brewing", "pottery", "banking"]
_BUILDINGS = ["church", "bridge", "tower", "library", "castle", "harbour"]
_ADJECTIVES = ["old", "beautiful", "famous", "tall", "wooden", "stone"]
_FOODS = ["bread", "cheese", "apples", "honey", "fish", "wine"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_OCCUPATIONS = ["painter", "writer", "engineer", "singer", "doctor", "teacher", "poet", "sailor"]
_SUBJECTS = ["history", "music", "medicine", "law", "physics", "chemistry"]
_WORKS = {
    "painter": "paintings of", "writer": "novels about", "engineer": "bridges in",
    "singer": "songs about", "doctor": "a hospital in", "teacher": "a school in",
    "poet": "poems about", "sailor": "voyages from",
}
_PRODUCTS = ["ships", "shoes", "glass", "paper", "tools", "clocks", "bicycles", "soap"]
_HABITATS = ["forests", "rivers", "mountains", "lakes", "meadows"]
_FOOD_ANIMAL = ["insects", "seeds", "fish", "grass", "berries"]
_COLOURS = ["brown", "grey", "black", "white", "red"]
_ANIMAL_KINDS = ["bird", "frog", "beetle", "fish", "deer", "fox"]


@dataclass(frozen=True)
class DemoData:
    """Files of the demo data set (see build_demo_data)."""

    directory: Path
    vocab_path: Path
    vocab_size: int
    train_files: list[Path]
    eval_files: list[Path]
    seq_len: int
    max_predictions: int
    num_train_samples: int
    num_eval_samples: int


class _World:
    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        used: set[str] = set()
        self.regions = [self._name(2, 2, used) for _ in range(_REGIONS_N)]
        self.languages = [r + "ian" for r in self.regions]
        self.rivers = [self._name(2, 2, used) for _ in range(_RIVERS_N)]
        self.towns = [
            {"name": self._name(2, 2, used), "region": rnd.randrange(_REGIONS_N),
             "river": rnd.randrange(_RIVERS_N), "size": rnd.choice(_SIZES),
             "industry": rnd.sample(_INDUSTRIES, 2), "building": rnd.choice(_BUILDINGS),
             "adj": rnd.choice(_ADJECTIVES), "food": rnd.choice(_FOODS), "season": rnd.choice(_SEASONS),
             "year": rnd.randrange(900, 1800, 10), "pop": rnd.randrange(1, 50) * 1000}
            for _ in range(_TOWNS_N)
        ]
        self.people = [
            {"first": self._name(2, 2, used).capitalize(), "last": self._name(2, 2, used).capitalize(),
             "she": rnd.random() < 0.5, "town": rnd.randrange(_TOWNS_N), "job": rnd.choice(_OCCUPATIONS),
             "subject": rnd.choice(_SUBJECTS), "year": rnd.randrange(1700, 1990, 10),
             "study_town": rnd.randrange(_TOWNS_N)}
            for _ in range(_PEOPLE_N)
        ]
        for t in self.towns:
            t["founder"] = rnd.randrange(_PEOPLE_N)
        self.companies = [
            {"name": self._name(2, 2, used).capitalize(), "town": rnd.randrange(_TOWNS_N),
             "product": rnd.choice(_PRODUCTS), "year": rnd.randrange(1800, 2010, 10),
             "founder": rnd.randrange(_PEOPLE_N), "workers": rnd.randrange(1, 40) * 100}
            for _ in range(_COMPANIES_N)
        ]
        self.animals = [
            {"name": self._name(2, 2, used), "kind": rnd.choice(_ANIMAL_KINDS),
             "habitat": rnd.choice(_HABITATS), "region": rnd.randrange(_REGIONS_N),
             "food": rnd.choice(_FOOD_ANIMAL), "colour": rnd.choice(_COLOURS),
             "size": rnd.randrange(5, 95, 5), "discoverer": rnd.randrange(_PEOPLE_N)}
            for _ in range(_ANIMALS_N)
        ]

    def _name(self, lo: int, hi: int, used: set[str]) -> str:
        while True:
            n = self.rnd.randint(lo, hi)
            name = "".join(self.rnd.choice(_ONSETS) + self.rnd.choice(_VOWELS) + self.rnd.choice(_CODAS)
                           for _ in range(n))
            if name not in used and 4 <= len(name) <= 14:
                used.add(name)
                return name.capitalize()

    def person(self, i: int) -> str:
        p = self.people[i]
        return f"{p['first']} {p['last']}"


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _town_doc(w: _World, i: int, rnd: random.Random) -> list[str]:
    t = w.towns[i]
    name, region, river = t["name"], w.regions[t["region"]], w.rivers[t["river"]]
    other = w.towns[rnd.randrange(_TOWNS_N)]["name"]
    facts = [
        f"It lies on the {river} river, {rnd.randrange(5, 95, 5)} kilometres from {other}.",
        f"The town was founded in {t['year']} by {w.person(t['founder'])}.",
        f"{name} has a population of about {t['pop']} people.",
        f"The economy of {name} is based on {t['industry'][0]} and {t['industry'][1]}.",
        f"The {t['building']} of {name} is known for its {t['adj']} walls.",
        f"Every {t['season']}, {name} holds a festival of {t['food']}.",
        f"The people of {name} speak {w.languages[t['region']]}.",
        f"Most people in {name} work in {t['industry'][0]}.",
        f"Visitors come to {name} to see the {t['adj']} {t['building']}.",
        f"In {t['year'] + rnd.randrange(20, 150, 10)}, a great flood of the {river} damaged the town.",
        f"The {river} river is famous for its {rnd.choice(_FOODS)} markets near {name}.",
        f"{name} is one of the {rnd.choice(['oldest', 'largest', 'smallest', 'richest'])} towns in {region}.",
    ]
    rnd.shuffle(facts)
    return [f"{name} is {_a(t['size'])} town in {region}."] + facts[: rnd.randint(6, len(facts))]


def _person_doc(w: _World, i: int, rnd: random.Random) -> list[str]:
    p = w.people[i]
    he, his = ("she", "her") if p["she"] else ("he", "his")
    He, His = he.capitalize(), his.capitalize()
    town = w.towns[p["town"]]
    full, last = w.person(i), p["last"]
    spouse = w.person(rnd.randrange(_PEOPLE_N))
    work = _WORKS[p["job"]]
    place = rnd.choice([w.towns[p["study_town"]]["name"], town["name"], w.regions[town["region"]]])
    facts = [
        f"{He} was born in {town['name']}, a town in {w.regions[town['region']]}.",
        f"{He} studied {p['subject']} at the university of {w.towns[p['study_town']]['name']}.",
        f"{last} is best known for {his} {work} {place}.",
        f"In {p['year'] + rnd.randrange(20, 40, 10)}, {he} married {spouse}.",
        f"{His} father was {_a(rnd.choice(_OCCUPATIONS))} and {his} mother was {_a(rnd.choice(_OCCUPATIONS))}.",
        f"As a young {p['job']}, {last} lived in {w.towns[p['study_town']]['name']}.",
        f"{last} died in {town['name']} in {p['year'] + rnd.randrange(50, 90, 10)}.",
        f"{His} work on {p['subject']} made {full} famous in {w.regions[town['region']]}.",
        f"{He} spoke {w.languages[town['region']]} and {rnd.choice(w.languages)}.",
        f"A street in {town['name']} is named after {full}.",
    ]
    rnd.shuffle(facts)
    return [f"{full} (born {p['year']}) was {_a(p['job'])} from {w.regions[town['region']]}."] + \
        facts[: rnd.randint(5, len(facts))]


def _company_doc(w: _World, i: int, rnd: random.Random) -> list[str]:
    c = w.companies[i]
    town = w.towns[c["town"]]
    name = c["name"]
    facts = [
        f"The company was founded in {c['year']} by {w.person(c['founder'])}.",
        f"{name} employs about {c['workers']} workers.",
        f"Its main factory is in {town['name']}, on the {w.rivers[town['river']]} river.",
        f"{name} sells its {c['product']} in {rnd.choice(w.regions)} and {rnd.choice(w.regions)}.",
        f"In {c['year'] + rnd.randrange(10, 60, 10)}, {name} opened a second factory in {rnd.choice(w.towns)['name']}.",
        f"The {c['product']} made by {name} are known for their quality.",
        f"Many workers of {name} live in {town['name']}.",
        f"{name} is one of the largest makers of {c['product']} in {w.regions[town['region']]}.",
    ]
    rnd.shuffle(facts)
    return [f"{name} is a company that makes {c['product']} in {town['name']}."] + \
        facts[: rnd.randint(4, len(facts))]


def _animal_doc(w: _World, i: int, rnd: random.Random) -> list[str]:
    a = w.animals[i]
    name, region = f"the {a['name'].lower()} {a['kind']}", w.regions[a["region"]]
    Name = name[0].upper() + name[1:]
    facts = [
        f"It lives in the {a['habitat']} of {region}.",
        f"{Name} eats mostly {a['food']}.",
        f"An adult is about {a['size']} centimetres long.",
        f"{Name} was first described by {w.person(a['discoverer'])}.",
        f"Its colour is {a['colour']}, which hides it in the {a['habitat']}.",
        f"In winter, {name} moves to the {rnd.choice(_HABITATS)} of {rnd.choice(w.regions)}.",
        f"People in {region} call {name} the {rnd.choice(_ADJECTIVES)} {a['kind']}.",
    ]
    rnd.shuffle(facts)
    return [f"{Name} is a {a['colour']} {a['kind']} found in {region}."] + facts[: rnd.randint(4, len(facts))]


_KINDS = [(_town_doc, _TOWNS_N), (_person_doc, _PEOPLE_N), (_company_doc, _COMPANIES_N),
          (_animal_doc, _ANIMALS_N)]


def generate_documents(num_documents: int, seed: int, *, world_seed: int = 0) -> list[list[str]]:
    """`num_documents` documents (lists of sentences); the same world for every seed."""
    world = _World(random.Random(f"demo-world-{world_seed}"))
    rnd = random.Random(f"demo-docs-{seed}")
    weights = [n for _, n in _KINDS]
    docs = []
    for _ in range(num_documents):
        make, n = rnd.choices(_KINDS, weights=weights)[0]
        docs.append(make(world, rnd.randrange(n), rnd))
    return docs


def write_corpus(path: Path, docs: list[list[str]]) -> None:
    write_atomically(path, "\n\n".join("\n".join(d) for d in docs) + "\n", replace=True)


# Sizes: 45k training rows at seq 128 (2 maskings of ~22.5k pairs) and 2.3k eval
# rows; the whole build takes ~10 s on 2 idle cores.
_TRAIN_FILES = 4
_TRAIN_DOCS_PER_FILE = 3000
_EVAL_DOCS = 1200
_VOCAB_SIZE = 2048
_DUPE_FACTOR = 2


def build_demo_data(
    directory: str | Path, *, seq_len: int = 128, max_predictions: int = 20, seed: int = 0
) -> DemoData:
    """Build (or reuse) the demo corpus, vocab and shards under `directory`.

    Idempotent: a directory built with the same arguments is reused as it is; one
    built with different arguments, or holding unrelated shards, is an error rather
    than being overwritten.
    """
    from data.create_pretraining_data import create_pretraining_data
    from data.shards import inspect_shard

    directory = Path(directory)
    manifest_path = directory / "demo.json"
    settings = {"generator_version": GENERATOR_VERSION, "seq_len": seq_len,
                "max_predictions": max_predictions, "seed": seed, "vocab_size": _VOCAB_SIZE,
                "dupe_factor": _DUPE_FACTOR, "train_files": _TRAIN_FILES,
                "train_docs_per_file": _TRAIN_DOCS_PER_FILE, "eval_docs": _EVAL_DOCS}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("settings") != settings:
            raise ValueError(
                f"{directory} holds demo data built with other settings ({manifest.get('settings')}); "
                f"use another directory or delete it to rebuild with {settings}"
            )
        rec = manifest["data"]
        data = DemoData(
            directory=directory, vocab_path=directory / rec["vocab_path"], vocab_size=rec["vocab_size"],
            train_files=[directory / f for f in rec["train_files"]],
            eval_files=[directory / f for f in rec["eval_files"]], seq_len=rec["seq_len"],
            max_predictions=rec["max_predictions"], num_train_samples=rec["num_train_samples"],
            num_eval_samples=rec["num_eval_samples"],
        )
        for f in data.train_files + data.eval_files:
            inspect_shard(f)  # a damaged file is an error, not silently rebuilt
        return data
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"demo data directory {directory} is a file; choose a directory (data.directory)")
    # Without the manifest nothing here is the demo's: never write over what is there.
    taken = [p for p in (directory / "vocab.txt", directory / "corpus", directory / "train", directory / "eval")
             if p.is_file() or (p.is_dir() and any(p.iterdir()))]
    if taken:
        raise ValueError(
            f"{taken[0]} exists but {manifest_path} does not (your own data, or an interrupted demo build): the "
            "demo build would overwrite it; set data.directory to a new directory, or move it away"
        )

    corpus = directory / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    train_txt = []
    for i in range(_TRAIN_FILES):
        p = corpus / f"train_{i:02d}.txt"
        write_corpus(p, generate_documents(_TRAIN_DOCS_PER_FILE, seed=seed * 1000 + i))
        train_txt.append(p)
    eval_txt = corpus / "eval_00.txt"
    write_corpus(eval_txt, generate_documents(_EVAL_DOCS, seed=seed * 1000 + 999))

    # min_frequency 1: the small world's words alone do not fill 2048 tokens with
    # merges seen twice, and configs/demo.json fixes the vocab size at 2048.
    vocab_path = directory / "vocab.txt"
    train_vocab((s for f in train_txt for doc in read_documents(f) for s in doc), _VOCAB_SIZE, vocab_path,
                min_frequency=1)
    opts = CreateOptions(seq_len=seq_len, max_predictions=max_predictions, dupe_factor=_DUPE_FACTOR,
                         seed=seed)
    train = create_pretraining_data(train_txt, directory / "train", vocab=vocab_path, options=opts,
                                    workers=1, overwrite=True, progress=False)
    ev = create_pretraining_data([eval_txt], directory / "eval", vocab=vocab_path,
                                 options=CreateOptions(**{**asdict(opts), "dupe_factor": 1, "seed": seed + 1}),
                                 workers=1, overwrite=True, progress=False)
    data = DemoData(directory=directory, vocab_path=vocab_path, vocab_size=load_vocab(vocab_path).size,
                    train_files=train.shards, eval_files=ev.shards, seq_len=seq_len,
                    max_predictions=max_predictions, num_train_samples=train.samples,
                    num_eval_samples=ev.samples)
    def rel(p: Path) -> str:
        return str(p.relative_to(directory))

    record = {**asdict(data), "vocab_path": rel(vocab_path),
              "train_files": [rel(p) for p in data.train_files],
              "eval_files": [rel(p) for p in data.eval_files]}
    del record["directory"]
    write_atomically(manifest_path, json.dumps({"settings": settings, "data": record}, indent=2) + "\n", replace=True)
    return data

