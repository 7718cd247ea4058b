"""Count baselines for study tables: the bits per byte of n-gram models (orders 1 to 4 by default) counted from the
train split, on exactly the val targets `ppt.loss_eval.evaluate_bpb` scores for a run with the same eval budget,
sequence length and world size. A trained model not clearly below the best of them (`in_ngram_regime`) has learned
little that counts of the last few tokens do not know.

Context rule: a target's context is only what the model sees when it predicts it: the tokens before it in its row,
back to and including the EOT that begins its document (SPEC.md, "Documents and packing": document masks cut
attention there, as `doc_pos` in ppt/data.py says), and never before the row start (a row's first target sees one
token). A target whose context holds L < n-1 tokens is scored by the order-n model as by the order-(L+1) one. Train
counts follow the same rule over each shard's whole stream: an n-gram is counted only where its context crosses no
document boundary, so only its first token may be an EOT.

Smoothing: interpolated modified Kneser-Ney (Chen and Goodman, 1998), with no parameter, so nothing is tuned on val:
P(w | h) = (a(hw) - D(a(hw))) / a(h.) + g(h) P(w | h'), g(h) = sum over w of D(a(hw)) / a(h.), with h' the context h
without its oldest token and a uniform 1/V below the unigram; a context never seen gives P(w | h'). The top order
counts a = c, the raw counts; a lower order counts a = the number of distinct tokens seen just before the n-gram, but
an n-gram beginning with EOT, which nothing precedes, keeps its raw count. The discounts of each order and count kind
come from the count-of-counts n1..n4 of a: Y = n1 / (n1 + 2 n2), D_k = k - (k+1) Y n_(k+1) / n_k for k = 1, 2 and
3 (D_3 for counts of 3 or more); an estimate that is undefined or outside (0, k], which only a tiny corpus with a
count of counts of zero gives, is k/2.

Counts are exact: an n-gram is a uint64 code (V^n <= 2^64: order 4 for V <= 65536), counted by np.unique and looked
up by searchsorted. As in evaluate_bpb, 0-byte targets (EOT) count in neither sum of bpb, bytes come from
`Tokenizer.token_bytes()`, and the sums are float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ppt.common import PPTError
from ppt.shards import list_shards, load_data_tokenizer, read_shard

# How far below the best count model a loss must be to be clearly below it: twice the typical seed-to-seed standard
# deviation of a setting's val bpb (median 0.011 over the 18 settings of docs/results.md), about 1% of the count
# models' bpb there.
NGRAM_MARGIN = 0.02


def order_name(n: int) -> str:
    return {1: "unigram", 2: "bigram", 3: "trigram"}.get(n, f"{n}gram")


def largest_order(vocab_size: int) -> int:
    """The highest order whose n-gram codes fit 64 bits."""
    return max(n for n in range(1, 65) if vocab_size**n <= 2**64)


def val_rows(streams: list[np.ndarray], eval_tokens: int, seq_len: int, world_size: int = 1) -> np.ndarray:
    """(R, seq_len + 1): the rows evaluate_bpb scores, in file order; a row's targets are row[1:]. As
    `DataLoader.val_batches` gives them to all ranks together: the split's first R = world_size * min(eval_tokens //
    (seq_len * world_size), rows // world_size) rows, a shard's k-th row tokens[k*seq_len : (k+1)*seq_len + 1]."""
    if seq_len < 1 or world_size < 1:
        raise PPTError(f"seq_len and world_size must be positive, got {seq_len} and {world_size}")
    rows_per_shard = [(s.size - 1) // seq_len for s in streams]
    rows = world_size * min(eval_tokens // (seq_len * world_size), sum(rows_per_shard) // world_size)
    if rows == 0:
        raise PPTError(
            f"a val budget of {eval_tokens} tokens holds no row of {seq_len} tokens per rank ({world_size} "
            "ranks) in this val split; raise the budget or lower seq_len"
        )
    parts = []
    for stream, shard_rows in zip(streams, rows_per_shard):
        take = min(shard_rows, rows)
        parts.append(stream[np.arange(take)[:, None] * seq_len + np.arange(seq_len + 1)])
        rows -= take
    return np.concatenate(parts)


def context_lengths(rows: np.ndarray, eot_id: int) -> np.ndarray:
    """(R, T) for rows (R, T+1): how many tokens the model sees when it predicts each target rows[:, 1:], back to and
    including the latest EOT among the inputs, else to the row start (ppt/data.py's doc_pos + 1)."""
    positions = np.arange(rows.shape[1] - 1)
    return positions + 1 - np.maximum.accumulate(np.where(rows[:, :-1] == eot_id, positions, 0), axis=1)


def ngram_codes(rows: np.ndarray, vocab_size: int, max_order: int) -> Iterator[np.ndarray]:
    """For n = 1 .. max_order, (R, T) uint64: the code sum_k t_k V^k of the n-gram ending at each target of rows
    (R, T+1), t_0 the target and t_k the token k before it; meaningless where the row holds fewer than n-1 tokens
    before the target. One array, updated in place from order to order: copy what you keep."""
    rows = rows.astype(np.uint64)
    codes = rows[:, 1:].copy()
    for n in range(1, max_order + 1):
        if n > 1:
            codes[:, n - 2 :] += rows[:, : max(rows.shape[1] - n + 1, 0)] * np.uint64(vocab_size ** (n - 1))
        yield codes


def discounts(counts: np.ndarray) -> np.ndarray:
    """[0, D_1, D_2, D_3]: modified Kneser-Ney discounts from the count-of-counts of `counts` (module docstring)."""
    n1, n2, n3, n4 = np.bincount(np.minimum(counts, 5), minlength=6)[1:5].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = n1 / (n1 + 2 * n2)
        found = np.array([1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3])
    k = np.arange(1, 4)
    return np.concatenate([[0.0], np.where((found > 0) & (found <= k), found, k / 2)])


@dataclass
class Level:
    """One order of the interpolation: each n-gram's discounted share of its context, each context's weight g(h)."""

    grams: np.ndarray  # sorted n-gram codes
    share: np.ndarray  # (a(hw) - D(a(hw))) / a(h.)
    contexts: np.ndarray  # sorted context codes (an n-gram's code // V)
    backoff: np.ndarray  # g(h)
    vocab_size: int

    @classmethod
    def count(cls, grams: np.ndarray, counts: np.ndarray, vocab_size: int) -> Level:
        discount = discounts(counts)[np.minimum(counts, 3)]
        context = grams // np.uint64(vocab_size)
        first = np.ones(grams.size, bool)  # the first n-gram of each context (grams are sorted, so grouped)
        first[1:] = context[1:] != context[:-1]
        index = np.cumsum(first) - 1
        totals = np.bincount(index, counts)
        return cls(grams, (counts - discount) / totals[index], context[first], np.bincount(index, discount) / totals,
                   vocab_size)  # fmt: skip

    def probability(self, codes: np.ndarray, lower: np.ndarray) -> np.ndarray:
        """P(w | h) of the n-grams `codes`, given P(w | h') of the order below."""
        if self.grams.size == 0:
            return lower
        at = np.searchsorted(self.grams, codes).clip(max=self.grams.size - 1)
        share = np.where(self.grams[at] == codes, self.share[at], 0.0)
        context = codes // np.uint64(self.vocab_size)
        at = np.searchsorted(self.contexts, context).clip(max=self.contexts.size - 1)
        return np.where(self.contexts[at] == context, share + self.backoff[at] * lower, lower)


class KneserNey:
    """Interpolated modified Kneser-Ney models of orders 1 .. max_order counted from token streams that each start
    with EOT, under the module docstring's context rule."""

    def __init__(self, streams: list[np.ndarray], vocab_size: int, eot_id: int, max_order: int = 4) -> None:
        if not 1 <= max_order <= largest_order(vocab_size):
            raise PPTError(
                f"max_order must be 1 to {largest_order(vocab_size)} (the longest n-gram of a {vocab_size}-"
                f"token vocabulary whose code fits 64 bits), got {max_order}"
            )
        self.vocab_size, self.eot_id, self.max_order = vocab_size, eot_id, max_order
        lengths = [context_lengths(s[None], eot_id) for s in streams]
        orders = [ngram_codes(s[None], vocab_size, max_order) for s in streams]
        counted = []  # per order: the distinct n-grams whose context crosses no document boundary, and their counts
        for n in range(1, max_order + 1):
            grams = np.concatenate([next(codes)[seen >= n - 1] for codes, seen in zip(orders, lengths)])
            counted.append(np.unique(grams, return_counts=True))
        self.top: list[Level] = []  # each order with raw counts: the top order of a model
        self.lower: list[Level] = []  # each order but the last with counts of distinct preceding tokens
        for n, (grams, counts) in enumerate(counted, 1):
            self.top.append(Level.count(grams, counts, vocab_size))
            if n < max_order:  # every n-gram that does not begin with EOT ends an (n+1)-gram counted
                suffixes, preceding = np.unique(counted[n][0] % np.uint64(vocab_size**n), return_counts=True)
                adjusted = counts.copy()
                adjusted[np.searchsorted(grams, suffixes)] = preceding
                self.lower.append(Level.count(grams, adjusted, vocab_size))

    def probabilities(self, rows: np.ndarray) -> np.ndarray:
        """(max_order, R, T): P(target) of each target rows[:, 1:] of rows (R, T+1) under each order's model."""
        lengths = context_lengths(rows, self.eot_id)
        below = np.full(lengths.shape, 1 / self.vocab_size)  # P(w | h') of the lower-order chain
        models = []
        for n, codes in enumerate(ngram_codes(rows, self.vocab_size, self.max_order), 1):
            top = self.top[n - 1].probability(codes, below)
            models.append(np.where(lengths >= n - 1, top, models[-1]) if models else top)
            if n < self.max_order:
                below = self.lower[n - 1].probability(codes, below)
        return np.stack(models)


def ngram_bpb(
    data_dir: str | Path, eval_tokens: int, seq_len: int, world_size: int = 1, max_order: int = 4
) -> dict[str, float | int | str]:
    """bpb of Kneser-Ney models of orders 1 .. max_order (train-split counts; orders whose codes outgrow 64 bits are
    left out) on the val targets of a run with this eval budget and seq_len: `unigram`, `bigram`, ... , `best` (the
    name of the lowest), and `tokens`, `bytes` (the targets scored and their bytes, as evaluate_bpb reports them)."""
    tokenizer = load_data_tokenizer(data_dir)

    def streams(split: str) -> list[np.ndarray]:
        return [np.asarray(read_shard(path, tokenizer.fingerprint)[1]) for path in list_shards(data_dir, split)]

    rows = val_rows(streams("val"), eval_tokens, seq_len, world_size)
    if max_order < 1:
        raise PPTError(f"max_order must be at least 1 (the unigram), got {max_order}")
    orders = min(max_order, largest_order(tokenizer.vocab_size))
    model = KneserNey(streams("train"), tokenizer.vocab_size, tokenizer.eot_id, orders)
    probabilities = model.probabilities(rows).reshape(orders, -1)
    nbytes = tokenizer.token_bytes().numpy().astype(np.float64)[rows[:, 1:].ravel()]
    counted = nbytes > 0
    total_bytes = nbytes.sum()

    def bpb(p: np.ndarray) -> float:
        return float(-np.log(p[counted]).sum() / (math.log(2) * total_bytes)) if total_bytes else float("nan")

    scores = {order_name(n): bpb(p) for n, p in enumerate(probabilities, 1)}
    return {**scores, "best": min(scores, key=scores.__getitem__), "tokens": nbytes.size, "bytes": int(total_bytes)}


def in_ngram_regime(bpb: float, counts: Mapping[str, float | int | str], margin: float = NGRAM_MARGIN) -> bool:
    """Whether `bpb` is not clearly below the best count model of `counts` (ngram_bpb's result): above its bpb less
    `margin` (NGRAM_MARGIN says why 0.02)."""
    if margin < 0 or "best" not in counts:
        raise PPTError(
            f"in_ngram_regime needs ngram_bpb's result and a margin of at least 0, got keys "
            f"{sorted(counts)} and margin {margin}"
        )
    return bpb > counts[counts["best"]] - margin
