"""WordPiece vocabularies: load and check a vocab.txt, train one, build the tokenizer.

The tokenizer itself is the HuggingFace `tokenizers` BertWordPiece pipeline (BERT's
basic tokenizer + greedy longest-match WordPiece); this module only validates the
vocabulary file and reads the special-token ids from it, so nothing downstream
hard-codes an id.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import BertWordPieceTokenizer
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from fileio import write_atomically

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class Vocab:
    """A validated vocab.txt: one token per line, the id is the line number."""

    path: Path
    tokens: tuple[str, ...]
    sha256: str

    @property
    def size(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self._index[token]

    @property
    def _index(self) -> dict[str, int]:
        # Cached on first use; frozen dataclass, so go through object.__setattr__.
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {t: i for i, t in enumerate(self.tokens)}
            object.__setattr__(self, "_index_cache", index)
        return index

    @property
    def pad_id(self) -> int:
        return self.id("[PAD]")

    @property
    def unk_id(self) -> int:
        return self.id("[UNK]")

    @property
    def cls_id(self) -> int:
        return self.id("[CLS]")

    @property
    def sep_id(self) -> int:
        return self.id("[SEP]")

    @property
    def mask_id(self) -> int:
        return self.id("[MASK]")

    @property
    def text(self) -> str:
        return "\n".join(self.tokens) + "\n"

    def continuation_flags(self) -> list[bool]:
        """True for WordPiece continuation pieces (`##x`), used by whole-word masking."""
        return [t.startswith("##") for t in self.tokens]


def is_control_token(token: str) -> bool:
    return len(token) > 2 and token.startswith("[") and token.endswith("]")


def load_vocab(path: str | Path) -> Vocab:
    """Read and validate a vocab.txt; errors name the file (and line)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"vocab file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"vocab file {path}, line {line}: not valid UTF-8 ({e.reason})") from None
    tokens = tuple(line.rstrip("\r") for line in text.split("\n"))
    if tokens and tokens[-1] == "":
        tokens = tokens[:-1]
    if not tokens:
        raise ValueError(f"vocab file {path} is empty")
    seen: dict[str, int] = {}
    for lineno, tok in enumerate(tokens, start=1):
        if tok == "":
            raise ValueError(f"vocab file {path}, line {lineno}: empty token")
        if tok in seen:
            raise ValueError(
                f"vocab file {path}, line {lineno}: token {tok!r} repeats line {seen[tok] + 1}"
            )
        seen[tok] = lineno - 1
    missing = [t for t in SPECIAL_TOKENS if t not in seen]
    if missing:
        raise ValueError(
            f"vocab file {path} lacks the special token(s) {', '.join(missing)}; a BERT vocab "
            f"needs all of {', '.join(SPECIAL_TOKENS)}"
        )
    return Vocab(path=path, tokens=tokens, sha256=hashlib.sha256(raw).hexdigest())


def train_vocab(
    texts: Iterable[str], vocab_size: int, output: str | Path, *, lower_case: bool = True,
    min_frequency: int = 2, limit_alphabet: int = 1000,
) -> Vocab:
    """Train a WordPiece vocab on `texts` (sentences) and write it to `output` (vocab.txt).

    The algorithm is the one HuggingFace's WordPiece trainer uses (BPE merges over
    word counts; a symbol inside a word carries the `##` prefix), written here
    because `tokenizers`' trainer breaks ties between equally frequent pairs in
    hash-map order, so its vocab changes from run to run. Here ties go to the
    lexicographically smaller pair, so a corpus always gives the same vocab. Text
    is normalised and split exactly as the tokenizer will (BERT normaliser and
    pre-tokenizer from `tokenizers`). If the merges run out before `vocab_size`, the
    rest is filled with `[unusedN]` tokens, so the vocab always has `vocab_size` entries.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"--vocab-size {vocab_size} is too small; it must exceed {len(SPECIAL_TOKENS)}")
    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lower_case,
                                lowercase=lower_case)
    pre = BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(text)))
    tokens = _wordpiece_merges(counts, vocab_size - len(SPECIAL_TOKENS), min_frequency, limit_alphabet)
    # When the merges run out first, fill up with BERT's [unusedN] placeholders so the
    # vocab (and the model's embedding) has exactly the size asked for.
    tokens += [f"[unused{i}]" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(tokens))]
    output = Path(output)
    write_atomically(output, "".join(t + "\n" for t in (*SPECIAL_TOKENS, *tokens)), replace=True)
    return load_vocab(output)


def _wordpiece_merges(counts: Counter[str], budget: int, min_frequency: int, limit_alphabet: int) -> list[str]:
    """Alphabet + merged symbols, at most `budget` tokens, deterministic."""
    char_counts: Counter[str] = Counter()
    for word, n in counts.items():
        for ch in word:
            char_counts[ch] += n
    alphabet = {c for c, _ in sorted(char_counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit_alphabet]}
    words: list[list[str]] = []
    freqs: list[int] = []
    for word, n in sorted(counts.items()):
        if all(ch in alphabet for ch in word):
            words.append([word[0]] + ["##" + ch for ch in word[1:]])
            freqs.append(n)
    initial = sorted({sym for w in words for sym in w})
    vocab = initial[:budget]
    known = set(vocab)
    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_count[pair] += freqs[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-n, pair) for pair, n in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < budget and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry; the current count was pushed again
        if -neg < min_frequency:
            break
        a, b = pair
        merged = a + b[2:]
        if merged not in known:
            known.add(merged)
            vocab.append(merged)
        changed: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, ())):
            w, n = words[i], freqs[i]
            for old in zip(w, w[1:]):
                pair_count[old] -= n
                changed.add(old)
            j, out = 0, []
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for new in zip(out, out[1:]):
                pair_count[new] += n
                where.setdefault(new, set()).add(i)
                changed.add(new)
        pair_count.pop(pair, None)
        for c in changed:
            n = pair_count.get(c, 0)
            if n > 0:
                heapq.heappush(heap, (-n, c))
            else:
                pair_count.pop(c, None)
    return vocab


def make_tokenizer(vocab: Vocab | str | Path, *, lower_case: bool = True) -> BertWordPieceTokenizer:
    """The BERT WordPiece tokenizer for `vocab` (lower-casing and accent stripping when uncased)."""
    if not isinstance(vocab, Vocab):
        vocab = load_vocab(vocab)
    return BertWordPieceTokenizer(
        str(vocab.path), lowercase=lower_case, strip_accents=lower_case,
        unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]",
        mask_token="[MASK]",
    )
