"""Corpus → MLM/NSP samples → HDF5 shards.

The pair construction follows BERT's recipe (Devlin et al. 2019, appendix A.2;
google-research/bert `create_instances_from_document`), written afresh:

* a document's sentences are gathered into a chunk until it reaches a target length
  (`seq_len - 3`, or with probability `short_seq_prob` a random length from 2, so the
  model also sees short inputs);
* the chunk is cut at a random sentence boundary into A and B; with probability 0.5
  B is replaced by text from a random other document (label 1 = random), and the
  sentences not used are given back to be used by the next chunk;
* one difference: when a chunk holds a single sentence and the draw says "is next",
  that sentence is cut at a random token instead of turning the pair into a random
  one, so the NSP labels stay balanced at 50/50;
* the pair is trimmed to fit, one token at a time from the longer side, from its
  front or back at random.

With `natural_lengths` a sample ends where the text does instead of being filled up
to `seq_len - 3`, so the lengths follow the documents and packing has padding to
remove (docs/data.md): a document that fits is one chunk; a longer one is cut at
sentence boundaries into the fewest chunks that fit, of about equal length; a random
B is as long as the B it replaces; `short_seq_prob` is not used.

An input file is cut into splits of about `--shard-size` bytes at document starts
(data/corpus.py); each split is processed independently, with a random stream seeded
by `(seed, index of the split in the corpus)`, into one shard, so the output is the
same for any number of workers.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from fileio import staged

from data.corpus import Split, read_split
from data.masking import MaskingSpec, mask_rows
from data.vocab import Vocab, is_control_token, load_vocab, make_tokenizer

FORMAT_VERSION = 1
SAMPLE_KEYS = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
# NVIDIA's BERT shards use these dtypes; the loader widens to int64.
_DTYPES = {
    "input_ids": "i4",
    "input_mask": "i1",
    "segment_ids": "i1",
    "masked_lm_positions": "i4",
    "masked_lm_ids": "i4",
    "next_sentence_labels": "i1",
}
CHUNK_ROWS = 256


@dataclass(frozen=True)
class CreateOptions:
    seq_len: int = 128
    max_predictions: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 1
    whole_word_masking: bool = False
    natural_lengths: bool = False
    lower_case: bool = True
    seed: int = 0
    compression_level: int = 4

    def check(self) -> None:
        if self.seq_len < 8:
            raise ValueError(f"seq_len must be at least 8, got {self.seq_len}")
        if not 1 <= self.max_predictions <= self.seq_len:
            raise ValueError(f"max_predictions must be in [1, seq_len], got {self.max_predictions}")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if self.dupe_factor < 1:
            raise ValueError(f"dupe_factor must be at least 1, got {self.dupe_factor}")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.hdf5"


def masking_spec(vocab: Vocab, opts: CreateOptions) -> MaskingSpec:
    flags = [not is_control_token(t) for t in vocab.tokens]
    cont = np.array(vocab.continuation_flags(), dtype=bool) if opts.whole_word_masking else None
    return MaskingSpec(
        masked_lm_prob=opts.masked_lm_prob,
        max_predictions=opts.max_predictions,
        mask_id=vocab.mask_id,
        cls_id=vocab.cls_id,
        sep_id=vocab.sep_id,
        random_ids=np.flatnonzero(flags),
        continuation=cont,
        unk_id=vocab.unk_id,
    )


# --------------------------------------------------------------------------- pairs


def _trim_pair(a: list[int], b: list[int], limit: int, rnd: random.Random) -> None:
    while len(a) + len(b) > limit:
        longer = a if len(a) > len(b) else b
        if rnd.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _random_segment(
    docs: list[list[list[int]]], doc_index: int, target: int, rnd: random.Random
) -> list[int]:
    """Tokens from a random other document, starting at a random sentence."""
    other = doc_index
    if len(docs) > 1:
        while other == doc_index:
            other = rnd.randrange(len(docs))
    doc = docs[other]
    out: list[int] = []
    for sent in doc[rnd.randrange(len(doc)) :]:
        out.extend(sent)
        if len(out) >= target:
            break
    return out


def _even_target(tokens_after: list[int], start: int, max_tokens: int) -> int:
    """Natural lengths: the length of the next chunk when the rest of a document, from
    sentence `start` on (`tokens_after[start]` tokens), is cut into the fewest chunks of
    at most `max_tokens`, of about equal length."""
    rest = tokens_after[start]
    pieces = max(1, -(-rest // max_tokens))
    return max(1, -(-rest // pieces))


def create_pairs(
    docs: list[list[list[int]]], seq_len: int, short_seq_prob: float, rnd: random.Random,
    natural_lengths: bool = False,
) -> list[tuple[list[int], list[int], int]]:
    """(tokens_a, tokens_b, next_sentence_label) for every chunk of every document."""
    max_tokens = seq_len - 3  # [CLS] A [SEP] B [SEP]
    pairs = []
    for d, doc in enumerate(docs):
        tokens_after = [0] * (len(doc) + 1)  # tokens from sentence i to the document's end
        for i in reversed(range(len(doc))):
            tokens_after[i] = tokens_after[i + 1] + len(doc[i])
        if natural_lengths:
            target = _even_target(tokens_after, 0, max_tokens)
        else:
            target = max_tokens
            if rnd.random() < short_seq_prob:
                target = rnd.randint(2, max_tokens)
        chunk: list[list[int]] = []
        length = 0
        i = 0
        while i < len(doc):
            chunk.append(doc[i])
            length += len(doc[i])
            if i == len(doc) - 1 or length >= target:
                is_random = rnd.random() < 0.5
                if len(chunk) == 1 and not is_random:
                    sent = chunk[0]
                    if len(sent) < 2:
                        is_random = True
                    else:
                        cut = rnd.randint(1, len(sent) - 1)
                        a, b = list(sent[:cut]), list(sent[cut:])
                if len(chunk) > 1 or is_random:
                    a_end = 1 if len(chunk) == 1 else rnd.randint(1, len(chunk) - 1)
                    a = [t for s in chunk[:a_end] for t in s]
                    if is_random:
                        b = _random_segment(docs, d, max(1, target - len(a)), rnd)
                        i -= len(chunk) - a_end  # give the unused sentences back
                    else:
                        b = [t for s in chunk[a_end:] for t in s]
                limit = max_tokens
                if natural_lengths and is_random:  # a random B as long as the one it replaces
                    limit = min(max_tokens, max(target, len(a) + 1))
                _trim_pair(a, b, limit, rnd)
                if a and b:
                    pairs.append((a, b, int(is_random)))
                chunk, length = [], 0
                if natural_lengths:
                    target = _even_target(tokens_after, i + 1, max_tokens)
                else:
                    target = max_tokens
                    if rnd.random() < short_seq_prob:
                        target = rnd.randint(2, max_tokens)
            i += 1
    return pairs


def pack_pairs(
    pairs: Sequence[tuple[list[int], list[int], int]], seq_len: int, cls_id: int, sep_id: int
) -> dict[str, np.ndarray]:
    """Unmasked rows [CLS] A [SEP] B [SEP] + padding (pad id 0 is written as 0 below)."""
    n = len(pairs)
    tokens = np.zeros((n, seq_len), np.int32)
    input_mask = np.zeros((n, seq_len), np.int8)
    segment_ids = np.zeros((n, seq_len), np.int8)
    nsp = np.zeros((n,), np.int8)
    for r, (a, b, label) in enumerate(pairs):
        row = [cls_id, *a, sep_id, *b, sep_id]
        tokens[r, : len(row)] = row
        input_mask[r, : len(row)] = 1
        segment_ids[r, len(a) + 2 : len(row)] = 1
        nsp[r] = label
    return {"tokens": tokens, "input_mask": input_mask, "segment_ids": segment_ids, "nsp": nsp}


# --------------------------------------------------------------------------- files


def tokenize_documents(tokenizer, docs: list[list[str]]) -> list[list[list[int]]]:
    flat = [s for doc in docs for s in doc]
    encodings = tokenizer.encode_batch(flat, add_special_tokens=False)
    out: list[list[list[int]]] = []
    k = 0
    for doc in docs:
        sents = [encodings[k + j].ids for j in range(len(doc))]
        k += len(doc)
        sents = [s for s in sents if s]
        if sents:
            out.append(sents)
    return out


def make_samples(
    docs: list[list[list[int]]], vocab: Vocab, opts: CreateOptions, file_index: int
) -> dict[str, np.ndarray]:
    """All samples (dupe_factor maskings) of one tokenised file, as NVIDIA-layout arrays."""
    rnd = random.Random(f"pairs-{opts.seed}-{file_index}")
    rng = np.random.default_rng([opts.seed, file_index])
    spec = masking_spec(vocab, opts)
    parts = []
    for _ in range(opts.dupe_factor):
        pairs = create_pairs(docs, opts.seq_len, opts.short_seq_prob, rnd, opts.natural_lengths)
        rows = pack_pairs(pairs, opts.seq_len, vocab.cls_id, vocab.sep_id)
        if vocab.pad_id != 0:
            rows["tokens"][rows["input_mask"] == 0] = vocab.pad_id
        ids, pos, lm_ids = mask_rows(rows["tokens"], rows["input_mask"], spec, rng)
        parts.append(
            {
                "input_ids": ids,
                "input_mask": rows["input_mask"],
                "segment_ids": rows["segment_ids"],
                "masked_lm_positions": pos,
                "masked_lm_ids": lm_ids,
                "next_sentence_labels": rows["nsp"],
            }
        )
    return {k: np.concatenate([p[k] for p in parts]).astype(_DTYPES[k]) for k in SAMPLE_KEYS}


def write_shard(path: Path, samples: dict[str, np.ndarray], attrs: dict, vocab_text: str, level: int) -> None:
    """Write a shard atomically (fileio).

    The HDF5 file is built in memory (the core driver, no backing store) and written by
    Python: HDF5 that meets a full disk half-way through its own writes raises a dozen
    errors and can crash the process when the file is closed, whereas Python's write
    raises one OSError, given here with the shard's path. The image is smaller than the
    samples it compresses, which are in memory already."""
    n = len(samples["input_ids"])
    with h5py.File(path.name, "w", driver="core", backing_store=False) as f:
        for key in SAMPLE_KEYS:
            arr = samples[key]
            chunks = (min(max(n, 1), CHUNK_ROWS),) + arr.shape[1:]
            f.create_dataset(
                key, data=arr, dtype=_DTYPES[key], chunks=chunks if n else None,
                compression="gzip" if n else None, compression_opts=level if n else None,
                shuffle=bool(n),
            )
        f.create_dataset("vocab", data=vocab_text, dtype=h5py.string_dtype("utf-8"))
        for k, v in attrs.items():
            f.attrs[k] = v
        f.flush()
        image = f.id.get_file_image()
    try:
        with staged(path, replace=True) as tmp:
            tmp.write_bytes(image)
    except OSError as e:  # a full disk, a file size limit, ...: name the shard, not a temporary
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def shard_attrs(vocab: Vocab, opts: CreateOptions, source: str, n: int) -> dict:
    d = asdict(opts)
    d.pop("compression_level")
    return {
        "format_version": FORMAT_VERSION,
        "created_by": "groupbert data/create_pretraining_data.py",
        "source": source,
        "num_samples": n,
        "vocab_file": vocab.path.name,
        "vocab_size": vocab.size,
        "vocab_sha256": vocab.sha256,
        "pad_id": vocab.pad_id,
        "unk_id": vocab.unk_id,
        "cls_id": vocab.cls_id,
        "sep_id": vocab.sep_id,
        "mask_id": vocab.mask_id,
        **d,
    }


def held_out_key(document: list[str], seed: int) -> int:
    """A hash of a document's text (and the seed) in [0, 2**64): the same on every run and
    machine, and the same for a document that occurs twice."""
    digest = hashlib.blake2b("\n".join(document).encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little")


def is_held_out(document: list[str], fraction: float, seed: int) -> bool:
    """Whether a document belongs to the held-out part: its key below `fraction` of the
    range, so the split is by document and a repeated document lands on one side."""
    return held_out_key(document, seed) < fraction * 2**64


@dataclass(frozen=True)
class ShardJob:
    """One worker's job: the documents of one split of an input file → a shard (and, with a
    held-out fraction, the held-out documents → a shard of their own)."""

    index: int  # of the split in the corpus: seeds its random stream
    held_out_index: int  # seeds the held-out shard's stream
    split: Split
    output: str
    eval_output: Optional[str]  # None: no held-out part
    vocab_path: str
    options: CreateOptions
    held_out_fraction: float = 0.0
    hold_lowest: bool = False  # hold out the document of lowest key even if it is above the fraction


def process_split(job: ShardJob) -> dict:
    """Worker: read, tokenise, pair, mask and write one split. Returns counts and what
    the reader saw; a side with no document writes no shard."""
    vocab = load_vocab(job.vocab_path)
    tokenizer = make_tokenizer(vocab, lower_case=job.options.lower_case)
    docs_text, stats = read_split(job.split)
    sides = [(docs_text, job.output, job.index)]
    keys = [held_out_key(d, job.options.seed) for d in docs_text]
    if job.eval_output is not None:
        held = [k < job.held_out_fraction * 2**64 for k in keys]
        if job.hold_lowest and keys:
            held[keys.index(min(keys))] = True
        sides = [([d for d, h in zip(docs_text, held) if not h], job.output, job.index),
                 ([d for d, h in zip(docs_text, held) if h], job.eval_output, job.held_out_index)]
    result = {"index": job.index, "path": job.split.path, "stats": stats, "outputs": [], "tokens": False,
              "lowest_key": min(keys, default=None)}
    for side, (docs_text, output, index) in zip(("", "eval_"), sides):
        docs = tokenize_documents(tokenizer, docs_text)
        result[f"{side}documents"] = len(docs_text)
        result[f"{side}sentences"] = sum(len(d) for d in docs_text)
        result[f"{side}samples"] = 0
        result["tokens"] |= bool(docs)
        if not docs:
            continue
        samples = make_samples(docs, vocab, job.options, index)
        n = len(samples["input_ids"])
        attrs = shard_attrs(vocab, job.options, job.split.path, n)
        attrs["source_bytes"] = np.array([job.split.start, job.split.end], np.int64)
        write_shard(Path(output), samples, attrs, vocab.text, job.options.compression_level)
        result["outputs"].append(output)
        result[f"{side}samples"] = n
    return result
