"""Tokenize a corpus into ppt shards (format: ppt/data.py).

    python -m scripts.prepare_fineweb --shards 200             # FineWeb-Edu-Dedup, ~20B train tokens
    python -m scripts.prepare_fineweb --source demo            # offline: the stdlib's own documentation, seconds
    python -m scripts.prepare_fineweb --source 'corpus/*.jsonl' --out /data/mine
    python -m scripts.prepare_fineweb --source ~/books --train-tokenizer --vocab-size 8192 --shuffle-seed 0 \
        --out ~/.cache/ppt/data/books                          # your own corpus, its own tokenizer, no hub

Sources: `fineweb` streams HuggingFaceTB/smollm-corpus (config fineweb-edu-dedup); `demo` uses the documentation
the Python running this script ships (see `demo_documents`: about 3 MB, 0.85M tokens at vocab 4096) and trains its
own small BPE on it; anything else is local files, folders (every .txt/.jsonl/.parquet file under them) or globs:
`.txt` is one document per file (UTF-8), `.jsonl` one per line (its `text` field), `.parquet` one per row (its `text`
column). Empty documents are skipped. The val shard holds the first documents of the stream (after --shuffle-seed,
if given) and the train shards the documents after them, so they never overlap; a shard closes at the first document
boundary past its size. For local files the val split defaults to 5% of the corpus (at most 10M tokens), sized
before anything is tokenized from the corpus size and the tokenizer's bytes per token on its first megabyte.

Tokenizers: cosmo2 from the hub by default; `--tokenizer path/to/tokenizer.json` for a local one; or
`--train-tokenizer --vocab-size N` to train a byte-level BPE on the corpus itself (all of it, val included). meta.json
records which, and how it was made.

Interrupted runs resume: shards are written atomically and meta.json counts the documents the finished shards
consumed, so a rerun skips exactly those and continues. Rerunning a finished prepare does nothing; rerunning it
with a larger --shards adds shards. One prepare at a time per --out: a second one stops with the first one's pid.
Progress shows as a bar on a terminal, and as a line every minute otherwise (nohup, batch jobs).
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import inspect
import io
import itertools
import json
import math
import multiprocessing
import os
import pkgutil
import random
import shutil
import signal
import sys
import time
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tqdm import tqdm

from ppt.common import (
    MAX_TOKENS,
    ArgumentParser,
    Number,
    PPTError,
    format_sizes,
    lock_directory,
    nonneg_int,
    positive_int,
    release_locks,
)
from ppt.data import default_data_dir, load_data_tokenizer, read_meta, shard_path, token_dtype, write_meta, write_shard
from ppt.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer, train_bpe, train_demo_tokenizer

FINEWEB_REPO, FINEWEB_CONFIG = "HuggingFaceTB/smollm-corpus", "fineweb-edu-dedup"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
DOCS_PER_TASK = 256  # documents per worker task: big enough to amortize pickling, small enough to keep order cheap
META_FORMAT = 1
PROGRESS_EVERY_S = 60.0  # seconds between progress lines when stderr is not a terminal (tests lower it)
DEFAULT_VOCAB = 4096  # of a BPE trained here (the demo's, or --train-tokenizer's)
VAL_SHARE = 0.05  # of a local corpus, for the default val split
SAMPLE_BYTES = 1_000_000  # text tokenized up front to measure bytes per token
SHUFFLE_MAX_BYTES = 4_000_000_000  # --shuffle-seed holds the corpus in memory
SHARD_TOKENS = Number(int, 2, MAX_TOKENS, scientific=True)
VOCAB_SIZE = Number(int, 258, 2**32 - 1)  # 256 bytes + EOT at least; ids are stored as uint32 at most


@dataclass(frozen=True)
class Defaults:
    shards: int | None  # None: until the source runs out
    shard_tokens: int
    val_tokens: int


DEFAULTS = {
    "fineweb": Defaults(shards=1, shard_tokens=100_000_000, val_tokens=10_000_000),
    "local": Defaults(shards=None, shard_tokens=100_000_000, val_tokens=10_000_000),
    "demo": Defaults(shards=None, shard_tokens=100_000, val_tokens=50_000),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m scripts.prepare_fineweb",
        description="Tokenize FineWeb-Edu-Dedup, the offline demo corpus, or local files into ppt shards.",
        epilog="The demo corpus needs no network: the documentation this Python's standard library ships, about 3 MB "
        "(the help() topics; the docstrings of every public module, class, function and method that imports here; "
        "the modules' source comments), in a fixed shuffled order of documents, the first of which form the val "
        "split. It is the same on every run with the same Python build.",
    )
    p.add_argument(
        "--source",
        nargs="+",
        default=["fineweb"],
        help="fineweb | demo | local .txt/.jsonl/.parquet files, folders of them, or globs",
    )
    p.add_argument("--out", type=Path, help="data directory (default <cache>/data/fineweb-edu, .../demo or .../local)")
    p.add_argument(
        "--shards", type=positive_int, help="train shards to write (default: 1 for fineweb, all the data otherwise)"
    )
    p.add_argument("--shard-tokens", type=SHARD_TOKENS, help="tokens per train shard (default 100M; demo 100k)")
    p.add_argument(
        "--val-tokens",
        type=SHARD_TOKENS,
        help="tokens in the val shard (default 10M; local files: 5%% of the corpus, at most 10M; demo 50k)",
    )
    p.add_argument(
        "--workers", type=positive_int, default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)"
    )
    p.add_argument(
        "--shuffle-seed",
        type=nonneg_int,
        help="local files: shuffle their documents with this seed before the val/train split, so val is not just "
        "the first files (the corpus is held in memory; default: the files' order)",
    )
    g = p.add_argument_group("tokenizer (default: the hub's cosmo2)")
    g.add_argument("--tokenizer", help=f"a hub name (default {DEFAULT_TOKENIZER}) or a local tokenizer.json")
    g.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a byte-level BPE of --vocab-size on the local corpus itself (no hub needed)",
    )
    g.add_argument(
        "--vocab-size",
        type=VOCAB_SIZE,
        help=f"vocabulary of the BPE that --train-tokenizer or the demo trains (default {DEFAULT_VOCAB})",
    )
    return p.parse_args(argv)


# ---- documents ---------------------------------------------------------------------------------------------------


def resolve_local_files(patterns: list[str]) -> list[Path]:
    """Expand paths, folders and globs in argument order (each glob and folder sorted); every pattern must give a
    supported file. A folder gives every .txt/.jsonl/.parquet file under it (hidden ones aside)."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern]
        matches = [os.path.expanduser(match) for match in matches]
        if not matches or not Path(matches[0]).exists():
            raise PPTError(f"--source {pattern!r} matches no file; pass fineweb, demo, or existing local files")
        for match in matches:
            path = Path(match).resolve()
            if path.is_dir():
                found = _folder_files(path)
                if not found:
                    raise PPTError(f"{path} holds no {', '.join(LOCAL_SUFFIXES)} files; pass a folder with some")
                files += found
                continue
            if path.suffix not in LOCAL_SUFFIXES:
                raise PPTError(f"{path}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)} files")
            files.append(path)
    return files


def _folder_files(folder: Path) -> list[Path]:
    """The supported files under a folder, sorted by path; says which other files it leaves out."""
    hidden = lambda path: any(part.startswith(".") for part in path.relative_to(folder).parts)  # noqa: E731
    visible = [path for path in sorted(folder.rglob("*")) if path.is_file() and not hidden(path)]
    others = [p for p in visible if p.suffix not in LOCAL_SUFFIXES]
    if others:
        kinds = ", ".join(sorted({p.suffix or "(no suffix)" for p in others}))
        print(f"note: {folder}: left out {len(others)} files that are not {', '.join(LOCAL_SUFFIXES)} ({kinds})")
    return [p for p in visible if p.suffix in LOCAL_SUFFIXES]


# Modules never imported for the demo corpus: they act on import (open a browser, print, start a GUI, read config
# files, set up the terminal), are deprecated shims whose content depends on what else is installed, or are tests.
DEMO_SKIP_MODULES = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "readline", "lib2to3", "distutils"}
DEMO_SKIP_MODULES |= {"pydoc_data"}  # its topics are taken whole, not as a module
DEMO_SKIP_PARTS = {"test", "tests", "idle_test"}
MIN_DEMO_TEXT = 20  # characters: shorter docstrings and comments ("Return self==value.") carry little text


def demo_documents() -> list[str]:
    """The offline demo corpus: the documentation Python's standard library ships, about 3 MB (0.85M tokens at
    vocab 4096 on CPython 3.11), built in about a second.

    The `help()` topics of `pydoc_data.topics` (one document per topic), and one document per public stdlib module
    that imports here: the docstrings of the module and of its public classes, functions and methods, each under a
    heading with its name and parameter names, then the module source's comments. Every text appears once. The
    documents come in a fixed shuffled order, so the val split (the first documents) mixes both kinds. The same on
    every run with one Python build; built once per process (tokenizer training reads it, then the encoder).
    """
    return list(_demo_corpus())


@functools.cache
def _demo_corpus() -> tuple[str, ...]:
    from pydoc_data.topics import topics  # the stdlib's help() text: always present, no network

    seen: set[str] = set()  # every text once: shared and inherited docstrings repeat across modules
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules and attributes warn when imported or read
        modules = [_module_document(name, seen) for name in _stdlib_module_names()]
    documents = [*dict.fromkeys(topics[key] for key in sorted(topics)), *(doc for doc in modules if doc)]
    random.Random(0).shuffle(documents)  # a fixed mix, so the val split (the first documents) has both kinds
    return tuple(documents)


def _quiet_import(name: str) -> types.ModuleType | None:
    """Import a stdlib module for its docstrings; None when it is missing on this platform or fails to import."""
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            return importlib.import_module(name)
    except Exception:  # absent C extensions, other platforms' modules: skipped, the corpus is what imports here
        return None


def _stdlib_module_names() -> list[str]:
    """Public stdlib modules and their public submodules that import here, sorted by name."""

    def public(name: str) -> bool:
        return not any(part.startswith("_") or part in DEMO_SKIP_PARTS for part in name.split("."))

    found = []
    pending = sorted(name for name in sys.stdlib_module_names if public(name) and name not in DEMO_SKIP_MODULES)
    while pending:
        name = pending.pop()
        module = _quiet_import(name)
        if module is None:
            continue
        found.append(name)
        submodules = pkgutil.iter_modules(getattr(module, "__path__", []), prefix=f"{name}.")
        pending += [info.name for info in submodules if public(info.name)]
    return sorted(found)


def _module_document(name: str, seen: set[str]) -> str:
    """A module's docstrings, each under a `class`/`def` heading with parameter names, then its source comments."""
    module = sys.modules[name]
    parts = []

    def add(heading: str, text: object) -> None:
        if isinstance(text, str) and len(text := inspect.cleandoc(text).strip()) >= MIN_DEMO_TEXT and text not in seen:
            seen.add(text)
            parts.append(f"{heading}\n{text}")

    add(f"module {name}", module.__doc__)
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        add(f"{'class' if inspect.isclass(obj) else 'def'} {name}.{attr}{_parameters(obj)}", obj.__doc__)
        if inspect.isclass(obj):
            for member_name, member in sorted(vars(obj).items()):
                is_documented_member = inspect.isroutine(member) or inspect.isdatadescriptor(member)
                if is_documented_member and (member_name == "__init__" or not member_name.startswith("_")):
                    add(f"def {attr}.{member_name}{_parameters(member)}", member.__doc__)
    comments = _source_comments(getattr(module, "__file__", None), seen)
    if comments:
        parts.append("comments in the source of " + name + "\n" + "\n\n".join(comments))
    return "\n\n".join(parts)


def _parameters(obj: object) -> str:
    """`(a, b, *args)`: parameter names only. Default values are left out: their reprs can hold anything, even the
    process environment (a default of `os.environ`), which has no place in a corpus."""
    try:
        signature = inspect.signature(obj)
    except Exception:  # builtins without a text signature, descriptors: no parameter list
        return ""
    bare = [p.replace(default=p.empty, annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=signature.empty))


def _source_comments(path: str | None, seen: set[str]) -> list[str]:
    """Paragraphs of consecutive full-line `#` comments in a module's Python source."""
    if not path or not path.endswith(".py"):
        return []
    paragraphs, block = [], []
    for line in [*Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            block.append(stripped.lstrip("#").strip())
            continue
        text = "\n".join(block).strip()
        block = []
        if len(text) >= MIN_DEMO_TEXT and text not in seen:
            seen.add(text)
            paragraphs.append(text)
    return paragraphs


def _utf8_error(path: Path, byte_offset: int) -> PPTError:
    return PPTError(
        f"{path} is not valid UTF-8 (byte offset {byte_offset}); re-encode it to UTF-8, "
        f"e.g. `iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`"
    )


def _txt_documents(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _utf8_error(path, exc.start) from exc
    yield text


def _jsonl_documents(path: Path) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(path, offset + exc.start) from exc
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PPTError(f"{path}:{line_number} is not valid JSON ({exc.msg}); fix or remove that line") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise PPTError(f'{path}:{line_number} has no string `text` field; each line must be {{"text": ...}}')
            yield record["text"]


def _parquet_documents(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise PPTError(f"{path} has no `text` column (columns: {', '.join(parquet.schema_arrow.names)})")
    for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or ""


def local_documents(files: list[Path]) -> Iterator[str]:
    readers = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}
    for path in files:
        yield from readers[path.suffix](path)


def open_fineweb(skip: int) -> Iterator[str]:
    """Stream FineWeb-Edu-Dedup from the hub; with HF_HUB_OFFLINE set, read a dataset already in the HF cache.

    Opens the dataset now, so an unreachable hub fails before anything is written.
    """
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    how_to_work_offline = (
        "to work offline use `--source demo`, or local .txt/.jsonl/.parquet files, or set HF_HUB_OFFLINE=1 "
        "with the dataset already in the Hugging Face cache"
    )
    try:
        import datasets  # lazy: importing this script never touches the network

        dataset = datasets.load_dataset(FINEWEB_REPO, FINEWEB_CONFIG, split="train", streaming=not offline)
    except Exception as exc:  # connection, auth, missing cache: all mean "cannot get the data"
        raise PPTError(f"cannot open {FINEWEB_REPO} ({FINEWEB_CONFIG}): {exc}; {how_to_work_offline}") from exc
    if skip:
        dataset = dataset.skip(skip)

    def texts() -> Iterator[str]:
        examples = iter(dataset)
        while True:
            try:
                example = next(examples)
            except StopIteration:
                return
            except Exception as exc:
                raise PPTError(
                    f"lost {FINEWEB_REPO} while streaming ({exc}); re-run the same command to resume"
                ) from exc
            yield example["text"]

    return texts()


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


# ---- shards and progress -----------------------------------------------------------------------------------------


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
        "progress": {"docs_consumed": 0, "exhausted": False},
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


# ---- the corpus: tokenizer, size, val split ----------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSize:
    """A local corpus measured before it is tokenized."""

    files: int
    text_bytes: int
    exact: bool  # False: from file sizes and parquet metadata
    bytes_per_token: float  # measured on the first SAMPLE_BYTES of text

    @property
    def tokens(self) -> int:
        return int(self.text_bytes / self.bytes_per_token)

    def describe(self) -> str:
        about = "" if self.exact else "about "
        files = f"{self.files} file{'s' * (self.files != 1)}"
        return (
            f"{files}, {about}{format_sizes(self.text_bytes)[0]} of text, about {self.tokens:,} tokens "
            f"({self.bytes_per_token:.2f} bytes per token on its first {format_sizes(SAMPLE_BYTES)[0]})"
        )


def estimate_text_bytes(files: list[Path]) -> int:
    """Bytes of document text in local files, without reading them whole: a .txt file's size, a .parquet file's
    uncompressed `text` column, a .jsonl file's size times the text's share of the first megabyte of the first one."""
    total, jsonl_share = 0.0, None
    for path in files:
        if path.suffix == ".txt":
            total += path.stat().st_size
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(path).metadata
            columns = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
            if "text" in columns:
                column = columns.index("text")
                groups = range(metadata.num_row_groups)
                total += sum(metadata.row_group(g).column(column).total_uncompressed_size for g in groups)
        else:
            jsonl_share = _jsonl_text_share(path) if jsonl_share is None else jsonl_share
            total += path.stat().st_size * jsonl_share
    return int(total)


def _jsonl_text_share(path: Path) -> float:
    raw = text = 0
    with open(path, "rb") as f:
        for line in f:
            raw += len(line)
            try:
                text += len(json.loads(line)["text"].encode("utf-8"))
            except (ValueError, KeyError, TypeError, AttributeError):
                pass  # the tokenizing pass names bad lines
            if raw >= SAMPLE_BYTES:
                break
    return text / raw if raw else 1.0


def bytes_per_token(tokenizer: Tokenizer, documents: Iterable[str]) -> float:
    """Text bytes per token (EOT included) over the first SAMPLE_BYTES of the documents."""
    sample, size = [], 0
    for text in documents:
        if text.strip():
            piece = text[: SAMPLE_BYTES - size]  # characters: at least as many bytes
            sample.append(piece)
            size += len(piece.encode("utf-8"))
        if size >= SAMPLE_BYTES:
            break
    if not sample:
        raise PPTError("the corpus has no documents (or only empty ones); check --source")
    return size / sum(len(ids) for ids in tokenizer.encode_batch(sample))


def val_split_tokens(requested: int | None, corpus: CorpusSize) -> int:
    """The val split of a local corpus: `requested`, checked against the corpus, or VAL_SHARE of it (at most 10M)."""
    if requested is None:
        return max(2, min(DEFAULTS["local"].val_tokens, int(corpus.tokens * VAL_SHARE)))
    if requested > corpus.tokens // 2:
        raise PPTError(
            f"the corpus is too small for --val-tokens {requested:,}, more than half of it ({corpus.describe()}); "
            f"lower --val-tokens, e.g. --val-tokens {max(2, int(corpus.tokens * VAL_SHARE))} ({VAL_SHARE:.0%})"
        )
    return requested


def choose_tokenizer(
    args: argparse.Namespace, kind: str, files: list[Path], documents: Callable[[], Iterator[str]] | None
) -> tuple[Tokenizer, dict, CorpusSize | None]:
    """The tokenizer of a fresh data directory, how it was made (for meta.json), and for local files the corpus
    size (exact when training read it whole, else estimated from the files)."""
    if kind == "demo":
        vocab = args.vocab_size or DEFAULT_VOCAB
        return train_demo_tokenizer(demo_documents(), vocab), {"kind": "demo", "vocab_size_asked": vocab}, None
    if not args.train_tokenizer:
        name = args.tokenizer or DEFAULT_TOKENIZER
        tokenizer = load_tokenizer(name)
        origin = {"kind": "file" if Path(name).expanduser().exists() else "hub", "from": name}
        if kind != "local":
            return tokenizer, origin, None
        estimate = CorpusSize(len(files), estimate_text_bytes(files), False, bytes_per_token(tokenizer, documents()))
        return tokenizer, origin, estimate
    vocab = args.vocab_size or DEFAULT_VOCAB
    counted = {"docs": 0, "bytes": 0}

    def counting() -> Iterator[str]:
        for text in documents():
            counted["docs"] += 1
            counted["bytes"] += len(text.encode("utf-8"))
            yield text

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
    return tokenizer, origin, CorpusSize(len(files), counted["bytes"], True, bytes_per_token(tokenizer, documents()))


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


def local_document_source(files: list[Path], shuffle_seed: int | None) -> Callable[[], Iterator[str]]:
    """A function giving the documents of local files from the start, each time in the same order: the files'
    order, or with `shuffle_seed` a seeded shuffle of all documents, held in memory."""
    if shuffle_seed is None:
        return lambda: local_documents(files)
    text_bytes = estimate_text_bytes(files)
    if text_bytes > SHUFFLE_MAX_BYTES:
        raise PPTError(
            f"--shuffle-seed holds the corpus in memory, and it has about {format_sizes(text_bytes)[0]} of text "
            f"(at most {format_sizes(SHUFFLE_MAX_BYTES)[0]}); shuffle its files or lines beforehand instead"
        )
    documents = list(local_documents(files))
    random.Random(shuffle_seed).shuffle(documents)
    return lambda: iter(documents)


def check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if free < needed:
        free_text, needed_text = format_sizes(free, needed)
        raise PPTError(
            f"only {free_text} free under {out}, and the shards need about {needed_text}; free space, pass --out on a "
            "larger disk, or prepare fewer --shards"
        )


# ---- progress ----------------------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal; elsewhere (nohup, a batch scheduler) a line every PROGRESS_EVERY_S seconds with the
    shards written, the tokens, the rate and, where the total is known, the time left."""

    def __init__(self, total: int | None) -> None:
        self.total, self.tokens = total, 0
        self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="tokenizing") if sys.stderr.isatty() else None
        self.started = self.last = time.perf_counter()

    def update(self, tokens: int, shards: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(tokens)
            return
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.tokens / max(now - self.started, 1e-9)
        left = "unknown" if self.total is None else _clock(max(self.total - self.tokens, 0) / max(rate, 1e-9))
        of = "" if self.total is None else f" of about {self.total:,}"
        print(
            f"tokenizing: {shards} shards written, {self.tokens:,}{of} tokens, {rate:,.0f} tokens/s, ETA {left}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    seconds = int(seconds) if math.isfinite(seconds) else 0
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ---- main --------------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> None:
    kind = args.source[0] if args.source in (["fineweb"], ["demo"]) else "local"
    check_options(args, kind)
    out = (args.out or default_data_dir(kind)).expanduser()
    files = resolve_local_files(args.source) if kind == "local" else []
    if out.exists() and not out.is_dir():
        raise PPTError(f"--out {out} is a file; pass a directory (it is created if missing)")
    created = not out.exists()
    lock = lock_directory(out, "pass another --out")  # one prepare per directory
    try:
        prepare_into(args, kind, out, files)
    finally:
        lock.release()
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # failed before writing anything: leave nothing behind


def prepare_into(args: argparse.Namespace, kind: str, out: Path, files: list[Path]) -> None:
    defaults = DEFAULTS[kind]
    source: str | list[str] = [str(f) for f in files] if files else kind
    documents: Callable[[], Iterator[str]] | None = None  # fineweb: streamed from the hub instead (open_fineweb)
    if kind == "local":
        documents = local_document_source(files, args.shuffle_seed)
    elif kind == "demo":
        documents = lambda: iter(demo_documents())  # noqa: E731
    target_shards = args.shards if args.shards is not None else defaults.shards

    meta = read_meta(out) if (out / "meta.json").is_file() else None
    fresh = meta is None or not (meta["val"]["shards"] or meta["train"]["shards"])
    corpus = None
    if fresh:
        if meta is None and any(out.glob("*.bin")):
            raise PPTError(f"{out} holds shards but no meta.json; delete them or pass another --out")
        tokenizer, origin, corpus = choose_tokenizer(args, kind, files, documents)
        shard_tokens = args.shard_tokens or defaults.shard_tokens
        val_tokens = val_split_tokens(args.val_tokens, corpus) if corpus else args.val_tokens or defaults.val_tokens
        if corpus:
            print(f"corpus: {corpus.describe()}; val split {val_tokens:,} tokens, the rest train")
        meta = new_meta(source, tokenizer, shard_tokens, val_tokens, args.shuffle_seed, origin)
    else:  # resume with the tokenizer that made the finished shards and the settings they were made with
        tokenizer = load_data_tokenizer(out)
        if kind == "demo" and tokenizer.vocab_size != (args.vocab_size or DEFAULT_VOCAB):
            raise PPTError(f"{out} holds a demo tokenizer of vocab {tokenizer.vocab_size}; pass another --out")
        origin = meta["tokenizer"].get("origin", {})
        trained = origin.get("kind") == "trained on this corpus"
        if args.train_tokenizer and (not trained or args.vocab_size not in (None, origin.get("vocab_size_asked"))):
            raise PPTError(
                f"{out} was prepared with tokenizer {tokenizer.name}, not one trained here with these settings; "
                "pass another --out, or delete the directory to start over"
            )
        requested = load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer
        settings = meta["settings"]
        shard_tokens = args.shard_tokens or settings["shard_tokens"]
        val_tokens = args.val_tokens or settings["val_tokens"]
        check_resumable(out, meta, new_meta(source, requested, shard_tokens, val_tokens, args.shuffle_seed))
        if ShardWriter.finished(meta, target_shards):
            print(f"{out} is already prepared ({meta['train']['shards']} train shards + val); nothing to do")
            return
        done, skip = meta["train"]["shards"], meta["progress"]["docs_consumed"]
        print(f"resuming {out}: {done} train shards done, skipping the {skip:,} documents they hold")

    writer = ShardWriter(out, meta, tokenizer, target_shards)
    remaining = None
    if target_shards is not None:
        remaining = (0 if writer.val is None else val_tokens) + (target_shards - meta["train"]["shards"]) * shard_tokens
    elif corpus is not None:
        remaining = corpus.tokens - meta["val"]["tokens"] - meta["train"]["tokens"]
    if remaining is not None:
        check_free_space(out, remaining * token_dtype(tokenizer.vocab_size).itemsize)
    with worker_pool(tokenizer, args.workers) as pool:  # before the source opens: forking needs no threads yet
        skip = meta["progress"]["docs_consumed"]
        stream = open_fineweb(skip) if documents is None else itertools.islice(documents(), skip, None)
        if fresh:  # after the source opened: an unreachable hub leaves no trace
            with disk_errors(out / "meta.json", writer.shard_bytes()):
                tokenizer.save(out)
                write_meta(out, meta)
        remove_leftovers(out, meta)

        start = time.perf_counter()
        encoded = encode_in_order(batched(stream, DOCS_PER_TASK), tokenizer, pool, args.workers)
        progress = Progress(remaining)
        try:
            for lengths, tokens in encoded:
                writer.feed(lengths, tokens)
                progress.update(tokens.size, meta["val"]["shards"] + meta["train"]["shards"])
                if writer.done:
                    break
            else:
                writer.finish()
        except BaseException:
            if fresh and meta["train"]["shards"] == 0:  # failed before the first shard: leave no half-made dir
                for name in ("meta.json", "tokenizer.json"):
                    (out / name).unlink(missing_ok=True)
            raise
        finally:
            progress.close()
    elapsed = time.perf_counter() - start
    print(
        f"wrote {writer.tokens_written:,} tokens in {elapsed:.1f}s ({writer.tokens_written / elapsed:,.0f} tokens/s, "
        f"{args.workers} workers); {out} now has {meta['train']['shards']} train shards "
        f"({meta['train']['tokens']:,} tokens) and a val shard ({meta['val']['tokens']:,} tokens)"
    )
    print(f"train on it: python -m scripts.base_train --data-dir {out} --config CONFIG --tag NAME")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
