"""Where prepare's documents come from: FineWeb-Edu-Dedup streamed from the hub, the offline demo corpus (the
documentation the running Python's standard library ships), or local files (`.txt` one document per file, `.jsonl`
one per line's `text` field, `.parquet` one per row of its `text` column); and a local corpus's size, measured before
anything is tokenized. Every source yields the documents as strings, in a fixed order."""

from __future__ import annotations

import codecs
import functools
import glob
import importlib
import inspect
import io
import json
import os
import pkgutil
import random
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from ppt.common import PPTError, format_sizes
from ppt.shard_writer import encode_documents
from ppt.tokenizer import Tokenizer, hub_offline

FINEWEB_REPO, FINEWEB_CONFIG = "HuggingFaceTB/smollm-corpus", "fineweb-edu-dedup"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
SAMPLE_BYTES = 1_000_000  # text tokenized up front to measure bytes per token
SHUFFLE_MAX_BYTES = 4_000_000_000  # --shuffle-seed holds the corpus in memory

# ---- documents ---------------------------------------------------------------------------------------------------


def resolve_local_files(patterns: list[str]) -> list[Path]:
    """Expand paths, folders (every .txt/.jsonl/.parquet file under one, hidden ones aside) and globs (`**` spans
    folders) in argument order, each glob and folder sorted; every pattern must give a supported file."""
    files = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matches = _existing([Path(m) for m in sorted(glob.glob(expanded, recursive=True))], f"--source {pattern!r}")
        else:
            matches = [Path(expanded)] if os.path.exists(expanded) else []
        if not matches:
            raise PPTError(f"--source {pattern!r} matches no file; pass fineweb, demo, or existing local files")
        for path in (match.resolve() for match in matches):
            if path.suffix not in LOCAL_SUFFIXES and not path.is_dir():
                raise PPTError(f"{path}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)} files")
            files += _folder_files(path) if path.is_dir() else [path]
    return files


def _existing(paths: list[Path], where: str) -> list[Path]:
    """The paths that lead to something; a note names the links that lead nowhere (dangling or looping)."""
    if broken := [path for path in paths if not path.exists()]:
        print(f"note: {where}: left out {len(broken)} links that lead to no file ({_some_names(broken)})")
    return [path for path in paths if path.exists()]


def _some_names(paths: list[Path], shown: int = 5) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(path.name for path in paths[:shown]) + more


def _folder_files(folder: Path) -> list[Path]:
    """The supported files under a folder, sorted by path; says which other files it leaves out, and refuses a
    folder with none, naming what it holds."""
    entries = [path for path in sorted(folder.rglob("*")) if not path.is_dir()]
    visible = [p for p in entries if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    files = _existing(visible, str(folder))
    others = [p for p in files if p.suffix not in LOCAL_SUFFIXES]
    if len(others) == len(files):
        found = f"{len(others)} files of other names ({_some_names(others)})" if others else "no file"
        raise PPTError(
            f"{folder} holds no {', '.join(LOCAL_SUFFIXES)} file, the suffixes prepare reads, but {found}; rename "
            "plain-text files to end in .txt (one document each), or pass another folder"
        )
    if others:
        kinds = ", ".join(sorted({p.suffix or "(no suffix)" for p in others}))
        print(f"note: {folder}: left out {len(others)} files that are not {', '.join(LOCAL_SUFFIXES)} ({kinds})")
    return [p for p in files if p.suffix in LOCAL_SUFFIXES]


# Modules never imported for the demo corpus: they act on import (open a browser, print, start a GUI, read config
# files, set up the terminal), are deprecated shims whose content depends on what else is installed, or are tests.
DEMO_SKIP_MODULES = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "readline", "lib2to3", "distutils"}
DEMO_SKIP_MODULES |= {"pydoc_data"}  # its help() topics are taken whole, not as a module

DEMO_SKIP_PARTS = {"test", "tests", "idle_test"}
MIN_DEMO_TEXT = 20  # characters: shorter docstrings and comments ("Return self==value.") carry little text


def demo_documents() -> list[str]:
    """The offline demo corpus: the documentation Python's standard library ships, about 3 MB (0.85M tokens at
    vocab 4096 on CPython 3.11), built once per process in about a second, the same with one Python build: the
    `help()` topics (one document each) and one document per public stdlib module that imports here (its docstrings
    under `class`/`def` headings, then its source's comments), every text once, in a fixed shuffled order."""
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


def _stdlib_module_names() -> list[str]:
    """Public stdlib modules and their public submodules that import here, sorted by name."""

    def public(name: str) -> bool:
        return not any(part.startswith("_") or part in DEMO_SKIP_PARTS for part in name.split("."))

    found = []
    pending = sorted(name for name in sys.stdlib_module_names if public(name) and name not in DEMO_SKIP_MODULES)
    while pending:
        name = pending.pop()
        try:
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # absent C extensions, other platforms' modules: skipped, the corpus is what imports here
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
    if comments := _source_comments(getattr(module, "__file__", None), seen):
        parts.append(f"comments in the source of {name}\n" + "\n\n".join(comments))
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


def _encoding_error(path: Path, byte_offset: int) -> PPTError:
    """A text file that is not UTF-8, as one line with its fix: UTF-16 (a byte order mark, or ASCII's NUL every other
    byte), other NUL bytes (binary data), or other bytes (latin1, most likely)."""
    with open(path, "rb") as f:
        head = f.read(4096)
        f.seek(byte_offset)
        nul = f.read(1) == b"\0"
    odd_nuls = head[1::2].count(0) - head[0::2].count(0)  # little-endian UTF-16 ASCII: "h\0i\0"
    utf16 = "utf-16le" if odd_nuls > len(head) // 4 else "utf-16be" if -odd_nuls > len(head) // 4 else None
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        utf16 = "utf-16"  # iconv reads the byte order from the mark
    fix = f"`iconv -f {utf16 or 'latin1'} -t utf-8 {path.name} > fixed{path.suffix}`"
    if utf16:
        return PPTError(f"{path} is UTF-16 text, not UTF-8; re-encode it to UTF-8, e.g. {fix}")
    if nul:
        return PPTError(f"{path} holds NUL bytes (the first at byte offset {byte_offset}): binary data, not text; "
                        "leave it out of --source")  # fmt: skip
    return PPTError(f"{path} is not valid UTF-8 (byte offset {byte_offset}); re-encode it to UTF-8, e.g. {fix}")


def _txt_documents(path: Path) -> Iterator[str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _encoding_error(path, exc.start) from exc
    if "\0" in text:  # valid UTF-8, but not text: UTF-16, or binary data
        raise _encoding_error(path, data.index(0))
    yield text.removeprefix("\ufeff")  # a UTF-8 byte order mark is no part of the text


def _jsonl_documents(path: Path) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if 0 in raw:
                raise _encoding_error(path, offset + raw.index(0))
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff" if line_number == 1 else "")
            except UnicodeDecodeError as exc:
                raise _encoding_error(path, offset + exc.start) from exc
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


@contextmanager
def _parquet_errors(path: Path) -> Iterator[None]:
    """A damaged or non-parquet file (pyarrow raises ArrowInvalid, OSError ...) as one line."""
    try:
        yield
    except Exception as exc:
        raise PPTError(
            f"{path} is not a readable parquet file ({exc}); re-export it, or leave it out of --source"
        ) from exc


def _parquet_documents(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    with _parquet_errors(path):
        parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise PPTError(f"{path} has no `text` column (columns: {', '.join(parquet.schema_arrow.names)})")
    with _parquet_errors(path):  # a damaged page shows only when read
        for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
            yield from (text or "" for text in batch.column(0).to_pylist())


def local_documents(files: list[Path]) -> Iterator[str]:
    readers = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}
    for path in files:
        yield from readers[path.suffix](path)


def open_fineweb() -> Iterator[str]:
    """Stream FineWeb-Edu-Dedup from the hub; with HF_HUB_OFFLINE set, read a dataset already in the HF cache. Opens
    the dataset now, so an unreachable hub fails before anything is written."""
    try:
        import datasets  # lazy: importing this script never touches the network

        dataset = datasets.load_dataset(FINEWEB_REPO, FINEWEB_CONFIG, split="train", streaming=not hub_offline())
    except Exception as exc:  # connection, auth, missing cache: all mean "cannot get the data"
        raise PPTError(
            f"cannot open {FINEWEB_REPO} ({FINEWEB_CONFIG}): {exc}; to work offline use `--source demo`, or local "
            ".txt/.jsonl/.parquet files, or set HF_HUB_OFFLINE=1 with the dataset already in the Hugging Face cache"
        ) from exc

    def texts() -> Iterator[str]:
        try:
            for example in dataset:
                yield example["text"]
        except Exception as exc:  # the consumer's errors never land here: only the stream's
            raise PPTError(f"lost {FINEWEB_REPO} while streaming ({exc}); re-run the same command to resume") from exc

    return texts()


# ---- the corpus: size and order ----------------------------------------------------------------------------------


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

            with _parquet_errors(path):
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
    return size / encode_documents(tokenizer, sample)[0].sum()  # in pieces, as prepare tokenizes


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
