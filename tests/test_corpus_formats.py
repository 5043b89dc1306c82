"""Corpus formats (data/readers.py, data/corpus.py): each format read right, detected,
warned about when its structure looks wrong, and cut into shards written in parallel.

The samples under data/samples/ hold the same seven articles in several formats, written
independently: `paragraphs/vardal.txt` as plain prose, `wikitext/` tokenised the way
WikiText is, and `wikipedia/{text,json}` as WikiExtractor 3.1.0 wrote them for the XML
dump beside them. Reading any of them must give the prose sample's sentences.
"""

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from data import PretrainingLoader
from data.corpus import describe, parse_size, plan_file, read_documents, read_split
from data.create_pretraining_data import create_pretraining_data, main
from data.demo import generate_documents
from data.pretraining import SAMPLE_KEYS, CreateOptions, held_out_key
from data.readers import detect_format, detokenize_wikitext, read_text, split_sentences, Where
from data.vocab import train_vocab

SAMPLES = Path(__file__).resolve().parent.parent / "data" / "samples"
PROSE = SAMPLES / "paragraphs" / "vardal.txt"
WIKITEXT = [SAMPLES / "wikitext" / "wiki.train.raw", SAMPLES / "wikitext" / "wiki.valid.raw"]
WIKI_TEXT = SAMPLES / "wikipedia" / "text" / "AA" / "wiki_00"
WIKI_JSON = SAMPLES / "wikipedia" / "json" / "AA" / "wiki_00"
BOOKS = sorted((SAMPLES / "books").glob("*.txt"))
HEADINGS = {"History.", "Economy.", "Transport.", "Course.", "Wildlife.", "Later life.", "Legacy.", "Effects.",
            "Uses.", "Climate."}


def _read(path, fmt="auto"):
    plan = plan_file(path, fmt)
    docs, stats = read_split(plan.splits[0])
    return plan, docs, stats


def _warnings(plan, stats):
    return describe([plan], {plan.path: stats})[1]


def test_the_prose_sample_is_split_into_sentences_by_the_splitter():
    plan, docs, stats = _read(PROSE)
    assert plan.format == "paragraphs" and not _warnings(plan, stats)
    assert [len(d) for d in docs] == [13, 6, 9, 6, 6, 7, 5]
    first = docs[0]
    assert first[3] == "The town was founded in 1203 by Dr. Ansel Vey, a physician from the coast."
    assert first[5].endswith("from as far as St. Oren.") and first[10].startswith("Tourism has grown")
    assert "(c. 1160 – 1229)" in docs[2][0]
    lines = [line for line in PROSE.read_text().split("\n") if line]
    assert " ".join(s for d in docs for s in d) == " ".join(lines), "splitting keeps every character"


def test_wikitext_gives_one_document_per_article_with_sentence_lines():
    prose = read_documents(PROSE)
    docs = []
    for path in WIKITEXT:
        plan, part, stats = _read(path)
        assert plan.format == "wikitext" and "' = Title = '" in plan.detected.reason
        assert not _warnings(plan, stats)
        assert len(part) == len(re.findall(r"(?m)^ = [^=].* = $", path.read_text()))
        docs += part
    assert docs == prose, "WikiText read back must equal the prose it was tokenised from"
    text = " ".join(s for d in docs for s in d)
    for artefact in (" @-@ ", " @,@ ", " @.@ ", " , ", " .", " 's", "= =", '" burnt', 'moor "'):
        assert artefact not in text, artefact
    assert '"burnt moor".' in text and "39,412" in text and "half-timbered" in text


def test_wikitext_read_as_sentences_is_warned_about():
    """The old behaviour: a document per heading, a paragraph per "sentence"."""
    plan, docs, stats = _read(WIKITEXT[0], "sentences")
    warnings = _warnings(plan, stats)
    assert len(docs) > 20
    assert any("hold a single sentence" in w for w in warnings), warnings
    assert any("look like WikiText" in w and "--format wikitext" in w for w in warnings), warnings


def test_long_wikitext_paragraphs_read_as_sentences_warn_about_long_sentences(tmp_path):
    docs = generate_documents(30, seed=1)
    article = lambda i, d: f" = Article {i} = \n \n {' '.join(d * 3)} \n \n = = Notes = = \n \n {' '.join(d)} \n"  # noqa: E731
    path = tmp_path / "wiki.train.raw"
    path.write_text(" \n" + "".join(article(i, d) for i, d in enumerate(docs)))
    plan, auto, stats = _read(path)
    assert plan.format == "wikitext" and len(auto) == 30 and not _warnings(plan, stats)
    assert [len(d) for d in auto] == [4 * len(d) for d in docs]
    plan, forced, stats = _read(path, "sentences")
    warnings = _warnings(plan, stats)
    assert any("have more than 100 words" in w and "--format paragraphs" in w for w in warnings), warnings


@pytest.mark.parametrize(("tokenised", "text"), [
    (" The game 's role @-@ playing part , released in 2 @,@ 011 ( in Japan ) , sold 1 @.@ 5 million . ",
     "The game's role-playing part, released in 2,011 (in Japan), sold 1.5 million."),
    (' " He gave us a town , " wrote the chronicler ; the players \' union did n\'t agree ! ',
     '"He gave us a town," wrote the chronicler; the players\' union didn\'t agree!'),
    (" It cost $ 5 [ note ] and rose 3 % . A <unk> word . ", "It cost $5 [note] and rose 3%. A [UNK] word."),
    (' An " odd " quote " left open ', 'An "odd" quote " left open'),
])
def test_wikitext_detokenisation(tokenised, text):
    assert detokenize_wikitext(tokenised) == text


def test_wikiextractor_text_and_json_give_the_articles_and_section_titles():
    prose = read_documents(PROSE)
    plan_t, text, stats_t = _read(WIKI_TEXT)
    plan_j, lines, stats_j = _read(WIKI_JSON)
    assert (plan_t.format, plan_j.format) == ("wikiextractor", "jsonl")
    assert not _warnings(plan_t, stats_t) and not _warnings(plan_j, stats_j)
    assert text == lines
    # WikiExtractor keeps section titles as one-word paragraphs ("History."), and escapes '&'.
    assert [[s for s in d if s not in HEADINGS] for d in text] == prose
    assert {s for d in text for s in d if s in HEADINGS} == HEADINGS
    assert text[3][0].startswith("Vey & Sons was a cloth merchant")
    assert "&amp;" in WIKI_TEXT.read_text() and "&amp;" in WIKI_JSON.read_text()


def test_a_doc_title_may_hold_angle_brackets_and_quotes():
    text = ('<doc id="7" url="https://x/?curid=7" title="a > b">\na > b\n\nFirst sentence here. Second one.\n</doc>\n'
            '<doc id="8" url="u" title=""Weird" &gt; Name">\n"Weird" > Name\n\nOnly one.\n</doc>\n'
            '<doc id="9">\nNo title attribute: this line stays.\n</doc>\n')
    docs, _ = read_text(text, "wikiextractor", Where("w"))
    assert docs == [["First sentence here.", "Second one."], ["Only one."], ["No title attribute: this line stays."]]
    assert detect_format(text).format == "wikiextractor"


@pytest.mark.parametrize(("text", "line", "what"), [
    ('<doc id="1">\nx\n<doc id="2">\n</doc>\n', 3, "opens inside an unclosed"),
    ('<doc id="1">\nx\n</doc>\n</doc>\n', 4, "without a matching"),
    ('<doc id="1">\nx\n</doc>\nstray text\n', 4, "text outside a <doc"),
    ('<doc id="1">\nx\n', 3, "not closed"),
])
def test_wikiextractor_errors_name_the_line(text, line, what):
    with pytest.raises(ValueError, match=rf"^w, line {line}: .*{what}"):
        read_text(text, "wikiextractor", Where("w"))


@pytest.mark.parametrize(("line", "what"), [
    ("not json", "not a JSON object"), ('["a list"]', "an object with a \"text\" string"),
    ('{"text": 5}', "an object with a \"text\" string"), ('{"text": "\\ud800 x"}', "unpaired surrogate"),
    ("[" * 100000, "not a JSON object"),
])
def test_json_lines_errors_name_the_line(line, what):
    with pytest.raises(ValueError, match=rf"^j, line 2: .*{re.escape(what)}"):
        read_text('{"text": "Fine. Two."}\n' + line + "\n", "jsonl", Where("j"))


def test_one_sentence_per_line_books():
    plan, docs, stats = _read(BOOKS[0])
    assert plan.format == "sentences" and docs == [BOOKS[0].read_text().strip().split("\n")]
    joined = "\n\n".join(p.read_text().strip() for p in BOOKS) + "\n"
    docs, _ = read_text(joined, "sentences", Where("books"))
    assert [len(d) for d in docs] == [len(p.read_text().strip().split("\n")) for p in BOOKS]
    assert 'Visitors can read the last entry, which says only: "Calm sea. Clear sky. All well."' in docs[1]


def test_detection_of_every_sample():
    found = {p.name if p.parent.name != "AA" else p.parent.parent.name: plan_file(p).format
             for p in [PROSE, *WIKITEXT, WIKI_TEXT, WIKI_JSON, *BOOKS]}
    assert found == {"vardal.txt": "paragraphs", "wiki.train.raw": "wikitext", "wiki.valid.raw": "wikitext",
                     "text": "wikiextractor", "json": "jsonl", **{p.name: "sentences" for p in BOOKS}}


def test_structure_warnings_fire_on_bad_structure_only(tmp_path):
    sentences = [s for d in generate_documents(40, seed=2) for s in d]

    def warnings(name, text, fmt="auto"):
        path = tmp_path / name
        path.write_text(text)
        plan, _, stats = _read(path, fmt)
        return _warnings(plan, stats)

    assert warnings("fine.txt", "\n\n".join("\n".join(sentences[i:i + 8]) for i in range(0, 320, 8))) == []
    (w,) = warnings("one_doc.txt", "\n".join(sentences[:60]))
    assert w.startswith("no document breaks: ") and "one_doc.txt is one document" in w
    (w,) = warnings("blank_after_each.txt", "\n\n".join(sentences[:60]))
    assert "60 of 60 documents hold a single sentence" in w
    w = warnings("paragraphs_as_sentences.txt", "\n\n".join(" ".join(sentences[i:i + 20])
                                                                for i in range(0, 300, 20)), "sentences")
    assert any("15 of 15 sentences (100.0%) have more than 100 words" in x and "--format paragraphs" in x for x in w), w
    wrapped = "\n\n".join("\n".join(textwrap_lines(" ".join(sentences[i:i + 8]))) for i in range(0, 240, 8))
    assert any("line breaks" in w and "hard-wrapped" in w for w in warnings("wrapped.txt", wrapped, "paragraphs"))
    markup = "".join(f'<doc id="{i}" title="t">\nt\n\nSome text here. More text.\n</doc>\n' for i in range(5))
    assert any("<doc> markup" in w for w in warnings("markup.txt", markup, "paragraphs"))


def textwrap_lines(text, width=60):
    import textwrap
    return textwrap.wrap(text, width)


# ------------------------------------------------------------------ shards


def _write_formats(directory, docs):
    """The same documents in every format, as large files."""
    directory.mkdir(exist_ok=True)
    files = {
        "sentences": "\n\n".join("\n".join(d) for d in docs) + "\n",
        "paragraphs": "\n\n".join(" ".join(d) for d in docs) + "\n",
        "wikitext": " \n" + "".join(f" = Doc {i} = \n \n {' '.join(d)} \n \n" for i, d in enumerate(docs)),
        "wikiextractor": "".join(f'<doc id="{i}" url="u" title="Doc {i}">\nDoc {i}\n\n{" ".join(d)}\n</doc>\n'
                                 for i, d in enumerate(docs)),
        "jsonl": "".join(json.dumps({"id": i, "text": " ".join(d)}) + "\n" for i, d in enumerate(docs)),
    }
    for fmt, text in files.items():
        (directory / fmt).write_text(text)
    return {fmt: directory / fmt for fmt in files}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    docs = generate_documents(200, seed=3)
    vocab = train_vocab((s for d in docs for s in d), 700, root / "vocab.txt")
    return root, docs, _write_formats(root / "formats", docs), vocab.path


@pytest.mark.parametrize("fmt", ["sentences", "paragraphs", "wikitext", "wikiextractor", "jsonl"])
def test_a_large_file_is_cut_at_document_starts(big, fmt):
    _, docs, files, _ = big
    plan = plan_file(files[fmt], "auto", shard_bytes=10_000)
    assert plan.format == fmt and len(plan.splits) >= 5
    assert [s.start for s in plan.splits[1:]] == [s.end for s in plan.splits[:-1]]
    assert plan.splits[0].start == 0 and plan.splits[-1].end == files[fmt].stat().st_size
    pieces = [read_split(s)[0] for s in plan.splits]
    assert all(pieces) and sum(pieces, []) == read_documents(files[fmt])
    if fmt == "sentences":
        assert sum(pieces, []) == docs


def test_a_large_file_without_document_breaks_is_cut_at_lines_and_warned_about(big, tmp_path):
    _, docs, _, _ = big
    path = tmp_path / "no_breaks.txt"
    path.write_text("\n".join(s for d in docs for s in d) + "\n")
    plan = plan_file(path, shard_bytes=10_000)
    assert plan.format == "sentences" and len(plan.splits) >= 5
    assert plan.cuts_inside_documents == len(plan.splits) - 1
    pieces = [read_split(s) for s in plan.splits]
    assert [s for p in pieces for d in p[0] for s in d] == [s for d in docs for s in d]
    stats = pieces[0][1]
    for p in pieces[1:]:
        stats.add(p[1])
    (w,) = _warnings(plan, stats)
    assert w.startswith(f"no document breaks: {path} had no document start within --shard-size of ")
    fine = tmp_path / "fine.txt"  # documents shorter than a shard are never cut inside
    fine.write_text("\n\n".join("\n".join(d) for d in docs))
    assert plan_file(fine, shard_bytes=10_000).cuts_inside_documents == 0


def test_errors_in_a_later_shard_name_the_line_in_the_file(big, tmp_path):
    _, docs, files, _ = big
    lines = files["wikiextractor"].read_text().split("\n")
    bad = lines.index("</doc>", len(lines) - 40) + 1  # between two blocks
    lines.insert(bad, "stray text between blocks")
    path = tmp_path / "wiki_bad"
    path.write_text("\n".join(lines))
    plan = plan_file(path, shard_bytes=10_000)
    assert plan.splits[-1].start > 0
    with pytest.raises(ValueError, match=rf"{path}, line {bad + 1}: text outside"):
        for split in plan.splits:
            read_split(split)
    raw = files["sentences"].read_bytes()
    start = raw.index(b"\n", len(raw) - 500) + 1
    start += raw[start] == ord("\n")  # not a blank line
    at = start + 2
    path.write_bytes(raw[:at] + b"\xff" + raw[at:])
    plan = plan_file(path, shard_bytes=10_000)
    line = raw[:at].count(b"\n") + 1
    with pytest.raises(ValueError, match=rf"{path}, line {line}, column 3: not valid UTF-8"):
        read_split(plan.splits[-1])


def _shards(paths):
    out = []
    for p in paths:
        with h5py.File(p) as f:
            out.append({k: f[k][:] for k in SAMPLE_KEYS} | {"source_bytes": tuple(f.attrs["source_bytes"])})
    return out


@pytest.mark.slow
def test_one_large_file_is_written_as_several_shards_in_parallel_with_the_one_worker_result(big):
    root, docs, files, vocab = big
    opts = CreateOptions(seq_len=64, max_predictions=10, dupe_factor=2, seed=4)
    runs = {w: create_pretraining_data([files["paragraphs"]], root / f"w{w}", vocab=vocab, options=opts, workers=w,
                                       progress=False, shard_bytes=20_000, held_out_fraction=0.1)
            for w in (1, 3)}
    one, three = runs[1], runs[3]
    assert len(one.shards) >= 4 and len(one.eval_shards) >= 2
    assert [p.name for p in one.shards] == [p.name for p in three.shards]
    assert [p.name for p in one.eval_shards] == [p.name for p in three.eval_shards]
    for a, b in zip(_shards(one.shards + one.eval_shards), _shards(three.shards + three.eval_shards)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), "differs with the worker count"
    assert (one.documents, one.eval_documents, one.samples) == (three.documents, three.eval_documents, three.samples)
    assert one.documents + one.eval_documents == len(docs)
    starts = [s["source_bytes"] for s in _shards(one.shards)]
    assert starts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(starts, starts[1:]))
    loader = PretrainingLoader([str(p) for p in one.shards], 16, prefetch=0, verbose=False)
    batch = next(iter(loader))
    assert loader.num_samples == one.samples and batch["input_ids"].shape == (16, 64)
    held = PretrainingLoader([str(p) for p in one.eval_shards], 4, prefetch=0, verbose=False)
    assert held.num_samples == one.eval_samples


@pytest.mark.slow
def test_shards_of_every_sample_load_through_the_loader(tmp_path, capsys):
    inputs = [PROSE, WIKI_TEXT, WIKI_JSON, *WIKITEXT, *BOOKS]
    r = create_pretraining_data(inputs, tmp_path / "out", vocab_size=400, workers=1, progress=True,
                                options=CreateOptions(seq_len=48, max_predictions=6))
    out, err = capsys.readouterr()
    assert "format wikitext (detected in 2 files;" in out and "format jsonl (detected in 1 file;" in out
    assert "read paragraphs: 1 file, 7 documents, 52 sentences" in out
    assert "WARNING" not in err
    assert r.formats[str(WIKI_JSON)] == "jsonl" and len(r.shards) == len(inputs)
    loader = PretrainingLoader([str(p) for p in r.shards], 8, prefetch=0, verbose=False)
    assert loader.num_samples == r.samples and next(iter(loader))["input_ids"].shape == (8, 48)


@pytest.mark.slow
def test_a_small_corpus_holds_out_its_lowest_document(tmp_path):
    docs = read_documents(PROSE)
    r = create_pretraining_data([PROSE], tmp_path / "o", vocab_size=300, workers=1, progress=False,
                                held_out_fraction=1e-9, options=CreateOptions(seq_len=48, max_predictions=6))
    assert (r.documents, r.eval_documents) == (6, 1) and len(r.eval_shards) == 1
    keys = [held_out_key(d, 0) for d in docs]
    assert min(keys) >= 1e-9 * 2**64, "the fraction alone holds out nothing"


def test_cli_prints_the_detected_format_and_warns_on_stderr(tmp_path, capsys):
    assert main(["--input", str(WIKITEXT[0]), "--output-dir", str(tmp_path / "a"), "--vocab-size", "300",
                 "--workers", "1", "--seq-len", "48", "--max-predictions", "6"]) == 0
    out, err = capsys.readouterr()
    assert "format wikitext (detected in 1 file;" in out and "read wikitext: 1 file, 5 documents, 40 sentences" in out
    assert "WARNING" not in err
    assert main(["--input", str(WIKITEXT[0]), "--output-dir", str(tmp_path / "b"), "--vocab",
                 str(tmp_path / "a" / "vocab.txt"), "--workers", "1", "--seq-len", "48", "--max-predictions", "6",
                 "--format", "sentences"]) == 0
    out, err = capsys.readouterr()
    assert "format sentences (--format)" in out
    assert [line for line in err.split("\n") if line.startswith("WARNING: ")], err
    assert main(["--input", str(PROSE), "--output-dir", str(tmp_path / "c"), "--vocab-size", "300",
                 "--shard-size", "12 parsecs"]) == 2
    assert "--shard-size '12 parsecs' is not a size" in capsys.readouterr().err


@pytest.mark.parametrize("scan_bytes", [1 << 20, 7, 1])
def test_the_first_line_over_the_limit_is_found_across_blocks(tmp_path, monkeypatch, scan_bytes):
    import data.corpus

    monkeypatch.setattr(data.corpus, "_SCAN_BYTES", scan_bytes)
    for text, limit, line in [(b"ab\ncdef\ng", 3, 2), (b"ab\ncdef\ng", 4, None), (b"abcdefghijklmnop", 10, 1),
                              (b"a\nb\nc\nabcdefghijklmnop\n", 10, 4), (b"a" + b"\n" * 8 + b"bcdefghijkl", 10, 9),
                              (b"a" + b"\n" * 8 + b"bcdefghijk", 10, None), (b"", 1, None)]:
        path = tmp_path / "f.txt"
        path.write_bytes(text)
        assert data.corpus._first_line_over(str(path), limit) == line, (text, limit)


def test_sizes_and_the_splitter_on_its_own():
    assert [parse_size(s) for s in ("4096", "16M", "512k", "1G", "1.5KB")] == [4096, 16 << 20, 512 << 10, 1 << 30, 1536]
    for bad in ("", "-1", "M", "0"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert split_sentences("No boundary here") == ["No boundary here"]
    long = "Dr. Vey came. " * 600  # 8,400 characters: split a window at a time
    assert split_sentences(long) == ["Dr. Vey came."] * 600
    # No sentence end anywhere: pySBD is not asked, and the 2,000 words are cut at white space
    # as any run of more than 4,000 characters is, so no "sentence" grows with the text.
    assert split_sentences("word " * 2000) == ["word " * 799 + "word"] * 2 + ["word " * 399 + "word"]
    run_on = split_sentences("word " * 2000 + "end. Next one.")  # one 2,000-word sentence: cut at white space
    assert run_on[:2] == ["word " * 799 + "word"] * 2 and run_on[2:] == ["word " * 400 + "end.", "Next one."]
