"""Create BERT pre-training shards (MLM + NSP) from raw text.

    python data/create_pretraining_data.py --input 'corpus/*.txt' --output-dir shards
        --vocab vocab.txt --seq-len 128 --max-predictions 20 --dupe-factor 5
    python -m data.create_pretraining_data ...   (same)

Input formats (`--format`, default auto: detected per file from its first 64 KB and
printed with the documents and sentences read): WikiExtractor output (`<doc>` blocks,
or `--json` lines), WikiText (raw or tokenised), one sentence per line, or one
paragraph per line (split into sentences by pySBD); a blank line ends a document in
the last two. A warning (stderr) says when the structure looks wrong: "sentences" of
hundreds of words, a file without document breaks, documents of one sentence, ...

Each input file is cut into splits of about `--shard-size` bytes of text (default 16M)
at document starts, and each split becomes one HDF5 shard (`shard_00000.hdf5`, ...,
numbered over the sorted inputs), written in parallel by `--workers` processes; the
cuts and every shard's random stream depend only on the input and `--seed`, so the
output is the same for any number of workers. With `--vocab-size` instead of
`--vocab`, a WordPiece vocab is first trained on the corpus and written to
`<output-dir>/vocab.txt`. Existing outputs are only replaced with `--overwrite`.

`--held-out-fraction F` splits off about that fraction of the documents, chosen by a
hash of each document's text (so the same on every run, and a repeated document never
straddles the split): their shards go to `<output-dir>/eval/`, the rest to
`<output-dir>/train/`; point `data.files` and `data.eval_files` at them. A split with no
document on one side writes no shard there.

Shards (and a trained vocab) are written into a hidden staging directory of the output
directory and moved into place only when every one is written and the whole set checks
out, so a failure (a bad input file, a held-out split that leaves one side empty, a
full disk, an interrupt) leaves no partial shard and replaces none.
See docs/data.md for the formats and a recipe per public corpus.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import dataclasses
import errno
import multiprocessing
import os
import shutil
import socket
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from tqdm import tqdm

from fileio import DiskFull, disk_full, publish
from data.corpus import (DEFAULT_MAX_LINE_BYTES, DEFAULT_SHARD_BYTES, FORMATS, FilePlan, Stats, describe, expand_inputs, parse_size,
                         plan_file, read_split)
from data.pretraining import CreateOptions, ShardJob, process_split, shard_name
from data.vocab import load_vocab, train_vocab


@dataclass(frozen=True)
class CreateResult:
    shards: list[Path]
    vocab_path: Path
    documents: int
    sentences: int
    samples: int
    seconds: float
    eval_shards: list[Path] = field(default_factory=list)  # with a held-out fraction
    eval_documents: int = 0
    eval_samples: int = 0
    formats: dict[str, str] = field(default_factory=dict)  # input file → format read
    summary: list[str] = field(default_factory=list)  # what was detected and read
    warnings: list[str] = field(default_factory=list)  # structure that looks wrong


def create_pretraining_data(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    *,
    vocab: str | Path | None = None,
    vocab_size: int | None = None,
    options: CreateOptions = CreateOptions(),
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    held_out_fraction: float = 0.0,
    format: str = "auto",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> CreateResult:
    """Library entry point of the CLI; see the module docstring. With `progress`, prints
    the detected formats and the counts read (stdout) and a progress bar; warnings about
    the corpus structure go to stderr either way."""
    t0 = time.perf_counter()
    options.check()
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"--held-out-fraction must be in [0, 1), got {held_out_fraction}")
    if (vocab is None) == (vocab_size is None):
        raise ValueError("give exactly one of --vocab (a vocab.txt) or --vocab-size (train one)")
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"unknown --format {format!r}; choose auto or one of {', '.join(FORMATS)}")
    if shard_bytes < 1:
        raise ValueError(f"--shard-size must be positive, got {shard_bytes}")
    files = expand_inputs(inputs)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} is a file, not a directory; name a directory for the shards")
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, ...
        raise ValueError(f"--output-dir {output_dir} cannot be created ({e.strerror})") from None

    # Spawned workers: the parent may hold tokenizers' thread pool, which does not survive fork.
    # An executor, not multiprocessing.Pool: a worker that dies (killed, out of memory, or unable
    # to import this module) breaks it with an error, where a Pool starts another for ever.
    expected = sum(max(1, -(-f.stat().st_size // shard_bytes)) for f in files)
    workers = max(1, min(workers, expected))
    _remove_stale_staging(output_dir)
    staging = output_dir / f"{_STAGING}{socket.gethostname()}-{os.getpid()}"
    pool = None
    try:
        pool = (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
                if workers > 1 else None)
        return _create(files, output_dir, staging, pool, workers, t0, vocab=vocab, vocab_size=vocab_size,
                       options=options, overwrite=overwrite, progress=progress, held_out_fraction=held_out_fraction,
                       format=format, shard_bytes=shard_bytes, max_line_bytes=max_line_bytes)
    except OSError as e:  # a full or read-only disk, a file that went away: one line, nothing left behind
        full = disk_full(e)
        detail = " ".join(str(e.strerror or e).split())
        if e.filename is not None:  # the file being written, by the name it was to have
            name = Path(e.filename)
            detail += f", writing {output_dir / name.relative_to(staging) if name.is_relative_to(staging) else name}"
        remedy = ("free space" if full else "raise the file size limit (ulimit -f) or give a smaller --shard-size"
                  if e.errno == errno.EFBIG else "fix the cause")
        raise (DiskFull if full else ValueError)(f"{'the disk is full: ' if full else ''}cannot create the shards under {output_dir} "
                         f"({detail}); no shard was written or replaced (the files already there are intact, "
                         f"the ones staged were removed): {remedy} and run again") from None
    except BrokenProcessPool:
        raise ValueError(f"a worker process ended without its result (killed, out of memory, or it could not "
                         f"start: its own message is above); no shard under {output_dir} was written or replaced: "
                         "fix the cause and run again, or give --workers 1") from None
    finally:
        if pool is not None:  # no worker writes any more: what is staged can go
            _stop(pool)
        shutil.rmtree(staging, ignore_errors=True)
        if created:  # an output directory made for a run that failed goes too (rmdir: only when empty)
            with contextlib.suppress(OSError):
                output_dir.rmdir()


_STAGING = ".staging-"


def _remove_stale_staging(output_dir: Path) -> None:
    """Remove staging directories that processes of this host killed mid-way left behind."""
    host = socket.gethostname()
    for path in output_dir.glob(f"{_STAGING}{host}-*"):
        pid = path.name.rpartition("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # alive (another user's process): not ours to remove


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the workers now, a shard half-written or not (their staged files are removed next)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # Python 3.14: terminate_workers()
        with contextlib.suppress(OSError):
            process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def _create(files, output_dir, staging, pool, workers, t0, *, vocab, vocab_size, options, overwrite, progress,
            held_out_fraction, format, shard_bytes, max_line_bytes) -> CreateResult:
    def run(function, items, ordered=True, chunksize=1):
        if pool is None:
            return map(function, items)
        if ordered:
            return pool.map(function, items, chunksize=chunksize)
        return (done.result() for done in as_completed([pool.submit(function, item) for item in items]))

    # Detecting a format reads 64 KB of a file: many files go to a worker at a time.
    plans: list[FilePlan] = list(run(_plan, [(str(f), format, shard_bytes, max_line_bytes) for f in files],
                                     chunksize=max(1, min(64, len(files) // (4 * workers)))))
    splits = [s for p in plans for s in p.splits]
    if progress:
        for line in describe(plans)[0]:
            print(line, flush=True)
    n = len(splits)
    if held_out_fraction:
        outputs = [output_dir / "train" / shard_name(i) for i in range(n)]
        eval_outputs = [output_dir / "eval" / shard_name(i) for i in range(n)]
    else:
        outputs, eval_outputs = [output_dir / shard_name(i) for i in range(n)], []
    vocab_out = output_dir / "vocab.txt"
    if not overwrite:
        existing = [p for p in outputs + eval_outputs if p.exists()]
        if vocab_size is not None and vocab_out.exists():
            existing.insert(0, vocab_out)
        if existing:
            raise ValueError(
                f"{existing[0]} already exists ({len(existing)} output file(s) would be replaced); "
                "pass --overwrite to replace them or choose another --output-dir"
            )
    stale = sorted({p for d in {o.parent for o in outputs + eval_outputs} if d.is_dir()
                    for p in d.glob("shard_*.hdf5")} - set(outputs + eval_outputs))
    if stale:
        _warn(f"{stale[0].parent} holds {len(stale)} shard(s) this run does not write ({stale[0].name}, ...) "
              "that a glob of the directory would mix in: remove them")
    def staged(path: Path) -> Path:  # where an output is written until the whole set is done
        return staging / path.relative_to(output_dir)

    for directory in {staged(p).parent for p in outputs + eval_outputs + [vocab_out]}:
        directory.mkdir(parents=True, exist_ok=True)
    if vocab_size is not None:
        corpus = (s for docs in run(_split_documents, splits) for doc in docs for s in doc)
        vocab_path = train_vocab(corpus, vocab_size, staged(vocab_out), lower_case=options.lower_case).path
    else:
        vocab_path = load_vocab(vocab).path  # validate before starting the workers

    # A held-out shard draws its pairs and masks from a stream of its own (index + splits).
    jobs = [ShardJob(index=i, held_out_index=i + n, split=s, output=str(staged(outputs[i])),
                     eval_output=str(staged(eval_outputs[i])) if eval_outputs else None, vocab_path=str(vocab_path),
                     options=options, held_out_fraction=held_out_fraction)
            for i, s in enumerate(splits)]
    results: dict[int, dict] = {}
    bar = tqdm(total=len(jobs), unit="shard", desc="create_pretraining_data", disable=not progress)
    try:
        for r in run(process_split, jobs, ordered=False):
            results[r["index"]] = r
            bar.update(1)
            bar.set_postfix(_bar_counts(results, held_out_fraction))
        if held_out_fraction and not any(r.get("eval_samples") for r in results.values()):
            # Too few documents for the fraction: hold out the one of lowest key (the same
            # document whatever the number of workers), so a small corpus still gets an eval shard.
            lowest = min((r for r in results.values() if r["lowest_key"] is not None),
                         key=lambda r: (r["lowest_key"], r["index"]), default=None)
            if lowest is not None:
                i = lowest["index"]
                results[i] = process_split(dataclasses.replace(jobs[i], hold_lowest=True))
                if jobs[i].output not in results[i]["outputs"]:  # its one document went to eval
                    Path(jobs[i].output).unlink(missing_ok=True)
                bar.set_postfix(_bar_counts(results, held_out_fraction))  # the counts the summary gives
    finally:
        bar.close()
    written = {o for r in results.values() for o in r["outputs"]}
    stats: dict[str, Stats] = defaultdict(Stats)
    tokens: dict[str, bool] = defaultdict(bool)
    for r in results.values():
        stats[r["path"]].add(r["stats"])
        tokens[r["path"]] |= r["tokens"]
    for p in plans:
        if not tokens[p.path]:
            raise ValueError(f"input file {p.path} yields no tokens (only white space or markup)")
    totals = _totals(results)
    summary, warnings = describe(plans, stats)
    if progress:
        for line in summary:
            print(line, flush=True)
    for w in warnings:
        _warn(w)
    if held_out_fraction and not totals["eval_samples"]:
        raise ValueError(f"--held-out-fraction {held_out_fraction} held out no document of {len(files)} input "
                         "file(s) that gives a sample: give more documents")
    if not any(str(staged(p)) in written for p in outputs):
        raise ValueError("no training sample is left after holding out documents: give more documents")
    shards = [p for p in outputs if str(staged(p)) in written]
    eval_shards = [p for p in eval_outputs if str(staged(p)) in written]
    for path in shards + eval_shards + ([vocab_out] if vocab_size is not None else []):  # the set is done
        path.parent.mkdir(exist_ok=True)
        publish(staged(path), path)
    return CreateResult(
        shards=shards, vocab_path=vocab_out if vocab_size is not None else Path(vocab_path),
        seconds=time.perf_counter() - t0, eval_shards=eval_shards,
        documents=totals["documents"], sentences=totals["sentences"], samples=totals["samples"],
        eval_documents=totals["eval_documents"], eval_samples=totals["eval_samples"],
        formats={p.path: p.format for p in plans}, summary=summary, warnings=warnings,
    )


def _totals(results: dict[int, dict]) -> dict[str, int]:
    """Documents, sentences and samples written, training side and held-out side (eval_*)."""
    return {k: sum(r.get(k, 0) for r in results.values())
            for k in ("documents", "sentences", "samples", "eval_documents", "eval_samples")}


def _bar_counts(results: dict[int, dict], held_out_fraction: float) -> dict[str, int]:
    """The progress bar's counts: the summary's (training samples and sentences, and the
    held-out samples when there are any), so the bar's last figures are the summary's."""
    totals = _totals(results)
    counts = {"samples": totals["samples"], "sentences": totals["sentences"]}
    if held_out_fraction:
        counts["held_out"] = totals["eval_samples"]
    return counts


def _warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _plan(args: tuple[str, str, int, int]) -> FilePlan:
    return plan_file(*args)


def _split_documents(split) -> list[list[str]]:
    return read_split(split)[0]


def _worker_init() -> None:
    # One shard per process already uses every core; tokenizers' own thread pool
    # on top would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="input files or globs")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                   help="input format (default auto: detected per file, see docs/data.md)")
    p.add_argument("--shard-size", default="16M",
                   help="text per shard: a larger file is cut at document starts into shards of about this "
                        "size, written in parallel (bytes, or with K, M, G; default 16M)")
    p.add_argument("--max-line-bytes", default="4M",
                   help="the longest line read (bytes, or with K, M, G; default 4M): a longer one is refused before "
                        "any work, naming its file and line (a file without line breaks, say)")
    p.add_argument("--output-dir", required=True)
    v = p.add_mutually_exclusive_group(required=True)
    v.add_argument("--vocab", help="WordPiece vocab.txt (must hold [PAD] [UNK] [CLS] [SEP] [MASK])")
    v.add_argument("--vocab-size", type=int, help="train a WordPiece vocab of this size on the input")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=1, help="maskings of each pair (static masking)")
    p.add_argument("--whole-word-masking", action="store_true")
    p.add_argument("--natural-lengths", action="store_true",
                   help="end samples where the text ends instead of filling them to --seq-len (for packing)")
    p.add_argument("--cased", action="store_true", help="keep case and accents (default: uncased)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 1)))
    p.add_argument("--overwrite", action="store_true", help="replace existing shards")
    p.add_argument("--held-out-fraction", type=float, default=0.0,
                   help="documents held out for evaluation, by a hash of their text: shards in "
                        "<output-dir>/eval/, the rest in <output-dir>/train/ (default 0: no split)")
    args = p.parse_args(argv)
    opts = CreateOptions(
        seq_len=args.seq_len, max_predictions=args.max_predictions, masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor,
        whole_word_masking=args.whole_word_masking, natural_lengths=args.natural_lengths,
        lower_case=not args.cased, seed=args.seed,
    )
    try:
        r = create_pretraining_data(
            args.input, args.output_dir, vocab=args.vocab, vocab_size=args.vocab_size, options=opts,
            workers=args.workers, overwrite=args.overwrite, held_out_fraction=args.held_out_fraction,
            format=args.format, shard_bytes=parse_size(args.shard_size),
            max_line_bytes=parse_size(args.max_line_bytes, "--max-line-bytes"),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The directory that holds the shards: <output-dir>/train and /eval with a held-out fraction.
    print(
        f"{r.samples} samples from {r.documents} documents / {r.sentences} sentences in "
        f"{len(r.shards)} shard(s) in {r.shards[0].parent} ({r.seconds:.1f} s, "
        f"{r.sentences / max(r.seconds, 1e-9):.0f} sentences/s); vocab {r.vocab_path}"
    )
    if r.eval_shards:
        print(f"held out: {r.eval_samples} samples from {r.eval_documents} documents in {len(r.eval_shards)} "
              f"shard(s) in {r.eval_shards[0].parent} (data.eval_files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
