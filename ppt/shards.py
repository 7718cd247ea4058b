"""Token shards on disk and the data directory that holds them: the format, reading, writing, meta.json.

A shard is a 1024-byte little-endian header (`_HEADER`), then its token stream (EOT, document, EOT, document, EOT ...),
uint16 when the vocabulary fits in 16 bits, else uint32. A data directory holds val_00000.bin, train_00000.bin ...,
tokenizer.json and meta.json (ppt/shard_writer.py's new_meta). SPEC.md, "Shards and the data directory", has the
header's table and the directory's contract; ppt/data.py packs shards into training rows.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ppt.common import PPTError, atomic_file, cache_dir
from ppt.locks import directory_user
from ppt.tokenizer import Tokenizer, load_tokenizer

MAGIC = b"PPTSHARD"
VERSION = 1
HEADER_BYTES = 1024
# magic, version, bytes per token, token count, vocab size, EOT id, flags, tokenizer fingerprint (sha256 of its
# canonical JSON), sha256 of the token bytes, tokenizer name (NUL-padded), largest token id; zeros to HEADER_BYTES
_HEADER = struct.Struct("<8sIIQIII32s32s64sI")
FLAG_DEMO = 1  # made by the offline demo tokenizer
FLAG_MAX_ID = 2  # the header holds the largest token id: always set, and a shard without it is refused
SPLITS = ("train", "val")
PREPARE_HINT = (
    "create it with `python -m scripts.prepare_fineweb` (or `python -m scripts.prepare_fineweb --source demo` offline)"
)
PREPARE_AGAIN = "prepare the data again into a new --out"
REBUILD_HINT = (
    "re-run the prepare command that made it (same --source and --out): it rebuilds missing and damaged shards"
)
META_FORMAT = 2


@dataclass(frozen=True)
class ShardInfo:
    """What a shard header says."""

    path: Path
    num_tokens: int
    vocab_size: int
    eot_id: int
    dtype: np.dtype
    tokenizer_fingerprint: str
    tokenizer_name: str
    is_demo: bool
    tokens_sha256: str
    max_token_id: int


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _describe_tokenizer(name: str, fingerprint: str, is_demo: bool = False) -> str:
    kind = " (the offline demo BPE)" if is_demo else ""
    return f"{name or 'the tokenizer'}{kind} with fingerprint {fingerprint[:16]}"


def write_shard(
    path: str | Path,
    tokens: np.ndarray,
    *,
    vocab_size: int,
    eot_id: int,
    fingerprint: str,
    demo: bool,
    tokenizer_name: str = "",
) -> None:
    """Write one shard atomically (temp file, then rename). The stream must start with EOT and fit the vocab."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise PPTError(f"a shard needs a non-empty 1-D integer token array, got {tokens.dtype} shape {tokens.shape}")
    outside = (tokens < 0) | (tokens >= vocab_size)
    if outside.any():
        pos = int(np.flatnonzero(outside)[0])
        raise PPTError(
            f"token id {int(tokens[pos])} at position {pos} is outside the vocabulary (size {vocab_size}) of "
            f"{tokenizer_name or 'the tokenizer'}; the tokens come from a different tokenizer than the one named"
        )
    if tokens[0] != eot_id:
        raise PPTError(f"a shard's token stream must start with EOT ({eot_id}), got {int(tokens[0])}")
    if len(fingerprint) != 64:
        raise PPTError(f"tokenizer fingerprint must be a sha256 hex digest, got {fingerprint!r}")
    dtype = token_dtype(vocab_size)
    data = tokens.astype(dtype, copy=False).tobytes()
    header = _HEADER.pack(
        MAGIC, VERSION, dtype.itemsize, tokens.size, vocab_size, eot_id, FLAG_MAX_ID | (FLAG_DEMO if demo else 0),
        bytes.fromhex(fingerprint), hashlib.sha256(data).digest(), tokenizer_name.encode()[:64], int(tokens.max()),
    ).ljust(HEADER_BYTES, b"\0")  # fmt: skip
    with atomic_file(path) as f:
        f.write(header)
        f.write(data)


def read_shard(
    path: str | Path, expected_fingerprint: str | None = None, expected_name: str | None = None, check_ids: bool = True
) -> tuple[ShardInfo, np.memmap]:
    """Validate a shard's header and size and memory-map its tokens; with `check_ids`, also that its largest token
    id is the one the header records (one pass, ~80 ms per 100M tokens from disk), so damage shows when the shard is
    opened, not when its row is read. A shard made by another tokenizer than `expected_fingerprint` is refused."""
    path = Path(path)
    if not path.is_file():
        raise PPTError(f"shard {path} does not exist; {PREPARE_HINT}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise PPTError(f"{path} is not a ppt shard (bad magic number); re-run prepare: {PREPARE_HINT}")
    _, version, itemsize, num_tokens, vocab_size, eot_id, flags, fp, tokens_sha, name, max_id = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise PPTError(f"{path} has shard format version {version}, this ppt reads {VERSION}; {PREPARE_AGAIN}")
    if not flags & FLAG_MAX_ID:
        raise PPTError(f"{path} was written by an older ppt: its header lacks the largest token id; {PREPARE_AGAIN}")
    dtype = token_dtype(vocab_size)
    if itemsize != dtype.itemsize:
        raise PPTError(
            f"{path} has a corrupt header ({itemsize} bytes per token for vocab {vocab_size}); re-run prepare"
        )
    expected_size = HEADER_BYTES + num_tokens * itemsize
    if size != expected_size:
        problem = "truncated shard" if size < expected_size else "shard has trailing bytes"
        raise PPTError(f"{path}: {problem} ({size} bytes, header says {expected_size}); {REBUILD_HINT}")
    tokenizer_name = name.rstrip(b"\0").decode("utf-8", errors="ignore")
    info = ShardInfo(path, num_tokens, vocab_size, eot_id, dtype, fp.hex(), tokenizer_name, bool(flags & FLAG_DEMO),
                     tokens_sha.hex(), max_id)  # fmt: skip
    if expected_fingerprint is not None and info.tokenizer_fingerprint != expected_fingerprint:
        made_by = _describe_tokenizer(info.tokenizer_name, info.tokenizer_fingerprint, info.is_demo)
        raise PPTError(
            f"{path} was tokenized with {made_by}, but this run expects "
            f"{_describe_tokenizer(expected_name or '', expected_fingerprint)}; "
            "use the tokenizer the shards were made with, or re-run prepare with this tokenizer into another --out"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    largest = int(tokens.max()) if check_ids and num_tokens else max_id
    if largest != max_id or max_id >= vocab_size:
        raise PPTError(
            f"{path} is damaged: it holds token ids up to {largest}, its header records {max_id} (vocabulary "
            f"{vocab_size}); {REBUILD_HINT}"
        )
    return info, tokens


# ---- the data directory ------------------------------------------------------------------------------------------


def default_data_dir(source: str = "fineweb") -> Path:
    """Where prepare writes and training reads by default: per source under `cache_dir()/data/`."""
    names = {"fineweb": "fineweb-edu", "demo": "demo"}
    return cache_dir() / "data" / names.get(source, "local")


def shard_path(data_dir: str | Path, split: str, index: int) -> Path:
    return Path(data_dir) / f"{split}_{index:05d}.bin"


def list_shards(data_dir: str | Path, split: str) -> list[Path]:
    """The split's shards in index order; PPTError naming the prepare command when there are none, and the fix when
    fewer are there than meta.json records (nothing trains on part of the data without a word)."""
    if split not in SPLITS:
        raise PPTError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise PPTError(f"data directory {data_dir} does not exist; {PREPARE_HINT}")
    paths = sorted(data_dir.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9].bin"))
    if (data_dir / "meta.json").is_file():
        recorded = [shard_path(data_dir, split, i) for i in range(read_meta(data_dir)[split]["shards"])]
        if missing := [path.name for path in recorded if not path.is_file()]:
            raise PPTError(
                f"{data_dir} lacks {', '.join(missing)} of the {len(recorded)} {split} shards its meta.json records; "
                f"{REBUILD_HINT}"
            )
    if not paths:
        raise PPTError(f"no {split} shards in {data_dir}; {PREPARE_HINT}")
    return paths


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        if user := directory_user(Path(data_dir)):  # a prepare writes meta.json with its first shards
            raise PPTError(f"{data_dir} is being written by a prepare ({user}); wait for it to finish")
        raise PPTError(f"{path} is missing; {PREPARE_HINT}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PPTError(f"{path} is not valid JSON ({exc}); delete the data directory and re-run prepare") from exc
    if meta.get("format") != META_FORMAT:
        raise PPTError(f"{path} is of format {meta.get('format')}, this ppt reads {META_FORMAT}; {PREPARE_AGAIN}")
    return meta


def check_prepared(data_dir: str | Path) -> str | None:
    """Refuse a data directory that a prepare is writing now (its shard list would change under the loader); return
    a warning for one whose prepare stopped before it finished (meta.json's progress.complete is false)."""
    if user := directory_user(Path(data_dir)):
        raise PPTError(f"{data_dir} is being written by a prepare ({user}); train on it once that has finished")
    meta = read_meta(data_dir)
    if not meta["progress"]["complete"]:
        return (
            f"the prepare of {data_dir} stopped before it finished ({meta['train']['shards']} train shards); training "
            "on what is there. Rerun the same prepare command to finish it"
        )
    return None


def write_meta(data_dir: str | Path, meta: dict[str, Any]) -> None:
    with atomic_file(Path(data_dir) / "meta.json") as f:
        f.write(json.dumps(meta, indent=2).encode("utf-8"))


def load_data_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer that made this directory's shards, with the name and demo flag prepare recorded."""
    recorded = read_meta(data_dir)["tokenizer"]
    loaded = load_tokenizer(Path(data_dir) / "tokenizer.json")
    if loaded.fingerprint != recorded["fingerprint"]:
        raise PPTError(
            f"{data_dir}/tokenizer.json does not match the fingerprint in meta.json; the directory was modified, "
            "delete it and re-run prepare"
        )
    return Tokenizer(loaded.backend, recorded["name"], is_demo=recorded["is_demo"])


def dataset_fingerprint(data_dir: str | Path) -> str:
    """sha256 of the lines `<split> <tokenizer fingerprint> <sha256 of the token bytes>`, one per shard, train then
    val, in index order: the tokens, tokenizer and split (shard boundaries shape the rows), never a path or name."""
    lines = []
    for split in SPLITS:
        for path in list_shards(data_dir, split):
            info, _ = read_shard(path, check_ids=False)  # the header's hash is what counts here
            lines.append(f"{split} {info.tokenizer_fingerprint} {info.tokens_sha256}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def out_of_vocab(path: str | Path, token_id: int, vocab_size: int) -> str:
    return (
        f"{path} holds token id {token_id}, but the model's vocabulary has {vocab_size} ids (0 to {vocab_size - 1}); "
        "the shard was made by another tokenizer or is damaged: prepare the data again into an empty --out"
    )
