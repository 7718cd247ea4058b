"""Tokenize a corpus into ppt shards (format: ppt/data.py).

    python -m scripts.prepare_fineweb --shards 200             # FineWeb-Edu-Dedup, ~20B train tokens
    python -m scripts.prepare_fineweb --source demo            # offline: the stdlib's own documentation, seconds
    python -m scripts.prepare_fineweb --source 'corpus/*.jsonl' --out /data/mine

Sources: `fineweb` streams HuggingFaceTB/smollm-corpus (config fineweb-edu-dedup); `demo` uses the documentation
the Python running this script ships (see `demo_documents`: about 3 MB, 0.85M tokens at vocab 4096) and trains its
own small BPE on it; anything else is local paths or globs:
`.txt` is one document per file (UTF-8), `.jsonl` one per line (its `text` field), `.parquet` one per row (its `text`
column). Empty documents are skipped. The val shard holds the first documents of the stream and the train shards
the documents after them, so they never overlap; a shard closes at the first document boundary past its size.

Interrupted runs resume: shards are written atomically and meta.json counts the documents the finished shards
consumed, so a rerun skips exactly those and continues. Rerunning a finished prepare does nothing; rerunning it
with a larger --shards adds shards.
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
import multiprocessing
import os
import pkgutil
import random
import signal
import sys
import time
import types
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tqdm import tqdm

from ppt.common import PPTError
from ppt.data import default_data_dir, load_data_tokenizer, read_meta, shard_path, token_dtype, write_meta, write_shard
from ppt.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer, train_demo_tokenizer

FINEWEB_REPO, FINEWEB_CONFIG = "HuggingFaceTB/smollm-corpus", "fineweb-edu-dedup"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
DOCS_PER_TASK = 256  # documents per worker task: big enough to amortize pickling, small enough to keep order cheap
META_FORMAT = 1


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
    p = argparse.ArgumentParser(
        prog="python -m scripts.prepare_fineweb",
        description="Tokenize FineWeb-Edu-Dedup, the offline demo corpus, or local files into ppt shards.",
        epilog="The demo corpus needs no network: the documentation this Python's standard library ships, about 3 MB "
        "(the help() topics; the docstrings of every public module, class, function and method that imports here; "
        "the modules' source comments), in a fixed shuffled order of documents, the first of which form the val "
        "split. It is the same on every run with the same Python build.",
    )
    p.add_argument(
        "--source", nargs="+", default=["fineweb"], help="fineweb | demo | local .txt/.jsonl/.parquet paths or globs"
    )
    p.add_argument("--out", type=Path, help="data directory (default <cache>/data/fineweb-edu, .../demo or .../local)")
    p.add_argument("--shards", type=int, help="train shards to write (default: 1 for fineweb, all the data otherwise)")
    p.add_argument("--shard-tokens", type=int, help="tokens per train shard (default 100M; demo 100k)")
    p.add_argument("--val-tokens", type=int, help="tokens in the val shard (default 10M; demo 50k)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="hub name or local tokenizer.json (not for demo)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocab of the demo tokenizer (demo only)")
    return p.parse_args(argv)


# ---- documents ---------------------------------------------------------------------------------------------------


def resolve_local_files(patterns: list[str]) -> list[Path]:
    """Expand paths and globs in argument order (each glob sorted); every pattern must match a supported file."""
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern))) if glob.has_magic(pattern) else [pattern]
        if not matches or not Path(matches[0]).exists():
            raise PPTError(f"--source {pattern!r} matches no file; pass fineweb, demo, or existing local files")
        for match in matches:
            path = Path(match).resolve()
            if path.suffix not in LOCAL_SUFFIXES:
                raise PPTError(f"{path}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)} files")
            files.append(path)
    return files


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
    with context.Pool(workers, _init_worker, (tokenizer.backend.to_str(), tokenizer.name)) as pool:
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
        write_meta(self.out, self.meta)

    def _write(self, split: str, index: int, array: np.ndarray, buffer: ShardBuffer) -> None:
        tok = self.tokenizer
        write_shard(
            shard_path(self.out, split, index),
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
            raise PPTError(
                f"the corpus is too small: its {self.val.tokens} tokens do not fill the val shard "
                f"(--val-tokens {self.val.target_tokens}) and leave some for training; lower --val-tokens"
            )
        if self.train.docs:
            self.flush()
        self.meta["progress"]["exhausted"] = True
        self.done = True
        write_meta(self.out, self.meta)


def new_meta(source: str | list[str], tokenizer: Tokenizer, shard_tokens: int, val_tokens: int) -> dict:
    return {
        "format": META_FORMAT,
        "source": source,
        "tokenizer": {
            "name": tokenizer.name,
            "fingerprint": tokenizer.fingerprint,
            "is_demo": tokenizer.is_demo,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
        },
        "settings": {"shard_tokens": shard_tokens, "val_tokens": val_tokens},
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


# ---- main --------------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> None:
    kind = args.source[0] if args.source in (["fineweb"], ["demo"]) else "local"
    if kind == "local" and {"fineweb", "demo"} & set(args.source):
        raise PPTError("--source takes fineweb, demo, or local files, not a mix")
    defaults = DEFAULTS[kind]
    shard_tokens = args.shard_tokens or defaults.shard_tokens
    val_tokens = args.val_tokens or defaults.val_tokens
    target_shards = args.shards if args.shards is not None else defaults.shards
    if shard_tokens < 2 or val_tokens < 2 or (target_shards is not None and target_shards < 1):
        raise PPTError("--shard-tokens and --val-tokens must be at least 2 and --shards at least 1")
    out = (args.out or default_data_dir(kind)).expanduser()
    files = resolve_local_files(args.source) if kind == "local" else []
    source: str | list[str] = [str(f) for f in files] if files else kind

    meta = read_meta(out) if (out / "meta.json").is_file() else None
    fresh = meta is None or not (meta["val"]["shards"] or meta["train"]["shards"])
    if fresh:
        if meta is None and out.is_dir() and any(out.glob("*.bin")):
            raise PPTError(f"{out} holds shards but no meta.json; delete them or pass another --out")
        if kind == "demo":
            tokenizer = train_demo_tokenizer(demo_documents(), args.vocab_size)
        else:
            tokenizer = load_tokenizer(args.tokenizer)
        meta = new_meta(source, tokenizer, shard_tokens, val_tokens)
    else:  # resume with the tokenizer that made the finished shards and the settings they were made with
        tokenizer = load_data_tokenizer(out)
        if kind == "demo" and tokenizer.vocab_size != args.vocab_size:
            raise PPTError(f"{out} holds a demo tokenizer of vocab {tokenizer.vocab_size}; pass another --out")
        requested = tokenizer if kind == "demo" else load_tokenizer(args.tokenizer)
        check_resumable(out, meta, new_meta(source, requested, shard_tokens, val_tokens))
        if ShardWriter.finished(meta, target_shards):
            print(f"{out} is already prepared ({meta['train']['shards']} train shards + val); nothing to do")
            return
        done, skip = meta["train"]["shards"], meta["progress"]["docs_consumed"]
        print(f"resuming {out}: {done} train shards done, skipping the {skip:,} documents they hold")

    writer = ShardWriter(out, meta, tokenizer, target_shards)
    remaining = None
    if target_shards is not None:
        remaining = (0 if writer.val is None else val_tokens) + (target_shards - meta["train"]["shards"]) * shard_tokens
    with worker_pool(tokenizer, args.workers) as pool:  # before the source opens: forking needs no threads yet
        skip = meta["progress"]["docs_consumed"]
        if kind == "fineweb":
            documents = open_fineweb(skip)  # before writing anything: an unreachable hub leaves no trace
        else:
            documents = itertools.islice(demo_documents() if kind == "demo" else local_documents(files), skip, None)
        if fresh:
            tokenizer.save(out)
            write_meta(out, meta)
        remove_leftovers(out, meta)

        start = time.perf_counter()
        encoded = encode_in_order(batched(documents, DOCS_PER_TASK), tokenizer, pool, args.workers)
        try:
            with tqdm(total=remaining, unit="tok", unit_scale=True, desc="tokenizing", disable=None) as progress:
                for lengths, tokens in encoded:
                    writer.feed(lengths, tokens)
                    progress.update(tokens.size)
                    if writer.done:
                        break
                else:
                    writer.finish()
        except BaseException:
            if fresh and meta["train"]["shards"] == 0:  # failed before the first shard: leave no half-made dir
                for name in ("meta.json", "tokenizer.json"):
                    (out / name).unlink(missing_ok=True)
            raise
    elapsed = time.perf_counter() - start
    print(
        f"wrote {writer.tokens_written:,} tokens in {elapsed:.1f}s ({writer.tokens_written / elapsed:,.0f} tokens/s, "
        f"{args.workers} workers); {out} now has {meta['train']['shards']} train shards "
        f"({meta['train']['tokens']:,} tokens) and a val shard ({meta['val']['tokens']:,} tokens)"
    )


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
        signal.signal(signal.SIGTERM, on_kill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
