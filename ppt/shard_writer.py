"""Documents into shards (ppt/shards.py): tokenization on worker processes, in order, and the writer that fills the
val shard, then train shards, recording its progress in meta.json after every finished shard so that an interrupted
prepare resumes exactly (`python -m scripts.prepare_fineweb` drives it)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer

from ppt.common import PPTError, format_sizes
from ppt.shards import shard_path, token_dtype, write_meta, write_shard
from ppt.tokenizer import Tokenizer

META_FORMAT = 1
VAL_SHARE = 0.05  # of a local corpus, for the default val split

# ---- tokenization ------------------------------------------------------------------------------------------------


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens per document, all tokens concatenated); each document ends with EOT, empty ones get 0 tokens."""
    keep = [i for i, text in enumerate(texts) if text.strip()]
    encoded = tokenizer.encode_batch([texts[i] for i in keep])
    lengths = np.zeros(len(texts), dtype=np.int64)
    lengths[keep] = [len(ids) for ids in encoded]
    tokens = np.fromiter(itertools.chain.from_iterable(encoded), token_dtype(tokenizer.vocab_size), int(lengths.sum()))
    return lengths, tokens


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str, name: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and kill are the parent's to handle: it ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_tokenizer = Tokenizer(BackendTokenizer.from_str(tokenizer_json), name)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "worker used before _init_worker"
    return encode_documents(_worker_tokenizer, texts)


@contextmanager
def worker_pool(tokenizer: Tokenizer, workers: int) -> Iterator[Pool | None]:
    """Tokenizer processes, or None for in-process tokenization when workers <= 1.

    On Linux the workers are forked (instant; spawning re-imports torch in each) so open the pool before the
    document source starts any threads. Each worker encodes single-threaded: the processes are the parallelism.
    """
    # one thread per process, so --workers is the number of cores used (inherited by the workers; it also
    # silences tokenizers' warning about forking after its thread pool ran)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if workers <= 1:
        yield None
        return
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    # The workers start with SIGTERM's default action, not this process's handler: a worker stuck in C code before
    # its initializer runs (a lock some thread of this process held at the fork) is still ended by terminate(),
    # where a Python-level handler would never run and the pool's exit would wait for it forever.
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        pool = context.Pool(workers, _init_worker, (tokenizer.backend.to_str(), tokenizer.name))
    finally:
        signal.signal(signal.SIGTERM, handler)
    with pool:
        yield pool  # leaving the block terminates the workers, also when stopped early


def encode_in_order(
    batches: Iterable[list[str]], tokenizer: Tokenizer, pool: Pool | None, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode batches of documents, on the pool's workers if there is one, yielding results in input order.

    At most 2 * workers batches are in flight, so a streamed corpus is never read far ahead into memory.
    """
    if pool is None:
        for texts in batches:
            yield encode_documents(tokenizer, texts)
        return
    pending: deque[AsyncResult] = deque()
    for texts in batches:
        pending.append(pool.apply_async(_encode_in_worker, (texts,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


# ---- shards ------------------------------------------------------------------------------------------------------


@dataclass
class ShardBuffer:
    """The documents of the shard being filled: EOT, doc, EOT, doc, EOT ..."""

    target_tokens: int
    eot_id: int
    parts: list[np.ndarray] = field(default_factory=list)
    tokens: int = 1  # the leading EOT
    docs: int = 0
    docs_consumed: int = 0  # documents read from the source, empty ones included

    def add(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        self.parts.append(tokens)
        self.tokens += tokens.size
        self.docs += int(np.count_nonzero(lengths))
        self.docs_consumed += lengths.size

    @property
    def full(self) -> bool:
        return self.tokens >= self.target_tokens

    def array(self, dtype: np.dtype) -> np.ndarray:
        return np.concatenate([np.array([self.eot_id], dtype=dtype), *self.parts])


class ShardWriter:
    """Fills the val shard, then train shards, and records progress in meta.json after every finished shard.

    The val shard is held back until the first train shard is written, so a corpus too small for both leaves
    nothing behind.
    """

    def __init__(self, out: Path, meta: dict, tokenizer: Tokenizer, target_shards: int | None) -> None:
        self.out, self.meta, self.tokenizer, self.target_shards = out, meta, tokenizer, target_shards
        settings = meta["settings"]
        val_done = meta["val"]["shards"] == 1
        self.val = None if val_done else ShardBuffer(settings["val_tokens"], tokenizer.eot_id)
        self.train = ShardBuffer(settings["shard_tokens"], tokenizer.eot_id)
        self.done = self.finished(meta, target_shards)
        self.tokens_written = 0

    @staticmethod
    def finished(meta: dict, target_shards: int | None) -> bool:
        shards = meta["train"]["shards"]
        return meta["progress"]["exhausted"] or (target_shards is not None and shards >= target_shards)

    def feed(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Add a batch of encoded documents, closing shards at the first document boundary past their size."""
        ends = np.cumsum(lengths)
        first = 0
        while first < lengths.size and not self.done:
            buffer = self.val if self.val is not None and not self.val.full else self.train
            start = int(ends[first - 1]) if first else 0
            # the first document whose end brings the buffer to its target size
            last = int(np.searchsorted(ends, start + buffer.target_tokens - buffer.tokens, side="left"))
            last = min(last, lengths.size - 1)
            buffer.add(lengths[first : last + 1], tokens[start : int(ends[last])])
            first = last + 1
            if buffer is self.train and buffer.full:
                self.flush()

    def flush(self) -> None:
        """Write the pending val shard (if any) and the train shard, then the progress that covers them."""
        dtype = token_dtype(self.tokenizer.vocab_size)
        if self.val is not None:
            self._write("val", 0, self.val.array(dtype), self.val)
            self.val = None
        index = self.meta["train"]["shards"]
        self._write("train", index, self.train.array(dtype), self.train)
        self.train = ShardBuffer(self.meta["settings"]["shard_tokens"], self.tokenizer.eot_id)
        self.done = self.finished(self.meta, self.target_shards)
        with disk_errors(self.out / "meta.json", self.shard_bytes()):
            write_meta(self.out, self.meta)

    def shard_bytes(self) -> int:
        return self.meta["settings"]["shard_tokens"] * token_dtype(self.tokenizer.vocab_size).itemsize

    def _write(self, split: str, index: int, array: np.ndarray, buffer: ShardBuffer) -> None:
        tok = self.tokenizer
        path = shard_path(self.out, split, index)
        with disk_errors(path, self.shard_bytes()):
            write_shard(
                path,
                array,
                vocab_size=tok.vocab_size,
                eot_id=tok.eot_id,
                fingerprint=tok.fingerprint,
                demo=tok.is_demo,
                tokenizer_name=tok.name,
            )
        counts = self.meta[split]
        counts["shards"] += 1
        counts["docs"] += buffer.docs
        counts["tokens"] += array.size
        self.meta["progress"]["docs_consumed"] += buffer.docs_consumed
        self.tokens_written += array.size

    def finish(self) -> None:
        """The source ran out: write what is left, or explain why there is nothing to write."""
        if self.val is not None and (not self.val.full or self.train.docs == 0):
            if self.val.docs == 0:
                raise PPTError("the corpus has no documents (or only empty ones); check --source")
            total = self.val.tokens + self.train.tokens - 1
            raise PPTError(
                f"the corpus is too small: its {total:,} tokens do not fill the val shard "
                f"(--val-tokens {self.val.target_tokens}) and leave some for training; lower --val-tokens, "
                f"e.g. --val-tokens {max(2, int(total * VAL_SHARE))} ({VAL_SHARE:.0%})"
            )
        if self.train.docs:
            self.flush()
        self.meta["progress"]["exhausted"] = True
        self.done = True
        with disk_errors(self.out / "meta.json", self.shard_bytes()):
            write_meta(self.out, self.meta)


@contextmanager
def disk_errors(path: Path, shard_bytes: int) -> Iterator[None]:
    """A failed write (full disk, lost permission) as one line: what failed, that finished shards are kept, the fix."""
    try:
        yield
    except OSError as exc:
        raise PPTError(
            f"could not write {path} ({exc.strerror or exc}); the finished shards are kept. Free space (a shard takes "
            f"about {format_sizes(shard_bytes)[0]}) or pass another --out, then re-run the same command to resume"
        ) from exc


def new_meta(
    source: str | list[str],
    tokenizer: Tokenizer,
    shard_tokens: int,
    val_tokens: int,
    shuffle_seed: int | None = None,
    origin: dict | None = None,
) -> dict:
    """A fresh meta.json. `origin` says where the tokenizer came from (hub, file, demo, or trained on this corpus)."""
    settings = {"shard_tokens": shard_tokens, "val_tokens": val_tokens}
    if shuffle_seed is not None:  # absent otherwise, as in directories prepared before the option existed
        settings["shuffle_seed"] = shuffle_seed
    return {
        "format": META_FORMAT,
        "source": source,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "is_demo": tokenizer.is_demo,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            **({"origin": origin} if origin else {}),
        },
        "settings": settings,
        "val": {"shards": 0, "docs": 0, "tokens": 0},
        "train": {"shards": 0, "docs": 0, "tokens": 0},
        "progress": {"docs_consumed": 0, "exhausted": False, "complete": False},  # complete: this prepare finished
    }


def check_resumable(out: Path, meta: dict, expected: dict) -> None:
    """A directory can be resumed only with the source, tokenizer and sizes it was started with."""
    for key in ("source", "settings"):
        if meta.get(key) != expected[key]:
            raise PPTError(
                f"{out} was prepared with {key} {meta.get(key)}, not {expected[key]}; "
                "pass another --out, or delete the directory to start over"
            )
    if meta["tokenizer"]["fingerprint"] != expected["tokenizer"]["fingerprint"]:
        raise PPTError(
            f"{out} was prepared with tokenizer {meta['tokenizer']['name']}, not {expected['tokenizer']['name']}; "
            "pass another --out, or delete the directory to start over"
        )


def remove_leftovers(out: Path, meta: dict) -> None:
    """Temp files of a killed write, and shards written after the last progress update (rewritten anyway)."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink()
    for split in ("val", "train"):
        for path in out.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9].bin"):
            if int(path.stem[-5:]) >= meta[split]["shards"]:
                path.unlink()
