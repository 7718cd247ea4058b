"""Synthetic token shards for measurement and tests: a byte-level vocabulary of any size, uniform random tokens or
learnable phrases, documents of exponentially distributed length; written as a data directory `DataLoader` reads."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ppt.shards import META_FORMAT, shard_path, write_meta, write_shard
from ppt.tokenizer import BYTE_LEVEL_CHARS, EOT_TOKEN, Tokenizer


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level vocabulary of exactly vocab_size entries: EOT, the 256 bytes, then two-byte tokens."""
    alphabet = sorted(BYTE_LEVEL_CHARS)
    vocab = {EOT_TOKEN: 0}
    for token in itertools.chain(alphabet, (a + b for a in alphabet for b in alphabet)):
        if len(vocab) == vocab_size:
            break
        vocab[token] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOT_TOKEN])
    return Tokenizer(backend, f"synthetic-{vocab_size}", is_demo=True)


def write_synthetic_data(
    directory: Path,
    vocab_size: int,
    train_tokens: int,
    mean_doc_len: int,
    seed: int,
    val_tokens: int | None = None,
    phrases: int = 0,
) -> None:
    """Shards of uniform random tokens, or with `phrases` > 0 a random sequence of that many fixed random 8-token
    phrases: text a model learns from within a few steps (the loss falls), unlike uniform noise."""
    tokenizer = synthetic_tokenizer(vocab_size)
    rng = np.random.default_rng(seed)
    phrase_book = rng.integers(1, vocab_size, size=(phrases, 8), dtype=np.int64) if phrases else None
    for split, n in (("train", train_tokens), ("val", val_tokens or max(train_tokens // 16, 65_536))):
        if phrase_book is None:
            tokens = rng.integers(1, vocab_size, size=n, dtype=np.int64)
        else:
            tokens = phrase_book[rng.integers(0, phrases, size=-(-n // 8))].ravel()[:n]
        doc_ends = np.cumsum(rng.exponential(mean_doc_len, size=n // max(mean_doc_len // 4, 1)).astype(np.int64) + 1)
        tokens[doc_ends[doc_ends < n]] = 0
        tokens[0] = 0
        write_shard(
            shard_path(directory, split, 0),
            tokens,
            vocab_size=vocab_size,
            eot_id=0,
            fingerprint=tokenizer.fingerprint,
            demo=True,
            tokenizer_name=tokenizer.name,
        )
    tokenizer.save(directory)
    write_meta(
        directory,
        {
            "format": META_FORMAT,
            "source": "synthetic",
            "tokenizer": {
                "name": tokenizer.name,
                "fingerprint": tokenizer.fingerprint,
                "is_demo": True,
                "vocab_size": vocab_size,
                "eot_id": 0,
            },
            "val": {"shards": 1},
            "train": {"shards": 1},
            "progress": {"complete": True},
        },
    )
