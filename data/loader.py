"""PretrainingLoader: an infinite, shuffled, replica-sharded, resumable batch stream.

Order of samples in epoch `e` (every replica computes the same plan, from indices
alone, without reading data):

1. Every shard is cut into blocks of consecutive rows (`block_rows` rounded up to
   whole HDF5 chunks, so a block is one cheap read). The blocks of all shards are permuted with
   `rng(seed, e)`.
2. Consecutive blocks of that order form windows of about `shuffle_buffer` samples;
   a window's samples are permuted with `rng(seed, e, window)` (then masked and
   packed as configured). Concatenated, the windows give the epoch's global stream of
   rows, the same whatever the number of replicas.
3. The stream is cut into global batches of `batch_size × replica_count` rows, and
   replica r of R takes rows `[r·batch_size, (r+1)·batch_size)` of each: the replicas'
   batches are disjoint, together they hold every row of the epoch once (with
   `drop_last`, but the last partial global batch), and R replicas of `batch_size`
   see exactly the rows one process sees with batches of `R·batch_size`. Every replica
   reads every window (R times the reads of one process: pre-training reads a few KB
   per sample, far below what its compute takes).

A position in the stream is `(epoch, window, row offset)` in the global stream:
`state_dict()` records the position after the last batch handed out, and
`load_state_dict` regenerates that window and skips to the offset, so a resumed run
continues with exactly the rows an uninterrupted run would have produced, with the
same or another number of replicas. A background thread reads, masks, packs and
collates `prefetch` batches ahead.

Dynamic masking puts the stored `masked_lm_ids` back and masks again with
`rng(seed, e, window)` (data.masking, the same rule as create_pretraining_data), so
each epoch sees new masks.

[UNK] is never a masked-LM target (data.masking). Shards masked before that rule hold
[UNK] targets: their slots are dropped as rows are read (`drop_targets`: the token stays
masked, unscored), and a verbose loader says so once. `target_counts` holds how often
each token id below the model's vocab size is a scored target of the shards, counted as
they are opened.

Packing (`packing=True`) puts up to `max_sequences_per_pack` samples in a row,
best-fit decreasing by length within each window (data/packing.py); the graph of
`model.packed: true` consumes the rows (docs/packing.md). Extra keys: `sequence_index`
(1, 2, ... per packed sequence, 0 on padding), `position_ids` (restarting at 0 for
each sequence), `nsp_positions` (B, K) (the [CLS] of each sequence). With packing
`next_sentence_labels` is (B, K), -100 in unused slots (ignored like
torch's `ignore_index`), and `max_predictions` grows to P + K (a row's masks are
the sum of its sequences' masks); unused MLM slots are position 0, id 0 as always.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import h5py
import numpy as np
import torch

from data.corpus import expand_inputs
from data.masking import MaskingSpec, drop_targets, mask_rows, unmask_rows
from data.packing import IGNORE_INDEX, PackLayout, best_fit_decreasing, ranges
from data.pretraining import SAMPLE_KEYS
from data.shards import ShardInfo, check_samples, counted_vocab, inspect_shard, read_vocab_text, scored_target_counts
from data.vocab import is_control_token

STATE_VERSION = 1


class PretrainingLoader:
    """Batches of pre-training samples from HDF5 shards; iterate for an endless stream.

    Opening checks every row of every shard once (`data.shards.check_samples`): token
    ids and masked_lm_ids against `model_vocab_size` (the model's vocab; the shards'
    own `vocab_size` attribute when None), positions, masks and labels.
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        batch_size: int,
        *,
        seed: int = 0,
        replica_rank: int = 0,
        replica_count: int = 1,
        shuffle_buffer: int = 16384,
        prefetch: int = 8,
        dynamic_masking: bool = False,
        packing: bool = False,
        max_sequences_per_pack: int = 3,
        drop_last: bool = True,
        block_rows: int = 256,
        verbose: bool = True,
        model_vocab_size: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= replica_rank < replica_count:
            raise ValueError(f"replica_rank {replica_rank} is outside [0, replica_count={replica_count})")
        if shuffle_buffer < 1 or prefetch < 0:
            raise ValueError("shuffle_buffer must be >= 1 and prefetch >= 0")
        if isinstance(files, (str, Path)):
            files = [files]
        # A directory stands for the shards in it.
        files = [sorted(Path(f).glob("*.hdf5")) or [f] if Path(f).is_dir() else [f] for f in files]
        paths = expand_inputs([f for group in files for f in group])
        self._shards: list[ShardInfo] = [inspect_shard(p) for p in paths]
        first = self._shards[0]
        for s in self._shards[1:]:
            for key in ("seq_len", "max_predictions"):
                if getattr(s, key) != getattr(first, key):
                    raise ValueError(
                        f"shard {s.path} has {key}={getattr(s, key)} but {first.path} has "
                        f"{getattr(first, key)}; a loader needs shards of one shape"
                    )
            if s.attrs.get("vocab_sha256") != first.attrs.get("vocab_sha256"):
                raise ValueError(f"shard {s.path} was made with a different vocab than {first.path}")
        # Every row once, before the first batch: bad data stops here, never mid-run.
        for s in self._shards:
            check_samples(s, model_vocab_size)
        self.target_counts, self.unk_targets = scored_target_counts(
            self._shards, model_vocab_size or counted_vocab(first))
        self.unk_id = first.attrs["unk_id"] if self.unk_targets else None
        if self.unk_targets and verbose:
            print(unk_note(self.unk_targets, int(self.target_counts.sum()), len(self._shards)), flush=True)
        self.batch_size = batch_size
        self.seed = seed
        self.replica_rank = replica_rank
        self.replica_count = replica_count
        self.prefetch = prefetch
        self.dynamic_masking = dynamic_masking
        self.packing = packing
        self.max_sequences_per_pack = max_sequences_per_pack
        self.drop_last = drop_last
        self.verbose = verbose

        # Blocks: (shard index, first row, end row) and their sizes.
        blocks = [
            (i, a, min(a + s.block_rows(block_rows), s.num_samples))
            for i, s in enumerate(self._shards)
            for a in range(0, s.num_samples, s.block_rows(block_rows))
        ]
        self._blocks = np.array(blocks, dtype=np.int64).reshape(-1, 3)
        self._block_sizes = self._blocks[:, 2] - self._blocks[:, 1]
        self.num_samples = int(self._block_sizes.sum())
        if drop_last and not packing and self.num_samples < batch_size * replica_count:
            raise ValueError(
                f"the shards hold {self.num_samples} samples, fewer than one global batch of {batch_size} × "
                f"{replica_count} replica(s); with drop_last no batch would ever be produced"
            )
        mean_block = max(1, int(self._block_sizes.mean()))
        self._blocks_per_window = max(1, -(-shuffle_buffer // mean_block))
        self.shuffle_buffer = shuffle_buffer
        self.block_rows = block_rows

        self._spec: MaskingSpec | None = None
        if dynamic_masking:
            self._spec = self._masking_spec()
        self._files: OrderedDict[int, tuple[h5py.File, dict]] = OrderedDict()
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._position = {"epoch": 0, "window": 0, "offset": 0, "batches": 0}
        self._worker: _Prefetcher | None = None
        self._packing_report_done = False
        self._packed_rows = 0
        self._packed_sequences = 0
        self._packed_tokens = 0

    # ------------------------------------------------------------------ properties

    @property
    def seq_len(self) -> int:
        return self._shards[0].seq_len

    @property
    def max_predictions(self) -> int:
        p = self._shards[0].max_predictions
        return min(self.seq_len, p + self.max_sequences_per_pack) if self.packing else p

    @property
    def vocab_size(self) -> int | None:
        v = self._shards[0].attrs.get("vocab_size")
        return None if v is None else int(v)

    @property
    def epoch(self) -> int:
        return self._position["epoch"]

    @property
    def global_batch(self) -> int:
        """Rows of one step over all replicas."""
        return self.batch_size * self.replica_count

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches per replica and epoch; None with packing (depends on the data)."""
        if self.packing:
            return None
        n = self.num_samples
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    @property
    def packing_efficiency(self) -> float | None:
        """Fraction of real tokens in the packed rows produced so far."""
        if not self._packed_rows:
            return None
        return self._packed_tokens / (self._packed_rows * self.seq_len)

    @property
    def sequences_per_row(self) -> float | None:
        """Mean sequences per packed row produced so far."""
        return self._packed_sequences / self._packed_rows if self._packed_rows else None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            **self._position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "replica_rank": self.replica_rank,
            "replica_count": self.replica_count,
            "num_samples": self.num_samples,
            "num_shards": len(self._shards),
            "shuffle_buffer": self.shuffle_buffer,
            "block_rows": self.block_rows,
            "dynamic_masking": self.dynamic_masking,
            "packing": self.packing,
            "max_sequences_per_pack": self.max_sequences_per_pack,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position; the batch size and replica count may differ from the ones
        that wrote it (a position is a place in the global stream of rows)."""
        mine = self.state_dict()
        for key in ("version", "seed", "num_samples", "num_shards", "shuffle_buffer", "block_rows",
                    "dynamic_masking", "packing", "max_sequences_per_pack"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {mine[key]!r}; "
                    "a position can only be restored into a loader over the same data and settings"
                )
        self._stop_worker()
        self._position = {k: int(state[k]) for k in ("epoch", "window", "offset", "batches")}

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._stop_worker()  # one live stream per loader: a new iter() supersedes the old one
        stream = self._batches(dict(self._position))
        worker = None
        if self.prefetch > 0:
            worker = _Prefetcher(stream, self.prefetch)
            self._worker = worker
            stream = iter(worker)
        try:
            for batch, position in stream:
                self._position = position
                yield batch
        finally:  # the caller stopped iterating (break, exception, iterator dropped)
            if worker is not None:
                worker.stop()
                if self._worker is worker:
                    self._worker = None

    def close(self) -> None:
        self._stop_worker()
        for f, _ in self._files.values():
            f.close()
        self._files.clear()

    def __del__(self) -> None:
        try:
            self._stop_worker()
        except Exception:
            pass

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    # ------------------------------------------------------------------ plan

    def _block_order(self, epoch: int) -> np.ndarray:
        cached = self._order_cache
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self._blocks)))
            self._order_cache = cached
        return cached[1]

    def _plan(self, epoch: int) -> list[tuple[int, int, int]]:
        """The windows of `epoch`: (window id, first, end) into the window's order (all of it)."""
        order = self._block_order(epoch)
        k = self._blocks_per_window
        window_sizes = np.add.reduceat(self._block_sizes[order], np.arange(0, len(order), k))
        return [(w, 0, int(size)) for w, size in enumerate(window_sizes)]

    def _window_rows(self, epoch: int, window: int, first: int, end: int) -> dict[str, np.ndarray]:
        """Rows `first:end` of window `window`'s shuffled order, masked/packed as configured."""
        order = self._block_order(epoch)
        k = self._blocks_per_window
        blocks = self._blocks[order[window * k : (window + 1) * k]]
        size = int((blocks[:, 2] - blocks[:, 1]).sum())
        perm = np.random.default_rng([self.seed, epoch, 1, window]).permutation(size)[first:end]
        # Read only the blocks that hold a selected row.
        block_start = np.concatenate([[0], np.cumsum(blocks[:, 2] - blocks[:, 1])])
        which = np.searchsorted(block_start, perm, side="right") - 1
        needed = np.unique(which)
        parts: dict[str, list[np.ndarray]] = {key: [] for key in SAMPLE_KEYS}
        local_start = {}
        offset = 0
        for b in needed:
            shard, a, e = (int(x) for x in blocks[b])
            data = self._read(shard, a, e)
            for key in SAMPLE_KEYS:
                parts[key].append(data[key])
            local_start[int(b)] = offset
            offset += e - a
        remap = np.array([local_start.get(int(b), 0) for b in range(len(blocks))], np.int64)
        idx = remap[which] + (perm - block_start[which])
        rows = {key: np.concatenate(parts[key])[idx] for key in SAMPLE_KEYS}
        if self.unk_targets and self._spec is None:  # dynamic masking restores them, then never masks [UNK]
            rows["masked_lm_positions"], rows["masked_lm_ids"] = drop_targets(
                rows["masked_lm_positions"], rows["masked_lm_ids"], self.unk_id)
        if self._spec is not None:
            tokens = unmask_rows(rows["input_ids"], rows["masked_lm_positions"], rows["masked_lm_ids"])
            rng = np.random.default_rng([self.seed, epoch, 2, window, first])
            ids, pos, lm = mask_rows(tokens, rows["input_mask"], self._spec, rng)
            rows["input_ids"], rows["masked_lm_positions"], rows["masked_lm_ids"] = ids, pos, lm
        if self.packing:
            rows = self._pack(rows, np.random.default_rng([self.seed, epoch, 3, window, first]))
        return rows

    def _read(self, shard: int, a: int, e: int) -> dict[str, np.ndarray]:
        entry = self._files.get(shard)
        path = self._shards[shard].path
        if entry is None:
            try:
                f = h5py.File(path, "r")
                entry = (f, {key: f[key] for key in SAMPLE_KEYS})
            except (OSError, KeyError) as err:
                raise ValueError(f"shard {path}: cannot be opened ({err})") from None
            self._files[shard] = entry
            if len(self._files) > 64:  # bound the open file handles
                self._files.popitem(last=False)[1][0].close()
        else:
            self._files.move_to_end(shard)
        try:
            return {key: ds[a:e] for key, ds in entry[1].items()}
        except (OSError, RuntimeError, ValueError) as err:
            raise ValueError(f"shard {path}: rows {a}:{e} cannot be read, corrupt or truncated ({err})") from None

    def _masking_spec(self) -> MaskingSpec:
        attrs = self._shards[0].attrs
        need = ("mask_id", "cls_id", "sep_id", "masked_lm_prob")
        missing = [k for k in need if k not in attrs]
        vocab_text = read_vocab_text(self._shards[0].path)
        if missing or vocab_text is None:
            raise ValueError(
                f"shard {self._shards[0].path} lacks the vocab information dynamic masking needs "
                f"({', '.join(missing) or 'vocab'}); create shards with data/create_pretraining_data.py "
                "or turn dynamic_masking off"
            )
        tokens = vocab_text.rstrip("\n").split("\n")
        random_ids = np.array([i for i, t in enumerate(tokens) if not is_control_token(t)], np.int64)
        cont = None
        if attrs.get("whole_word_masking"):
            cont = np.array([t.startswith("##") for t in tokens], bool)
        return MaskingSpec(
            masked_lm_prob=float(attrs["masked_lm_prob"]),
            max_predictions=self._shards[0].max_predictions,
            mask_id=int(attrs["mask_id"]), cls_id=int(attrs["cls_id"]), sep_id=int(attrs["sep_id"]),
            random_ids=random_ids, continuation=cont,
            unk_id=None if attrs.get("unk_id") is None else int(attrs["unk_id"]),
        )

    # ------------------------------------------------------------------ packing

    def _pack(self, rows: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        s, k = self.seq_len, self.max_sequences_per_pack
        p_pack = self.max_predictions
        lengths = rows["input_mask"].astype(np.int64).sum(axis=1)
        n_masks = (rows["masked_lm_positions"] != 0).sum(axis=1)
        packs = best_fit_decreasing(lengths, s, k, n_masks, p_pack)
        layout = PackLayout.of([packs[i] for i in rng.permutation(len(packs))], lengths)
        m = layout.rows
        pad_id = int(self._shards[0].attrs.get("pad_id", 0))
        out = layout.tokens({key: rows[key] for key in ("input_ids", "segment_ids")}, s, fill={"input_ids": pad_id})
        # Masked slot j of packed sequence src: positions shifted to the row, after the
        # masks of the sequences before it.
        n_mask = n_masks[layout.member]
        mask_start = PackLayout.offsets(n_mask, layout.first, layout.row)
        src, j = ranges(n_mask)
        r, c = layout.row[src], mask_start[src] + j
        member = layout.member[src]
        for key, shift in (("masked_lm_positions", layout.start[src]), ("masked_lm_ids", 0)):
            out[key] = np.zeros((m, p_pack), np.int64)
            out[key][r, c] = rows[key][member, j] + shift
        out["next_sentence_labels"] = layout.per_slot(rows["next_sentence_labels"][layout.member], k, IGNORE_INDEX)
        out["nsp_positions"] = layout.per_slot(layout.start, k, 0)
        self._packed_rows += m
        self._packed_sequences += len(lengths)
        self._packed_tokens += int(lengths.sum())
        if self.verbose and not self._packing_report_done:
            self._packing_report_done = True
            print(
                f"PretrainingLoader packing: {len(lengths)} sequences in {m} rows "
                f"({len(lengths) / max(m, 1):.2f} per row); efficiency {self.packing_efficiency:.1%} "
                f"of tokens real (unpacked {lengths.sum() / (len(lengths) * s):.1%})",
                flush=True,
            )
        return out

    # ------------------------------------------------------------------ batches

    def _batches(self, pos: dict) -> Iterator[tuple[dict[str, torch.Tensor], dict]]:
        """This replica's batches: its share of each global batch of the stream, and the
        position after it."""
        epoch, w_index, offset, batches = pos["epoch"], pos["window"], pos["offset"], pos["batches"]
        bs = self.global_batch
        mine = slice(self.replica_rank * self.batch_size, (self.replica_rank + 1) * self.batch_size)
        while True:
            plan = self._plan(epoch)
            carry: dict[str, np.ndarray] | None = None
            while w_index < len(plan):
                w, first, end = plan[w_index]
                rows = self._window_rows(epoch, w, first, end)
                if offset:
                    rows = {key: v[offset:] for key, v in rows.items()}
                base = offset  # window row index of rows[0]
                n_carry = 0
                if carry is not None:
                    n_carry = len(carry["input_ids"])
                    rows = {key: np.concatenate([carry[key], v]) for key, v in rows.items()}
                carry = None
                total = len(rows["input_ids"])
                j = 0
                while (j + 1) * bs <= total:
                    batch = {key: v[j * bs : (j + 1) * bs][mine] for key, v in rows.items()}
                    j += 1
                    batches += 1
                    left = total - j * bs
                    if w_index == len(plan) - 1 and (left == 0 or (self.drop_last and left < bs)):
                        # The position of the next batch is the next epoch's start.
                        position = {"epoch": epoch + 1, "window": 0, "offset": 0, "batches": 0}
                    else:
                        position = {"epoch": epoch, "window": w_index, "offset": base + j * bs - n_carry,
                                    "batches": batches}
                    yield _to_torch(batch), position
                if j * bs < total:
                    carry = {key: v[j * bs :] for key, v in rows.items()}
                w_index += 1
                offset = 0
            if carry is not None and not self.drop_last:
                batches += 1
                yield _to_torch({key: v[mine] for key, v in carry.items()}), {"epoch": epoch + 1, "window": 0,
                                                                               "offset": 0, "batches": 0}
            epoch, w_index, offset, batches = epoch + 1, 0, 0, 0


def unk_note(unk: int, scored: int, shards: int, held_out: bool = False) -> str:
    """The one line that says shards hold `unk` [UNK] targets beside `scored` others, ignored."""
    targets = unk + scored
    return (f"note: {unk} of the {targets} masked-LM targets ({unk / max(targets, 1):.2%}) in {shards} "
            f"{'held-out ' if held_out else ''}shard{'s' if shards != 1 else ''} are [UNK]: they are not scored (an "
            "[UNK] answer teaches nothing); shards made by this version's data/create_pretraining_data.py never "
            "mask [UNK]")


def _to_torch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for key, v in batch.items()}


class _Prefetcher:
    """Runs a generator in a daemon thread, `depth` items ahead; re-raises its errors."""

    _DONE = object()

    def __init__(self, stream: Iterator, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True,
                                        name="PretrainingLoader-prefetch")
        self._thread.start()

    def _run(self, stream: Iterator) -> None:
        try:
            for item in stream:
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, which re-raises
            self._put(_Failure(e))
        finally:
            self._put(self._DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            if self._stop.is_set():
                raise RuntimeError("this loader iterator was superseded by a newer iter(loader)")
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is self._DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error
