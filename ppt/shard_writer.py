"""Documents into shards (ppt/shards.py): tokenization on worker processes, in order, and the writer that fills the
val shard, then train shards, keeps one of each set of exact-duplicate documents, and records its progress in
meta.json after every finished shard so that an interrupted prepare resumes exactly and a lost shard is rebuilt
(`python -m scripts.prepare_fineweb` drives it)."""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import re
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
from ppt.shards import META_FORMAT, read_shard, shard_path, token_dtype, write_meta, write_shard
from ppt.tokenizer import Tokenizer

VAL_SHARE = 0.05  # of a local corpus, for the default val split
PIECE_CHARS = 100_000  # characters the tokenizer takes at a time: it needs about 140 bytes of memory per character
_PIECE_END = re.compile(r".*\S (?=\S)", re.DOTALL)  # up to the last space between two non-space characters
# What meta.json counts per split, beside shards and tokens: documents written; documents read from the source (empty
# and duplicate ones too: a resume skips that many); documents dropped as exact copies of an earlier one; and of
# those, the copies of a val document (in train: what would have leaked val into training)
COUNTS = ("docs", "docs_consumed", "duplicates", "duplicates_of_val")
Encoded = tuple[np.ndarray, np.ndarray, list[bytes]]  # tokens per document, all their tokens, the documents' digests

# ---- tokenization ------------------------------------------------------------------------------------------------


def digest(text: str) -> bytes:
    """16 bytes (blake2b) that tell documents apart: the writer keeps a set of them, not the texts."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def document_pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARS characters, each cut before the last space between two non-space
    characters: a boundary of every pre-token in byte-level BPEs like cosmo2, so the pieces' tokens are the whole
    text's. Where PIECE_CHARS characters hold no such space (text without spaces, as Chinese), the cut falls at
    PIECE_CHARS, which can change the tokens next to it."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        space = _PIECE_END.match(text, start, start + PIECE_CHARS + 1)
        end = space.end() - 1 if space else start + PIECE_CHARS
        yield text[start:end]
        start = end
    yield text[start:]


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> Encoded:
    """Each document's token count (it ends with EOT; an empty one has 0), all tokens concatenated, its digest. The
    tokenizer takes about PIECE_CHARS characters a call (`document_pieces`), so its memory stays bounded."""
    pieces = [(i, piece) for i, text in enumerate(texts) if text.strip() for piece in document_pieces(text)]
    last = [i != j for (i, _), (j, _) in zip(pieces, [*pieces[1:], (-1, "")])]  # the last piece of its document
    calls = np.cumsum([len(piece) for _, piece in pieces]) // PIECE_CHARS  # runs of pieces, one call each
    dtype, lengths, parts = token_dtype(tokenizer.vocab_size), np.zeros(len(texts), dtype=np.int64), []
    for _, call in itertools.groupby(range(len(pieces)), key=lambda k: calls[k]):
        call = list(call)
        for k, ids in zip(call, tokenizer.encode_batch([pieces[k][1] for k in call])):
            parts.append(np.array(ids if last[k] else ids[:-1], dtype))  # one EOT, after the last piece
            lengths[pieces[k][0]] += parts[-1].size
    return lengths, np.concatenate([np.zeros(0, dtype), *parts]), [digest(text) for text in texts]


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str, name: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and kill are the parent's to handle: it ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_tokenizer = Tokenizer(BackendTokenizer.from_str(tokenizer_json), name)


def _encode_in_worker(texts: list[str]) -> Encoded:
    return encode_documents(_worker_tokenizer, texts)


@contextmanager
def worker_pool(tokenizer: Tokenizer, workers: int) -> Iterator[Pool | None]:
    """Tokenizer processes, or None for in-process tokenization when workers <= 1. On Linux the workers are forked
    (instant; spawning re-imports torch in each), so open the pool before the document source starts any threads."""
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
) -> Iterator[Encoded]:
    """Encode batches of documents, on the pool's workers if there is one, yielding results in input order. At
    most 2 * workers batches are in flight, so a streamed corpus is never read far ahead into memory."""
    if pool is None:
        yield from (encode_documents(tokenizer, texts) for texts in batches)
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
    """The documents of the shard being filled (EOT, doc, EOT, doc, EOT ...) and what it adds to meta.json's counts."""

    target_tokens: int
    parts: list[np.ndarray] = field(default_factory=list)
    tokens: int = 1  # the leading EOT
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))

    @property
    def full(self) -> bool:
        return self.tokens >= self.target_tokens


class ShardWriter:
    """Fills the val shard, then train shards, with the first of each set of exact-duplicate documents (found by
    digest), and records progress in meta.json after every finished shard. The val shard is held back until the first
    train shard is written, so a corpus too small for both leaves nothing behind. Val takes the first documents of
    the stream but none longer than its plan, so it stays below twice the plan: a longer one goes to train, and val
    holds the first of them only where no document is shorter."""

    def __init__(self, out: Path, meta: dict, tokenizer: Tokenizer, target_shards: int | None) -> None:
        self.out, self.meta, self.tokenizer, self.target_shards = out, meta, tokenizer, target_shards
        self.val = None if meta["val"]["shards"] else self.buffer("val_tokens")
        self.train = self.buffer("shard_tokens")
        self.done = self.finished(meta, target_shards)
        self.seen: set[bytes] = set()  # digests of the documents kept
        self.val_seen: set[bytes] = set()  # ... of those in val
        self.last_length = 0  # tokens of the last document kept
        self.passed_over: list[tuple[int, bytes]] = []  # stream index and digest of documents too long for val
        self.tokens_written = 0

    def buffer(self, size: str) -> ShardBuffer:
        return ShardBuffer(self.meta["settings"][size])

    @staticmethod
    def finished(meta: dict, target_shards: int | None) -> bool:
        return meta["progress"]["exhausted"] or (target_shards is not None and meta["train"]["shards"] >= target_shards)

    def remember(self, texts: Iterable[str]) -> None:
        """Resuming: take the digests of the documents the finished shards consumed, so their copies are dropped."""
        passed_over = set(self.meta["progress"].get("val_passed_over", []))  # older directories record none
        val_end = self.meta["val"]["docs_consumed"] + len(passed_over)
        for index, text in enumerate(texts):
            doc = digest(text)
            self.seen.add(doc)
            if index < val_end and index not in passed_over:
                self.val_seen.add(doc)

    def feed(self, lengths: np.ndarray, tokens: np.ndarray, digests: list[bytes]) -> None:
        """Add encoded documents in order, dropping exact duplicates; a shard closes at the first document boundary
        past its size."""
        for length, end, doc in zip(lengths.tolist(), np.cumsum(lengths).tolist(), digests):
            if self.done:
                return
            buffer = self.val if self.val is not None and not self.val.full else self.train
            if buffer is self.val and length > buffer.target_tokens:
                self.passed_over.append((self.val.counts["docs_consumed"] + self.train.counts["docs_consumed"], doc))
                buffer = self.train
            buffer.counts["docs_consumed"] += 1
            if not length:
                continue
            if doc in self.seen:
                buffer.counts["duplicates"] += 1
                buffer.counts["duplicates_of_val"] += doc in self.val_seen
                continue
            self.seen.add(doc)
            if buffer is self.val:
                self.val_seen.add(doc)
            buffer.parts.append(tokens[end - length : end])
            buffer.tokens += length
            buffer.counts["docs"] += 1
            self.last_length = length
            if buffer is self.train and buffer.full:
                self.flush()

    def flush(self) -> None:
        """Write the pending val shard (if any) and the train shard, then the progress that covers them."""
        # The first shards: the tokenizer and meta.json go first, so a kill leaves a directory the next run resumes,
        # and a prepare that fails before its first shard leaves nothing
        if self.val is not None:
            self.settle_val()
            with self.disk_errors(self.out / "tokenizer.json"):
                self.tokenizer.save(self.out)
            self.write_meta()
            self._write("val", self.val)
            self.val = None
        self._write("train", self.train)
        self.train = self.buffer("shard_tokens")
        self.meta["progress"]["train_shards"].append(dict(self.meta["train"]))  # where a rebuild of the next starts
        self.done = self.finished(self.meta, self.target_shards)
        self.write_meta()

    def settle_val(self) -> None:
        """Say so when documents too long for val went to train; where none came short enough (val holds no
        document), val takes the first of them, unless that leaves the train shard without a document."""
        val, train = self.val, self.train
        if not val.counts["docs"]:  # every document so far went to train: val takes the first
            first = train.parts.pop(0)
            if not train.parts:
                raise PPTError(
                    f"the first document ({first.size:,} tokens) is longer than the val split (--val-tokens "
                    f"{val.target_tokens}) and fills a train shard by itself; val and train take whole documents, so "
                    f"split it into several, or pass --val-tokens {first.size}"
                )
            val.parts.append(first)
            val.tokens, train.tokens = val.tokens + first.size, train.tokens - first.size
            for key in ("docs", "docs_consumed"):
                val.counts[key], train.counts[key] = val.counts[key] + 1, train.counts[key] - 1
            self.val_seen.add(self.passed_over.pop(0)[1])
            print(f"note: no document came shorter than the val split ({val.target_tokens:,} tokens planned), which "
                  f"takes whole documents: val holds the first one, {val.tokens:,} tokens")  # fmt: skip
        elif self.passed_over:
            print(f"note: the val split ({val.target_tokens:,} tokens planned) takes no document longer than itself: "
                  f"{len(self.passed_over):,} went to train, and val holds {val.tokens:,} tokens")  # fmt: skip
        self.meta["progress"]["val_passed_over"] = [index for index, _ in self.passed_over]

    def _write(self, split: str, buffer: ShardBuffer) -> None:
        tok = self.tokenizer
        array = np.concatenate([np.array([tok.eot_id], dtype=token_dtype(tok.vocab_size)), *buffer.parts])
        path = shard_path(self.out, split, self.meta[split]["shards"])
        with self.disk_errors(path):
            write_shard(path, array, vocab_size=tok.vocab_size, eot_id=tok.eot_id, fingerprint=tok.fingerprint,
                        demo=tok.is_demo, tokenizer_name=tok.name)  # fmt: skip
        self.meta[split]["shards"] += 1
        self.meta[split]["tokens"] += array.size
        self._count(split, buffer)
        self.tokens_written += array.size

    def _count(self, split: str, buffer: ShardBuffer) -> None:
        for key, value in buffer.counts.items():
            self.meta[split][key] += value

    def write_meta(self) -> None:
        with self.disk_errors(self.out / "meta.json"):
            write_meta(self.out, self.meta)

    @contextmanager
    def disk_errors(self, path: Path) -> Iterator[None]:
        """A failed write (full disk, lost permission) as one line: what failed, that finished shards stay, the fix."""
        try:
            yield
        except OSError as exc:
            shard_bytes = self.meta["settings"]["shard_tokens"] * token_dtype(self.tokenizer.vocab_size).itemsize
            raise PPTError(
                f"could not write {path} ({exc.strerror or exc}); the finished shards are kept. Free space (a shard "
                f"takes about {format_sizes(shard_bytes)[0]}) or pass another --out, then re-run the same command to "
                "resume"
            ) from exc

    def finish(self) -> None:
        """The source ran out: write what is left, or say why there is nothing to write and what would work."""
        if self.val is not None and (
            not self.train.counts["docs"] or self.val.counts["docs"] + self.train.counts["docs"] < 2
        ):
            self.too_small()  # val needs a document, and train another
        if self.train.counts["docs"]:
            self.flush()
        else:  # only empty or duplicate documents since the last shard: counted, no shard
            self._count("train", self.train)
        self.meta["progress"]["exhausted"] = True
        self.done = True
        self.write_meta()

    def too_small(self) -> None:
        val, train = self.val.counts, self.train.counts
        docs, duplicates = val["docs"] + train["docs"], val["duplicates"] + train["duplicates"]
        dropped = f" ({duplicates:,} exact duplicates dropped)" if duplicates else ""
        if not docs:
            raise PPTError("the corpus has no documents (or only empty ones); check --source")
        if docs == 1:
            raise PPTError(
                f"the corpus holds one document{dropped}, and val and train each take whole documents; split it into "
                "several (files, or lines of a .jsonl) and prepare again"
            )
        total = self.val.tokens + self.train.tokens - 1
        fits = max(2, min(int(total * VAL_SHARE), total - self.last_length))  # val closes before the last document
        raise PPTError(
            f"the corpus is too small: its {total:,} tokens in {docs:,} documents{dropped} do not fill the val shard "
            f"(--val-tokens {self.val.target_tokens}) and leave a document for training; lower --val-tokens, e.g. "
            f"--val-tokens {fits}"
        )


# ---- meta.json: the record that resumes -------------------------------------------------------------------------


def _zero_counts() -> dict[str, int]:
    return {"shards": 0, "tokens": 0, **dict.fromkeys(COUNTS, 0)}


def new_meta(
    source: str | list[str],
    tokenizer: Tokenizer,
    shard_tokens: int,
    val_tokens: int,
    shuffle_seed: int | None = None,
    origin: dict | None = None,
) -> dict:
    """A fresh meta.json. `origin` says where the tokenizer came from (hub, file, demo, or trained on this corpus)."""
    return {
        "format": META_FORMAT,
        "source": source,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "is_demo": tokenizer.is_demo,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "origin": origin,
        },
        "settings": {"shard_tokens": shard_tokens, "val_tokens": val_tokens, "shuffle_seed": shuffle_seed},
        "val": _zero_counts(),
        "train": _zero_counts(),
        # exhausted: the source ran out; complete: the last prepare finished; train_shards: the train counts after
        # each train shard, where a rebuild of the next one starts; val_passed_over: the stream index of each document
        # longer than the val split that went to train while val filled
        "progress": {"exhausted": False, "complete": False, "train_shards": [], "val_passed_over": []},
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


def roll_back_to_damaged(out: Path, meta: dict) -> None:
    """End meta.json's progress before the first shard it records that is missing or damaged (header, size), so
    that this prepare writes that shard, and the ones after it, again."""
    for split in ("val", "train"):
        for index in range(meta[split]["shards"]):
            path = shard_path(out, split, index)
            try:
                read_shard(path, meta["tokenizer"]["fingerprint"])
            except PPTError:
                print(
                    f"{path} is {'damaged' if path.exists() else 'missing'}: writing it, and the shards after it, again"
                )
                keep = index if split == "train" else 0  # the val shard is written with the first train shard
                kept = meta["progress"]["train_shards"][:keep]
                meta["train"] = dict(kept[-1]) if kept else _zero_counts()
                if not keep:
                    meta["val"] = _zero_counts()
                meta["progress"].update(exhausted=False, complete=False, train_shards=kept)
                return


def remove_leftovers(out: Path, meta: dict) -> None:
    """Temp files of a killed write, and shards past those meta.json records (rewritten anyway)."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink()
    for split in ("val", "train"):
        for path in out.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9].bin"):
            if int(path.stem[-5:]) >= meta[split]["shards"]:
                path.unlink()
