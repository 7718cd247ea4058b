"""Tokenize a corpus into ppt shards (format: ppt/shards.py; sources: ppt/sources.py; writer: ppt/shard_writer.py).

    python -m scripts.prepare_fineweb --shards 200             # FineWeb-Edu-Dedup, ~20B train tokens
    python -m scripts.prepare_fineweb --source demo            # offline: the stdlib's own documentation, seconds
    python -m scripts.prepare_fineweb --source 'corpus/*.jsonl' --out /data/mine
    python -m scripts.prepare_fineweb --source ~/books --train-tokenizer --vocab-size 8192 --shuffle-seed 0 \
        --out ~/.cache/ppt/data/books                          # your own corpus, its own tokenizer, no hub

Sources: `fineweb` streams HuggingFaceTB/smollm-corpus (config fineweb-edu-dedup); `demo` uses the documentation the
Python running this script ships and trains its own small BPE on it; anything else is local .txt/.jsonl/.parquet
files, folders of them or globs. Tokenizers: cosmo2 from the hub by default, `--tokenizer path/to/tokenizer.json`, or
`--train-tokenizer --vocab-size N` (a byte-level BPE trained on the corpus itself). Interrupted runs resume, and a
rerun rewrites a recorded shard that went missing or was damaged; one prepare at a time per --out. SPEC.md, "Shards
and the data directory", states what is read, split, deduplicated, refused and recorded.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ppt.common import MAX_TOKENS, ArgumentParser, Number, PPTError, format_sizes, nonneg_int, positive_int
from ppt.formatting import duration
from ppt.locks import lock_directory, release_locks
from ppt.shard_writer import (
    VAL_SHARE,
    ShardWriter,
    batched,
    check_resumable,
    document_pieces,
    encode_in_order,
    new_meta,
    remove_leftovers,
    roll_back_to_damaged,
    worker_pool,
)
from ppt.shards import default_data_dir, load_data_tokenizer, read_meta, token_dtype
from ppt.sources import (
    CorpusSize,
    bytes_per_token,
    demo_documents,
    estimate_text_bytes,
    local_document_source,
    open_fineweb,
    resolve_local_files,
)
from ppt.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer, train_bpe, train_demo_tokenizer

DOCS_PER_TASK = 256  # documents per worker task: big enough to amortize pickling, small enough to keep order cheap
PROGRESS_EVERY_S = 60.0  # seconds between progress lines when stderr is not a terminal (tests lower it)
DEFAULT_VOCAB = 4096  # of a BPE trained here (the demo's, or --train-tokenizer's)
SHARD_TOKENS = Number(int, 2, MAX_TOKENS, scientific=True)
VOCAB_SIZE = Number(int, 258, 2**32 - 1)  # 256 bytes + EOT at least; ids are stored as uint32 at most


# per source: train shards (None: until the source runs out), tokens a train shard, tokens in the val shard
DEFAULTS = {
    "fineweb": {"shards": 1, "shard_tokens": 100_000_000, "val_tokens": 10_000_000},
    "local": {"shards": None, "shard_tokens": 100_000_000, "val_tokens": 10_000_000},
    "demo": {"shards": None, "shard_tokens": 100_000, "val_tokens": 50_000},
}


@dataclass(frozen=True)
class Job:
    """What the command line asks for, resolved."""

    kind: str  # fineweb, demo or local
    out: Path
    files: list[Path]  # local ones
    documents: Callable[[], Iterator[str]]  # the source's documents from the first (fineweb: opens the stream)
    target_shards: int | None  # None: until the source runs out

    @property
    def source(self) -> str | list[str]:
        return [str(f) for f in self.files] if self.files else self.kind


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m scripts.prepare_fineweb",
        description="Tokenize FineWeb-Edu-Dedup, the offline demo corpus, or local files into ppt shards.",
        epilog="The demo corpus needs no network: the documentation this Python's standard library ships, about 3 MB "
        "(the help() topics; the docstrings of every public module, class, function and method that imports here; "
        "the modules' source comments), in a fixed shuffled order of documents, the first of which form the val "
        "split. It is the same on every run with the same Python build.",
    )
    p.add_argument("--source", nargs="+", default=["fineweb"],
                   help="fineweb | demo | local .txt/.jsonl/.parquet files, folders of them, or globs")  # fmt: skip
    p.add_argument("--out", type=Path, help="data directory (default <cache>/data/fineweb-edu, .../demo or .../local)")
    p.add_argument("--shards", type=positive_int, help="train shards (default: 1 for fineweb, all the data otherwise)")
    p.add_argument("--shard-tokens", type=SHARD_TOKENS, help="tokens per train shard (default 100M; demo 100k)")
    p.add_argument("--val-tokens", type=SHARD_TOKENS, help="tokens in the val shard, in whole documents none longer "
                   "than this (default 10M; local files: 5%% of the corpus, at most 10M; demo 50k)")  # fmt: skip
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="tokenizing processes (all cores)")
    p.add_argument("--shuffle-seed", type=nonneg_int, help="local files: shuffle their documents with this seed before "
                   "the val/train split, so val is not just the first files (held in memory)")  # fmt: skip
    g = p.add_argument_group("tokenizer (default: the hub's cosmo2)")
    g.add_argument("--tokenizer", help=f"a hub name (default {DEFAULT_TOKENIZER}) or a local tokenizer.json")
    g.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the local corpus itself")
    g.add_argument("--vocab-size", type=VOCAB_SIZE, help=f"vocabulary of the BPE that --train-tokenizer or the demo "
                   f"trains (default {DEFAULT_VOCAB})")  # fmt: skip
    return p.parse_args(argv)


def val_split_tokens(requested: int | None, corpus: CorpusSize) -> int:
    """The val split of a local corpus: `requested`, checked against the corpus, or VAL_SHARE of it (at most 10M)."""
    if requested is None:
        return max(2, min(DEFAULTS["local"]["val_tokens"], int(corpus.tokens * VAL_SHARE)))
    if requested > corpus.tokens // 2:
        raise PPTError(
            f"the corpus is too small for --val-tokens {requested:,}, more than half of it ({corpus.describe()}); "
            f"lower --val-tokens, e.g. --val-tokens {max(2, int(corpus.tokens * VAL_SHARE))} ({VAL_SHARE:.0%})"
        )
    return requested


def choose_tokenizer(args: argparse.Namespace, job: Job) -> tuple[Tokenizer, dict, CorpusSize | None]:
    """The tokenizer of a fresh data directory, how it was made (for meta.json), and for local files the corpus
    size (exact when training read it whole, else estimated from the files)."""
    vocab = args.vocab_size or DEFAULT_VOCAB
    if job.kind == "demo":
        return train_demo_tokenizer(demo_documents(), vocab), {"kind": "demo", "vocab_size_asked": vocab}, None
    if not args.train_tokenizer:
        name = args.tokenizer or DEFAULT_TOKENIZER
        tokenizer = load_tokenizer(name)
        origin = {"kind": "file" if Path(name).expanduser().exists() else "hub", "from": name}
        if job.kind != "local":
            return tokenizer, origin, None
        text_bytes, exact = estimate_text_bytes(job.files), False
    else:
        counted = {"docs": 0, "bytes": 0}

        def counting() -> Iterator[str]:
            for text in job.documents():
                counted["docs"] += 1
                counted["bytes"] += len(text.encode("utf-8"))
                yield from document_pieces(text)  # the same merges as whole, in bounded memory

        print(f"training a byte-level BPE of vocab {vocab} on the corpus ...", flush=True)
        started = time.perf_counter()
        tokenizer = train_bpe(counting(), vocab, f"corpus-bpe-{vocab}")
        fewer = f" (the corpus holds no more merges; {vocab} were asked for)" if tokenizer.vocab_size < vocab else ""
        print(f"trained {tokenizer.name} in {time.perf_counter() - started:.1f}s: {tokenizer.vocab_size} tokens{fewer}")
        origin = {
            "kind": "trained on this corpus",
            "algorithm": "byte-level BPE (tokenizers BpeTrainer), EOT <|endoftext|> = id 0",
            "vocab_size_asked": vocab,
            "trained_on": f"every document of the source, val included ({counted['docs']:,} documents, "
            f"{counted['bytes']:,} bytes)",
        }
        text_bytes, exact = counted["bytes"], True
    return tokenizer, origin, CorpusSize(len(job.files), text_bytes, exact, bytes_per_token(tokenizer, job.documents()))


def check_options(args: argparse.Namespace, kind: str) -> None:
    """Flags that do not fit the source, refused before anything is read."""
    if kind == "local" and {"fineweb", "demo"} & set(args.source):
        raise PPTError("--source takes fineweb, demo, or local files, not a mix")
    if args.train_tokenizer and args.tokenizer:
        raise PPTError("pass either --tokenizer (an existing one) or --train-tokenizer (a new one), not both")
    if args.train_tokenizer and kind != "local":
        own = "trains its own" if kind == "demo" else "takes cosmo2 or --tokenizer"
        raise PPTError(f"--train-tokenizer trains on local files; --source {kind} {own}")
    if kind == "demo" and args.tokenizer:
        raise PPTError("--source demo trains its own tokenizer; drop --tokenizer (or --vocab-size sets its size)")
    if args.vocab_size and kind != "demo" and not args.train_tokenizer:
        raise PPTError("--vocab-size is the size of a tokenizer prepare trains: add --train-tokenizer, or drop it")
    if args.shuffle_seed is not None and kind != "local":
        raise PPTError(f"--shuffle-seed shuffles local files; --source {kind} comes in its own fixed order")


def remaining_tokens(meta: dict, target_shards: int | None, corpus: CorpusSize | None) -> int | None:
    """Tokens still to write, where known: up to the target shard count, or to the end of a measured corpus."""
    if target_shards is not None:
        val = 0 if meta["val"]["shards"] else meta["settings"]["val_tokens"]
        return val + (target_shards - meta["train"]["shards"]) * meta["settings"]["shard_tokens"]
    return None if corpus is None else corpus.tokens - meta["val"]["tokens"] - meta["train"]["tokens"]


def check_free_space(out: Path, meta: dict, tokens: int | None) -> None:
    if tokens is None:
        return
    needed = tokens * token_dtype(meta["tokenizer"]["vocab_size"]).itemsize
    free = shutil.disk_usage(next(p for p in (out, *out.parents) if p.exists())).free
    if free < needed:
        free_text, needed_text = format_sizes(free, needed)
        raise PPTError(
            f"only {free_text} free under {out}, and the shards need about {needed_text}; free space, pass --out on a "
            "larger disk, or prepare fewer --shards"
        )


class Progress:
    """A tqdm bar on a terminal; elsewhere (nohup, a batch scheduler) a line every PROGRESS_EVERY_S seconds with the
    shards written, the tokens, the rate and, where the total is known, the time left."""

    def __init__(self, total: int | None) -> None:
        self.total, self.tokens = total, 0
        self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="tokenizing", disable=not sys.stderr.isatty())
        self.started = self.last = time.perf_counter()

    def update(self, tokens: int, shards: int) -> None:
        self.tokens += tokens
        now = time.perf_counter()
        self.bar.update(tokens)
        if self.bar.disable and now - self.last >= PROGRESS_EVERY_S:
            self.last, rate = now, self.tokens / max(now - self.started, 1e-9)
            of, eta = "", "unknown"
            if self.total is not None:
                of, eta = f" of about {self.total:,}", duration(max(self.total - self.tokens, 0) / max(rate, 1e-9))
            line = f"tokenizing: {shards} shards written, {self.tokens:,}{of} tokens, {rate:,.0f} tokens/s, ETA {eta}"
            print(line, file=sys.stderr, flush=True)


def prepare(args: argparse.Namespace) -> None:
    kind = args.source[0] if args.source in (["fineweb"], ["demo"]) else "local"
    check_options(args, kind)
    out = (args.out or default_data_dir(kind)).expanduser()
    if out.exists() and not out.is_dir():
        raise PPTError(f"--out {out} is a file; pass a directory (it is created if missing)")
    files = resolve_local_files(args.source) if kind == "local" else []
    if kind == "local":
        documents = local_document_source(files, args.shuffle_seed)
    else:
        documents = open_fineweb if kind == "fineweb" else lambda: iter(demo_documents())
    job = Job(kind, out, files, documents, args.shards or DEFAULTS[kind]["shards"])
    made = [d for d in (out, *out.parents) if not d.exists()]  # removed again if this prepare leaves them empty
    previous = read_meta(out) if (out / "meta.json").is_file() else None  # a killed prepare may have left no shard
    resume = previous is not None and previous["val"]["shards"] + previous["train"]["shards"] > 0
    fresh = None if resume else plan(args, job)  # settled before any directory is made
    lock = lock_directory(out, "pass another --out")  # one prepare per directory
    try:
        prepare_into(args, job, fresh)
    finally:
        lock.release()
        for directory in made:
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def plan(args: argparse.Namespace, job: Job) -> tuple[Tokenizer, dict, CorpusSize | None]:
    """A new data directory's tokenizer and meta.json, and for local files the corpus size; checked, disk space too."""
    if not (job.out / "meta.json").is_file() and any(job.out.glob("*.bin")):
        raise PPTError(f"{job.out} holds shards but no meta.json; delete them or pass another --out")
    tokenizer, origin, corpus = choose_tokenizer(args, job)
    shard_tokens = args.shard_tokens or DEFAULTS[job.kind]["shard_tokens"]
    val_tokens = args.val_tokens or DEFAULTS[job.kind]["val_tokens"]
    if corpus:
        val_tokens = val_split_tokens(args.val_tokens, corpus)
        print(f"corpus: {corpus.describe()}; val split {val_tokens:,} tokens, the rest train")
    meta = new_meta(job.source, tokenizer, shard_tokens, val_tokens, args.shuffle_seed, origin)
    check_free_space(job.out, meta, remaining_tokens(meta, job.target_shards, corpus))
    return tokenizer, meta, corpus


def resumed_tokenizer(args: argparse.Namespace, job: Job, meta: dict) -> Tokenizer:
    """The tokenizer that made the finished shards, once the flags are checked against what made them."""
    tokenizer = load_data_tokenizer(job.out)
    if job.kind == "demo" and tokenizer.vocab_size != (args.vocab_size or DEFAULT_VOCAB):
        raise PPTError(f"{job.out} holds a demo tokenizer of vocab {tokenizer.vocab_size}; pass another --out")
    origin = meta["tokenizer"]["origin"] or {}
    trained = origin.get("kind") == "trained on this corpus"
    if args.train_tokenizer and (not trained or args.vocab_size not in (None, origin.get("vocab_size_asked"))):
        raise PPTError(
            f"{job.out} was prepared with tokenizer {tokenizer.name}, not one trained here with these settings; "
            "pass another --out, or delete the directory to start over"
        )
    requested = load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer
    shard_tokens = args.shard_tokens or meta["settings"]["shard_tokens"]
    val_tokens = args.val_tokens or meta["settings"]["val_tokens"]
    expected = new_meta(job.source, requested, shard_tokens, val_tokens, args.shuffle_seed)
    check_resumable(job.out, meta, expected)
    return tokenizer


def prepare_into(args: argparse.Namespace, job: Job, fresh: tuple[Tokenizer, dict, CorpusSize | None] | None) -> None:
    out, target_shards = job.out, job.target_shards
    if fresh is not None:
        tokenizer, meta, corpus = fresh
    else:  # resume with the tokenizer and settings that made the finished shards, rebuilding any lost since
        meta, corpus = read_meta(out), None
        tokenizer = resumed_tokenizer(args, job, meta)
        recorded = meta["train"]["shards"]
        roll_back_to_damaged(out, meta)
        target_shards = None if target_shards is None else max(target_shards, recorded)  # rebuild all recorded
        if ShardWriter.finished(meta, target_shards):
            print(f"{out} is already prepared ({recorded} train shards + val); nothing to do")
            return
        print(f"resuming {out}: {meta['train']['shards']} train shards done")
        check_free_space(out, meta, remaining_tokens(meta, target_shards, corpus))

    writer = ShardWriter(out, meta, tokenizer, target_shards)
    with worker_pool(tokenizer, args.workers) as pool:  # before the source opens: forking needs no threads yet
        stream = job.documents()
        # the documents the finished shards hold are skipped, their digests kept: their copies are dropped too
        writer.remember(itertools.islice(stream, meta["val"]["docs_consumed"] + meta["train"]["docs_consumed"]))
        remove_leftovers(out, meta)
        meta["progress"]["complete"] = False  # until this run finishes (written with the next shard)
        start = time.perf_counter()
        progress = Progress(remaining_tokens(meta, target_shards, corpus))
        try:
            for lengths, tokens, digests in encode_in_order(
                batched(stream, DOCS_PER_TASK), tokenizer, pool, args.workers
            ):
                writer.feed(lengths, tokens, digests)
                progress.update(tokens.size, meta["val"]["shards"] + meta["train"]["shards"])
                if writer.done:
                    break
            else:
                writer.finish()
        finally:
            progress.bar.close()
    meta["progress"]["complete"] = True
    writer.write_meta()
    elapsed = time.perf_counter() - start
    val, train = meta["val"], meta["train"]
    print(
        f"wrote {writer.tokens_written:,} tokens in {elapsed:.1f}s ({writer.tokens_written / elapsed:,.0f} tokens/s, "
        f"{args.workers} workers); {out} now has {train['shards']} train shards ({train['tokens']:,} tokens) and a "
        f"val shard ({val['tokens']:,} tokens); exact-duplicate documents dropped: {train['duplicates_of_val']:,} "
        f"copies of val documents in train, {train['duplicates'] - train['duplicates_of_val']:,} repeats within "
        f"train, {val['duplicates']:,} within val"
    )
    print(f"train on it: python -m scripts.base_train --data-dir {out} --config CONFIG --tag NAME")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not sys.stderr.isatty():  # a bar redrawn into a log is one endless line: the hub's and datasets' bars are off
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when the library is imported,
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if "huggingface_hub" in sys.modules:  # so one imported already (by a caller of main) is told directly
            importlib.import_module("huggingface_hub.utils").disable_progress_bars()
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
    on_kill = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops as cleanly as Ctrl-C: the workers go too
    try:
        prepare(args)
    except PPTError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished shards are kept, re-run the same command to resume", file=sys.stderr)
        return 130
    finally:
        release_locks()
        signal.signal(signal.SIGTERM, on_kill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
