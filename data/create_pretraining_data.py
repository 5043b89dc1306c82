"""Create BERT pre-training shards (MLM + NSP) from raw text.

    python data/create_pretraining_data.py --input 'corpus/*.txt' --output-dir shards
        --vocab vocab.txt --seq-len 128 --max-predictions 20 --dupe-factor 5
    python -m data.create_pretraining_data ...   (same)

Input: one sentence per line with blank lines between documents, or WikiExtractor
output. One HDF5 shard (`shard_00000.hdf5`, ...) is written per input file, in the
sorted order of the inputs, in parallel over files (`--workers`). With `--vocab-size`
instead of `--vocab`, a WordPiece vocab is first trained on the corpus and written to
`<output-dir>/vocab.txt`. Existing outputs are only replaced with `--overwrite`.

`--held-out-fraction F` splits off about that fraction of the documents, chosen by a
hash of each document's text (so the same on every run, and a repeated document never
straddles the split): their shards go to `<output-dir>/eval/`, the rest to
`<output-dir>/train/`; point `data.files` and `data.eval_files` at them. A file with no
document on one side writes no shard there.
See docs/data.md for the format.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from data.corpus import expand_inputs, read_documents
from data.pretraining import CreateOptions, Part, process_file, shard_name
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
) -> CreateResult:
    """Library entry point of the CLI; see the module docstring."""
    t0 = time.perf_counter()
    options.check()
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"--held-out-fraction must be in [0, 1), got {held_out_fraction}")
    if (vocab is None) == (vocab_size is None):
        raise ValueError("give exactly one of --vocab (a vocab.txt) or --vocab-size (train one)")
    files = expand_inputs(inputs)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output-dir {output_dir} is a file, not a directory; name a directory for the shards")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, ...
        raise ValueError(f"--output-dir {output_dir} cannot be created ({e.strerror})") from None
    if held_out_fraction:
        outputs = [output_dir / "train" / shard_name(i) for i in range(len(files))]
        eval_outputs = [output_dir / "eval" / shard_name(i) for i in range(len(files))]
        parts = [Part(held_out=False, fraction=held_out_fraction)] * len(files)
        parts += [Part(held_out=True, fraction=held_out_fraction)] * len(files)
    else:
        outputs, eval_outputs, parts = [output_dir / shard_name(i) for i in range(len(files))], [], [None] * len(files)
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
    if vocab_size is not None:
        vocab_path = train_vocab(
            _corpus_sentences(files), vocab_size, vocab_out, lower_case=options.lower_case
        ).path
    else:
        vocab_path = load_vocab(vocab).path  # validate before starting the workers

    for directory in {p.parent for p in outputs + eval_outputs}:
        directory.mkdir(exist_ok=True)
    # A held-out shard draws its pairs and masks from a stream of its own (index + files).
    jobs = [(i, str(files[i % len(files)]), str(o), str(vocab_path), options, part)
            for i, (o, part) in enumerate(zip(outputs + eval_outputs, parts))]
    totals = {"documents": 0, "sentences": 0, "samples": 0}
    held = {"eval_documents": 0, "eval_samples": 0}
    written: list[str] = []
    bar = tqdm(total=len(jobs), unit="file", desc="create_pretraining_data", disable=not progress)
    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        results = map(process_file, jobs)
        pool = None
    else:
        # spawn: the parent may hold tokenizers' thread pool, which does not survive fork.
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init)
        results = pool.imap_unordered(process_file, jobs)
    try:
        for r in results:
            if r["output"] is not None:
                written.append(r["output"])
            if r["held_out"]:
                held["eval_documents"] += r["documents"]
                held["eval_samples"] += r["samples"]
            else:
                for k in totals:
                    totals[k] += r[k]
            bar.update(1)
            bar.set_postfix(samples=totals["samples"], sentences=totals["sentences"])
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    if held_out_fraction and not any(str(p) in written for p in eval_outputs):
        raise ValueError(f"--held-out-fraction {held_out_fraction} held out no document of {len(files)} input "
                         "file(s): raise the fraction or give more documents")
    return CreateResult(
        shards=[p for p in outputs if str(p) in written or not held_out_fraction], vocab_path=Path(vocab_path),
        seconds=time.perf_counter() - t0, eval_shards=[p for p in eval_outputs if str(p) in written], **totals, **held,
    )


def _worker_init() -> None:
    # One file per process already uses every core; tokenizers' own thread pool
    # on top would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _corpus_sentences(files: Sequence[Path]):
    for f in files:
        for doc in read_documents(f):
            yield from doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="input files or globs")
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
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{r.samples} samples from {r.documents} documents / {r.sentences} sentences in "
        f"{len(r.shards)} shard(s) under {args.output_dir} ({r.seconds:.1f} s, "
        f"{r.sentences / max(r.seconds, 1e-9):.0f} sentences/s); vocab {r.vocab_path}"
    )
    if r.eval_shards:
        print(f"held out: {r.eval_samples} samples from {r.eval_documents} documents in {len(r.eval_shards)} "
              f"shard(s) under {Path(args.output_dir) / 'eval'} (data.eval_files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
