"""The fixed tokenizer: a thin wrapper over a `tokenizers` byte-level BPE that knows its EOT id, its fingerprint,
and how many raw bytes each token stands for (the denominator of bits-per-byte). Production runs use cosmo2 (vocab
49152, `<|endoftext|>` = 0); the offline demo and `prepare_fineweb --train-tokenizer` train a small byte-level BPE.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ppt.common import PPTError, atomic_file, cache_dir

DEFAULT_TOKENIZER = "HuggingFaceTB/cosmo2-tokenizer"
EOT_TOKEN = "<|endoftext|>"
OFFLINE_HINT = (
    "to work offline, pass a local tokenizer.json (--tokenizer path/to/tokenizer.json) "
    "or use `--source demo`, which trains its own small tokenizer"
)

# Byte-level BPE spells each of the 256 bytes as one printable character, so a token's raw byte count is its length.
BYTE_LEVEL_CHARS = frozenset(pre_tokenizers.ByteLevel.alphabet())


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the facts ppt needs: EOT id, raw bytes per token, a fingerprint."""

    def __init__(self, backend: BackendTokenizer, name: str, is_demo: bool = False) -> None:
        self.backend, self.name, self.is_demo = backend, name, is_demo
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eot_id = backend.token_to_id(EOT_TOKEN)
        if eot_id is None:
            raise PPTError(f"tokenizer {name} has no {EOT_TOKEN} token; ppt needs it as the document separator")
        self.eot_id: int = eot_id

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id}, is_demo={self.is_demo})"

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex of the tokenizer JSON with sorted keys and no whitespace, so formatting never changes it."""
        canonical = json.dumps(json.loads(self.backend.to_str()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each document followed by EOT; the Rust batch encoder, no other special tokens."""
        return [[*enc.ids, self.eot_id] for enc in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> torch.Tensor:
        """int32 (vocab_size,): raw bytes each token stands for; special tokens 0. Counted from the byte-level
        spelling, not by decoding: a token holding part of a UTF-8 character decodes to U+FFFD (3 bytes)."""
        decoder = json.loads(self.backend.to_str()).get("decoder")
        if '"ByteLevel"' not in json.dumps(decoder):
            raise PPTError(
                f"tokenizer {self.name} is not a byte-level BPE (its decoder is not ByteLevel); ppt counts bytes per "
                "token only for byte-level tokenizers such as cosmo2 or the demo BPE"
            )
        counts = [0] * self.vocab_size
        added = {tok.content: tok for tok in self.backend.get_added_tokens_decoder().values()}
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if token_id >= self.vocab_size:
                raise PPTError(f"tokenizer {self.name} has id {token_id} >= its vocab size {self.vocab_size}")
            if token in added:  # added tokens are stored as plain text, not in the byte-level alphabet
                counts[token_id] = 0 if added[token].special else len(token.encode("utf-8"))
            elif BYTE_LEVEL_CHARS.issuperset(token):
                counts[token_id] = len(token)
            else:
                raise PPTError(f"tokenizer {self.name}: token {token!r} is outside the byte-level alphabet")
        return torch.tensor(counts, dtype=torch.int32)

    def save(self, directory: str | Path) -> Path:
        """Write `directory/tokenizer.json` atomically; returns its path."""
        path = Path(directory) / "tokenizer.json"
        with atomic_file(path) as f:
            f.write(self.backend.to_str().encode("utf-8"))
        return path


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _read_tokenizer_file(path: Path, name: str) -> Tokenizer:
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception for any parse error
        raise PPTError(
            f"{path} is not a valid tokenizers JSON file ({exc}); pass a tokenizer.json saved by HF"
        ) from exc
    return Tokenizer(backend, name)


def _download_from_hub(name: str, target: Path) -> None:
    from huggingface_hub import hf_hub_download  # lazy: nothing touches the network at import time
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        hf_hub_download(repo_id=name, filename="tokenizer.json", local_dir=target.parent)
    except LocalEntryNotFoundError as exc:  # raised when the hub cannot be reached and nothing is cached
        raise PPTError(f"cannot reach the Hugging Face hub to download tokenizer {name!r}; {OFFLINE_HINT}") from exc
    except (RepositoryNotFoundError, EntryNotFoundError) as exc:
        raise PPTError(f"the Hugging Face hub has no tokenizer.json for {name!r}; check the name") from exc
    except Exception as exc:  # connection, timeout, proxy, auth: all mean "cannot reach the hub"
        raise PPTError(f"cannot download tokenizer {name!r} from the Hugging Face hub ({exc}); {OFFLINE_HINT}") from exc


def load_tokenizer(name_or_path: str | Path = DEFAULT_TOKENIZER) -> Tokenizer:
    """A local tokenizer.json (or a directory holding one), else a hub name cached under `cache_dir()/tokenizers/`;
    never another tokenizer: if the hub cannot be reached and nothing is cached, raises PPTError."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return _read_tokenizer_file(path, str(name_or_path))
    name = str(name_or_path)
    if name.endswith(".json") or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise PPTError(f"no tokenizer at {name!r}: pass a tokenizer.json, a directory holding one, or a hub name")
    cached = cache_dir() / "tokenizers" / name.replace("/", "--") / "tokenizer.json"
    if not cached.is_file():
        if hub_offline():
            raise PPTError(
                f"tokenizer {name!r} is not cached in {cached.parent} and HF_HUB_OFFLINE is set; {OFFLINE_HINT}"
            )
        _download_from_hub(name, cached)
    return _read_tokenizer_file(cached, name)


def train_bpe(texts: Iterable[str], vocab_size: int, name: str, is_demo: bool = False) -> Tokenizer:
    """Train a byte-level BPE on `texts` (EOT is id 0, like cosmo2), deterministically for the same texts. A corpus
    with fewer distinct merges than asked for gives a smaller vocabulary; `vocab_size` of the result says which."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return Tokenizer(backend, name, is_demo=is_demo)


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """The offline demo's byte-level BPE, trained on the demo corpus."""
    return train_bpe(texts, vocab_size, f"demo-bpe-{vocab_size}", is_demo=True)
