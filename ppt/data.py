"""The loader that packs token shards (ppt/shards.py) into training rows, for every rank (SPEC.md, "Shards and the
data directory", states the contract): row i of a shard is tokens[i*T : i*T+T+1], `doc_pos` restarts at every EOT and
at the row start, each epoch permutes shards and rows from (seed, epoch), and ranks take disjoint rows
(`_RowSource.global_row`); an epoch's last rows, fewer than one per rank, are dropped so every rank gets as many.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ppt.common import PPTError, warn0
from ppt.shards import dataset_fingerprint, list_shards, out_of_vocab, read_shard

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs int64 (B,T), targets int64 (B,T), doc_pos int32
Item = tuple[Batch, np.ndarray, int, int]  # a batch, its tokens at each document position, the cursor after it
STATE_KEYS = ("split", "epoch", "position", "seed", "seq_len", "world_size", "batch_size", "total_rows")


class _RowSource:
    """One rank's rows in epoch order, and the host batches built from them: all that the prefetch thread uses. It
    holds no reference to the DataLoader, so a loader dropped while its thread runs can still be collected."""

    def __init__(
        self,
        tokens: list[np.memmap],
        seq_len: int,
        eot_id: int,
        vocab_size: int,
        rank: int,
        world_size: int,
        block: int,
        seed: int,
        pin_memory: bool,
    ) -> None:
        self.tokens, self.seq_len, self.eot_id, self.vocab_size = tokens, seq_len, eot_id, vocab_size
        self.rank, self.world_size, self.block, self.seed, self.pin_memory = rank, world_size, block, seed, pin_memory
        self.rows_per_shard = np.array([(t.size - 1) // seq_len for t in tokens], dtype=np.int64)
        self.rows_per_rank = int(self.rows_per_shard.sum()) // world_size
        self.rows_in_blocks = self.rows_per_rank // block * block  # this rank's rows dealt out in whole blocks
        self._file_order = (np.arange(len(tokens)), np.cumsum(self.rows_per_shard))
        self._layout: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, shard order, cumulative rows)
        self._row_perm: tuple[int, np.ndarray] | None = None  # (shard, its row order this epoch): ranks move forward
        self.checked: set[int] = set()  # shards whose ids were all found inside the vocabulary

    def global_row(self, position: int) -> int:
        """The epoch's global row number of this rank's row at `position`. Blocks of `block` rows (the batch size) go
        to the ranks in turn, so rank r's batch holds the rows of micro-batch r of one process accumulating over the
        ranks: the two sum the same gradients. The rows after the last whole round of blocks go round-robin."""
        W, B = self.world_size, self.block
        if position < self.rows_in_blocks:
            return position // B * W * B + self.rank * B + position % B
        return self.rows_in_blocks * W + (position - self.rows_in_blocks) * W + self.rank

    def locate(self, epoch: int, global_row: int, shuffle: bool) -> tuple[int, int]:
        """(shard index, row inside that shard) of an epoch's global row number."""
        if not shuffle:
            order, row_ends = self._file_order
        else:
            if self._layout is None or self._layout[0] != epoch:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
                self._layout, self._row_perm = (epoch, order, np.cumsum(self.rows_per_shard[order])), None
            _, order, row_ends = self._layout
        slot = int(np.searchsorted(row_ends, global_row, side="right"))
        shard = int(order[slot])
        local = global_row - (int(row_ends[slot - 1]) if slot else 0)
        if not shuffle:
            return shard, local
        if self._row_perm is None or self._row_perm[0] != shard:
            rng = np.random.default_rng([self.seed, epoch, shard])
            self._row_perm = (shard, rng.permutation(int(self.rows_per_shard[shard])))
        return shard, int(self._row_perm[1][local])

    def batches(self, batch_size: int, epoch: int, position: int, shuffle: bool) -> Iterator[Item]:
        """The batches after cursor (epoch, position) in this rank's rows, each with how many of its tokens sit at each
        document position (counts[p]: what the comparison-FLOPs rule needs) and the cursor after it."""
        while True:
            locations = []
            for _ in range(batch_size):
                if position == self.rows_per_rank:
                    epoch, position = epoch + 1, 0
                locations.append(self.locate(epoch, self.global_row(position), shuffle))
                position += 1
            batch = self.build(locations)
            yield batch, np.bincount(batch[2].numpy().ravel(), minlength=self.seq_len), epoch, position

    def build(self, locations: list[tuple[int, int]]) -> Batch:
        """A host batch from (shard, row) pairs, gathered straight into its output tensors (pinned for CUDA)."""
        B, T = len(locations), self.seq_len
        inputs, targets, doc_pos = (
            torch.empty((B, T), dtype=dtype, pin_memory=self.pin_memory)
            for dtype in (torch.int64, torch.int64, torch.int32)
        )
        x, y = inputs.numpy(), targets.numpy()
        for shard in {shard for shard, _ in locations} - self.checked:  # a shard whole, before its first rows train
            if (found := int(self.tokens[shard].max())) >= self.vocab_size:  # ~80 ms per 100M tokens from disk
                raise PPTError(out_of_vocab(self.tokens[shard].filename, found, self.vocab_size))
            self.checked.add(shard)
        for i, (shard, row) in enumerate(locations):
            tokens = self.tokens[shard][row * T : row * T + T + 1]
            x[i], y[i] = tokens[:-1], tokens[1:]
        positions = np.arange(T)
        # the latest document start at or before each position: an EOT, else the row start (position 0)
        last_start = np.maximum.accumulate(np.where(x == self.eot_id, positions, 0), axis=1)
        np.subtract(positions, last_start, out=doc_pos.numpy(), casting="unsafe")
        return inputs, targets, doc_pos


class _Prefetcher:
    """A daemon thread that runs `items` up to `depth` ahead of the consumer. A failure in the thread is raised by
    `next`; `close` (also run when the owning loader is collected) stops the thread."""

    POLL_S = 0.1  # how often a thread blocked on a full queue checks whether it should stop

    def __init__(self, items: Iterator[Item], depth: int, device: torch.device) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        args = (items, device, self._queue, self._stop)
        self._thread = threading.Thread(target=_Prefetcher._run, args=args, name="ppt-prefetch", daemon=True)
        self._thread.start()

    def __next__(self) -> Item:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():  # garbage collection may run the finalizer there
            self._thread.join()

    @staticmethod
    def _run(items: Iterator[Item], device: torch.device, out: queue.Queue, stop: threading.Event) -> None:
        def put(item: object) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=_Prefetcher.POLL_S)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread: pin memory in this rank's context
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:  # the consumer raises it from next()
            put(exc)


class DataLoader:
    """Infinite iterator of `(inputs int64 (B,T), targets int64 (B,T), doc_pos int32 (B,T))` for one rank.

    `split="train"` shuffles per epoch; `split="val"` keeps file order (use `val_batches` for a fixed budget).
    A background thread builds the next `prefetch` batches (pinned host memory on CUDA; with 0, `next()` builds it)
    while the model computes; `next()` only copies one to the device, asynchronously. `state_dict()` describes the
    batches `next()` has returned, the same on every rank, so resuming from rank 0's state resumes all ranks exactly.
    `vocab_size` (the model's; default the shards') bounds the ids: a shard or a batch holding a larger one is refused.
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: str | torch.device = "cpu",
        expected_fingerprint: str | None = None,
        prefetch: int = 2,
        vocab_size: int | None = None,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise PPTError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if not 0 <= rank < world_size:
            raise PPTError(f"rank {rank} is outside world size {world_size}")
        if prefetch < 0:
            raise PPTError(f"prefetch is a number of batches, at least 0, got {prefetch}")
        self.data_dir = Path(data_dir)
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device, self.shuffle, self.prefetch = torch.device(device), split == "train", prefetch

        # ids are checked as a shard is first used (_RowSource.build), not on every open of the whole split
        shards = [read_shard(p, expected_fingerprint, check_ids=False) for p in list_shards(self.data_dir, split)]
        first = shards[0][0]
        self.vocab_size = vocab_size or first.vocab_size
        for info, _ in shards:
            if (info.tokenizer_fingerprint, info.eot_id) != (first.tokenizer_fingerprint, first.eot_id):
                raise PPTError(
                    f"{info.path} and {first.path} were made by different tokenizers; "
                    "re-run prepare into an empty --out directory"
                )
            if info.max_token_id >= self.vocab_size:  # no embedding for it: a crash mid-run (CUDA: an assert)
                raise PPTError(out_of_vocab(info.path, info.max_token_id, self.vocab_size))
        self._source = _RowSource(
            [tokens for _, tokens in shards], seq_len, first.eot_id, self.vocab_size, rank, world_size,
            batch_size if self.shuffle else 1, seed, pin_memory=self.device.type == "cuda",
        )  # fmt: skip
        self.total_rows = int(self._source.rows_per_shard.sum())
        self.rows_per_rank = self._source.rows_per_rank
        if self.rows_per_rank == 0:
            total = sum(info.num_tokens for info, _ in shards)
            raise PPTError(
                f"the {split} split of {self.data_dir} has {total} tokens, too few for one row of seq_len {seq_len} "
                f"per rank ({world_size} ranks); lower seq_len or prepare more data"
            )
        self.epoch, self.position = 0, 0  # the cursor after the last batch returned: an index into this rank's rows
        self._doc_pos_counts = np.zeros(seq_len, dtype=np.int64)  # of the batches returned since the last take
        self._batches: Iterator[Item] | None = None  # from the cursor on: a generator, or its prefetch thread
        self._stop_on_collect: weakref.finalize | None = None

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens all ranks together see in one epoch."""
        return self.rows_per_rank * self.world_size * self.seq_len

    def fingerprint(self) -> str:
        return dataset_fingerprint(self.data_dir)

    # -- iteration and resume

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = self._source.batches(self.batch_size, self.epoch, self.position, self.shuffle)
            if self.prefetch:
                self._batches = prefetcher = _Prefetcher(self._batches, self.prefetch, self.device)
                self._stop_on_collect = weakref.finalize(self, prefetcher.close)
                self._stop_on_collect.atexit = False  # a daemon thread ends with the interpreter anyway
        try:
            batch, counts, self.epoch, self.position = next(self._batches)
        except BaseException:  # the thread's error, or Ctrl-C while waiting: no thread outlives it
            self.close()
            raise
        self._doc_pos_counts += counts
        return self._to_device(batch)

    def take_doc_pos_counts(self) -> np.ndarray:
        """(seq_len,) int64: tokens at each document position in the batches returned since the last call (counted
        on the host where the batch is built: no device work, no sync)."""
        counts, self._doc_pos_counts = self._doc_pos_counts, np.zeros(self.seq_len, dtype=np.int64)
        return counts

    def _to_device(self, batch: Batch) -> Batch:
        return tuple(t.to(self.device, non_blocking=True) for t in batch)

    def close(self) -> None:
        """Stop the prefetch thread (the next `next()` starts again from the current state)."""
        if self._stop_on_collect is not None:
            self._stop_on_collect()  # runs the prefetcher's close once, and no longer at collection
        self._batches = self._stop_on_collect = None

    def state_dict(self) -> dict[str, int | str]:
        return {key: getattr(self, key) for key in STATE_KEYS}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        if missing := set(STATE_KEYS) - state.keys():
            raise PPTError(
                f"the data loader state lacks {', '.join(sorted(missing))} (saved by an older ppt), so its batch order "
                "cannot be continued; start the run again without --resume"
            )
        for key in ("split", "seed", "seq_len", "world_size"):
            if state[key] != getattr(self, key):
                raise PPTError(
                    f"the data loader state was saved with {key}={state[key]}, but this run has "
                    f"{key}={getattr(self, key)}; resume with the same settings"
                )
        if state["total_rows"] != self.total_rows:
            warn0(
                f"{self.data_dir} changed since the loader state was saved ({state['total_rows']} rows, now "
                f"{self.total_rows}); the resumed batch order will differ from an uninterrupted run"
            )
        if self.world_size > 1 and self.shuffle and state["batch_size"] != self.batch_size:
            warn0(
                f"the data loader state was saved with batch_size={state['batch_size']}, this run has "
                f"{self.batch_size}: ranks take rows in blocks of a batch, so the rest of this epoch repeats some "
                "rows and skips others"
            )
        self.close()  # batches built from the old position are dropped
        self.epoch, self.position = int(state["epoch"]), min(int(state["position"]), self.rows_per_rank)
        self._doc_pos_counts[:] = 0

    def val_rows(self, max_tokens: int) -> int:
        """The rows of this rank's share that `val_batches(max_tokens)` yields: the budget's, or all the split has."""
        return min(max_tokens // (self.seq_len * self.world_size), self.rows_per_rank)

    def budget_shortfall(self, max_tokens: int) -> str | None:
        """Why `val_batches(max_tokens)` scores fewer rows than the budget asks, when the split is what runs out."""
        if max_tokens // (self.seq_len * self.world_size) <= self.rows_per_rank:
            return None
        return (
            f"a val budget of {max_tokens:,} tokens is more than the {self.split} split of {self.data_dir} holds in "
            f"rows of {self.seq_len} ({self.tokens_per_epoch:,} tokens); all of them are scored"
        )

    def val_batches(self, max_tokens: int) -> Iterator[Batch]:
        """This rank's share of the split's first `max_tokens` input tokens (over all ranks) in file order, in as many
        batches on every rank (the last may be smaller); the loader's own position does not move."""
        rows_each = self.val_rows(max_tokens)
        if rows_each == 0:
            raise PPTError(
                f"a val budget of {max_tokens} tokens is less than one row of {self.seq_len} tokens per rank "
                f"({self.world_size} ranks); raise the budget or lower seq_len"
            )
        for start in range(0, rows_each, self.batch_size):
            stop = min(start + self.batch_size, rows_each)
            rows = [self._source.locate(0, self._source.global_row(k), False) for k in range(start, stop)]
            yield self._to_device(self._source.build(rows))
