"""Count baselines for study tables: the bits per byte of a unigram and a bigram model counted from the train split,
on exactly the val targets `ppt.loss_eval.evaluate_bpb` scores for a run with the same eval budget, sequence length
and world size. A trained model not below the bigram has learned nothing that adjacent-token counts do not know.

Counts are the (previous, next) token pairs inside each train shard: every prediction a training row can make.
Unigram: add-one (Laplace) over the vocabulary, P(w) = (c(w) + 1) / (N + V). Bigram: interpolated Witten-Bell,
P(w | v) = (c(v, w) + T(v) P(w)) / (c(v) + T(v)), T(v) the number of distinct tokens seen after v (a context never
seen is P(w)). Neither has a parameter, so nothing is tuned on val. As in evaluate_bpb, 0-byte targets (EOT) count
in neither sum of bpb, bytes come from `Tokenizer.token_bytes()`, and the sums are float64.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ppt.common import PPTError
from ppt.shards import list_shards, load_data_tokenizer, read_shard


def val_pairs(streams: list[np.ndarray], eval_tokens: int, seq_len: int, world_size: int = 1) -> np.ndarray:
    """(2, n) int64: the context and target of each val target evaluate_bpb scores, in file order.

    `DataLoader.val_batches` gives all ranks together the split's first R rows, R = world_size * min(eval_tokens //
    (seq_len * world_size), rows // world_size); a shard's first k rows hold targets tokens[1 : k*seq_len + 1].
    """
    if seq_len < 1 or world_size < 1:
        raise PPTError(f"seq_len and world_size must be positive, got {seq_len} and {world_size}")
    rows_per_shard = [(s.size - 1) // seq_len for s in streams]
    rows = world_size * min(eval_tokens // (seq_len * world_size), sum(rows_per_shard) // world_size)
    if rows == 0:
        raise PPTError(
            f"a val budget of {eval_tokens} tokens holds no row of {seq_len} tokens per rank ({world_size} ranks) "
            "in this val split; raise the budget or lower seq_len"
        )
    parts = []
    for stream, shard_rows in zip(streams, rows_per_shard):
        take = min(shard_rows, rows) * seq_len
        parts.append(np.stack([stream[:take], stream[1 : take + 1]]).astype(np.int64))
        rows -= take // seq_len
    return np.concatenate(parts, axis=1)


def ngram_bpb(data_dir: str | Path, eval_tokens: int, seq_len: int, world_size: int = 1) -> dict[str, float | int]:
    """Unigram and bigram bpb (train-split counts) on the val targets of a run with this eval budget and seq_len.

    Returns `unigram`, `bigram` (bpb) and `tokens`, `bytes`: the targets scored and their bytes, as evaluate_bpb
    reports them for the same run.
    """
    tokenizer = load_data_tokenizer(data_dir)
    V = tokenizer.vocab_size

    def streams(split: str) -> list[np.ndarray]:
        return [np.asarray(read_shard(path, tokenizer.fingerprint)[1]) for path in list_shards(data_dir, split)]

    code = np.uint64 if V > 2**16 else np.uint32  # a pair (v, w) as v*V + w: V*V fits 32 bits when V <= 2**16
    pairs = np.concatenate([s[:-1].astype(code) * V + s[1:] for s in streams("train")])
    pair_codes, pair_counts = np.unique(pairs, return_counts=True)  # sparse counts c(v, w), sorted by code
    unigram = (np.bincount(pair_codes % V, pair_counts, V) + 1) / (pairs.size + V)
    context_count = np.bincount(pair_codes // V, pair_counts, V)
    followers = np.bincount(pair_codes // V, minlength=V)
    context, target = val_pairs(streams("val"), eval_tokens, seq_len, world_size)
    query = (context * V + target).astype(code)
    at = np.searchsorted(pair_codes, query).clip(max=pair_codes.size - 1)
    seen = np.where(pair_codes[at] == query, pair_counts[at], 0)
    p_unigram = unigram[target]
    c, t = context_count[context], followers[context]
    p_bigram = np.where(c > 0, (seen + t * p_unigram) / np.maximum(c + t, 1), p_unigram)

    nbytes = tokenizer.token_bytes().numpy().astype(np.float64)[target]
    counted = nbytes > 0
    total_bytes = nbytes.sum()

    def bpb(p: np.ndarray) -> float:
        return float(-np.log(p[counted]).sum() / (math.log(2) * total_bytes)) if total_bytes else float("nan")

    return {"unigram": bpb(p_unigram), "bigram": bpb(p_bigram), "tokens": target.size, "bytes": int(total_bytes)}
