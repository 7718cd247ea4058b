import math
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from torch import nn

from ppt.baselines import KneserNey, in_ngram_regime, largest_order, ngram_bpb
from ppt.common import PPTError
from ppt.data import DataLoader
from ppt.loss_eval import evaluate_bpb
from ppt.shard_writer import new_meta
from ppt.shards import list_shards, load_data_tokenizer, read_shard, shard_path, write_meta, write_shard
from ppt.tokenizer import train_demo_tokenizer

NAMES = ("unigram", "bigram", "trigram", "4gram")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """Hand-made streams with a real tokenizer: train uses ids below 150 only, so val holds unseen pairs and
    unseen contexts; two val shards, so the budget crosses a shard boundary."""
    tokenizer = train_demo_tokenizer(["the cat sat on the mat, naïve café 日本 " * 40], vocab_size=300)
    out = tmp_path_factory.mktemp("toy")
    tokenizer.save(out)
    write_meta(out, new_meta("toy", tokenizer, shard_tokens=400, val_tokens=100))
    rng = np.random.default_rng(0)

    def stream(length: int, high: int) -> np.ndarray:
        tokens = rng.integers(1, high, size=length)
        tokens[1::2] = (tokens[::2][: tokens[1::2].size] * 7) % high  # structure: each token hints the next
        tokens[rng.random(length) < 0.05] = tokenizer.eot_id
        tokens[0] = tokenizer.eot_id
        return tokens

    for split, lengths, high in [("train", (400, 333), 150), ("val", (61, 90), tokenizer.vocab_size)]:
        for index, length in enumerate(lengths):
            write_shard(
                shard_path(out, split, index),
                stream(length, high),
                vocab_size=tokenizer.vocab_size,
                eot_id=tokenizer.eot_id,
                fingerprint=tokenizer.fingerprint,
                demo=True,
            )
    return out


def reference(streams: list[list[int]], V: int, eot: int, max_order: int):
    """Interpolated modified Kneser-Ney from its definitions, in dicts: P(w | history) of the order-`order` model,
    where `history` is all the target's context holds."""
    raw = Counter()  # every n-gram of every order whose context lies inside one document
    for tokens in streams:
        for i in range(1, len(tokens)):
            start = max(j for j in range(i) if tokens[j] == eot)  # the EOT that begins the target's document
            for n in range(1, min(max_order, i - start + 1) + 1):
                raw[tuple(tokens[i - n + 1 : i + 1])] += 1
    preceding = defaultdict(set)
    for gram in raw:
        preceding[gram[1:]].add(gram[0])

    def lower(gram: tuple) -> int:  # counts of distinct preceding tokens; raw where nothing can precede
        return raw[gram] if len(gram) > 1 and gram[0] == eot else len(preceding[gram])

    def discounts(counts: list[int]) -> list[float]:
        n = Counter(counts)
        found = [0.0]
        for k in (1, 2, 3):
            try:
                y = n[1] / (n[1] + 2 * n[2])
                d = k - (k + 1) * y * n[k + 1] / n[k]
            except ZeroDivisionError:
                d = math.nan
            found.append(d if 0 < d <= k else k / 2)
        return found

    followers = defaultdict(list)  # context -> its n-grams
    for gram in raw:
        followers[gram[:-1]].append(gram)
    tables = {}  # (order, is_top) -> count function and discounts
    for n in range(1, max_order + 1):
        grams = [g for g in raw if len(g) == n]
        tables[n, True] = raw.__getitem__, discounts([raw[g] for g in grams])
        tables[n, False] = lower, discounts([lower(g) for g in grams])

    def probability(history: tuple, w: int, order: int) -> float:
        top = min(order, len(history) + 1)

        def level(n: int) -> float:
            if n == 0:
                return 1 / V
            count, D = tables[n, n == top]
            h = history[len(history) - n + 1 :]
            if not followers[h]:
                return level(n - 1)
            total = sum(count(g) for g in followers[h])
            mass = sum(D[min(count(g), 3)] for g in followers[h])
            c = count(h + (w,)) if h + (w,) in raw else 0
            return (c - D[min(c, 3)]) / total + mass / total * level(n - 1)

        return level(top)

    return probability


def by_hand(data_dir, eval_tokens: int, seq_len: int, world_size: int) -> dict[str, float | int]:
    """The reference on the targets the val loaders of every rank give, each seeing what its doc_pos says."""
    tokenizer = load_data_tokenizer(data_dir)
    V, nbytes = tokenizer.vocab_size, tokenizer.token_bytes().tolist()
    train = [read_shard(path)[1].tolist() for path in list_shards(data_dir, "train")]
    probability = reference(train, V, tokenizer.eot_id, 4)
    nll, total_bytes, tokens = Counter(), 0, 0
    for rank in range(world_size):
        val = DataLoader(data_dir, "val", 3, seq_len, rank=rank, world_size=world_size)
        for inputs, targets, doc_pos in val.val_batches(eval_tokens):
            for x, y, pos in zip(inputs.tolist(), targets.tolist(), doc_pos.tolist()):
                for j, w in enumerate(y):
                    tokens, total_bytes = tokens + 1, total_bytes + nbytes[w]
                    for order, name in enumerate(NAMES, 1):
                        nll[name] -= math.log(probability(tuple(x[j - pos[j] : j + 1]), w, order)) if nbytes[w] else 0
    return {**{k: s / (math.log(2) * total_bytes) for k, s in nll.items()}, "tokens": tokens, "bytes": total_bytes}


@pytest.mark.parametrize(
    "eval_tokens, seq_len, world_size", [(40, 8, 1), (10**6, 8, 1), (70, 6, 2), (10**6, 7, 3), (50, 1, 2)]
)
def test_matches_the_definitions_on_the_targets_the_val_loader_gives(toy_dir, eval_tokens, seq_len, world_size):
    got = ngram_bpb(toy_dir, eval_tokens, seq_len, world_size)
    expected = by_hand(toy_dir, eval_tokens, seq_len, world_size)
    assert (got["tokens"], got["bytes"]) == (expected["tokens"], expected["bytes"])
    for name in NAMES:
        assert got[name] == pytest.approx(expected[name], rel=0, abs=1e-9)
    assert got["best"] == min(NAMES, key=expected.__getitem__)


def synthetic(V: int, length: int = 3000, seed: int = 1) -> np.ndarray:
    """Documents of a few high and low token ids, each token hinting the next; EOT = 0."""
    rng = np.random.default_rng(seed)
    ids = np.array([1, 2, 3, 4, 5, V - 3, V - 2, V - 1])
    tokens = ids[(np.cumsum(rng.integers(0, 3, length)) + rng.integers(0, 2, length)) % ids.size]
    tokens[rng.random(length) < 0.08] = 0
    tokens[0] = 0
    return tokens


# 30 tokens leave counts of counts at zero (the k/2 discounts); order 10 is longer than every row
@pytest.mark.parametrize("length, max_order", [(30, 4), (3000, 4), (3000, 10)])
def test_every_probability_is_the_definitions(length, max_order):
    model = KneserNey([synthetic(9, length)], 9, eot_id=0, max_order=max_order)
    probability = reference([synthetic(9, length).tolist()], 9, eot=0, max_order=max_order)
    rows = synthetic(9, 20 * 6 + 1, seed=2)[np.arange(20)[:, None] * 6 + np.arange(7)]
    expected = np.zeros((max_order, 20, 6))
    for (order, r, j), _ in np.ndenumerate(expected):
        start = max([i for i in range(j + 1) if rows[r, i] == 0], default=0)  # the row start, or its latest EOT
        expected[order, r, j] = probability(tuple(rows[r, start : j + 1].tolist()), rows[r, j + 1], order + 1)
    np.testing.assert_allclose(model.probabilities(rows), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("V", [9, 49152, 65536])
def test_every_model_sums_to_one_over_the_vocabulary(V):
    model = KneserNey([synthetic(V)], V, eot_id=0, max_order=4)
    for history in [(V - 1, V - 1, V - 2), (1, 2, 3), (3, 2, 1), (0, V - 1, 2), (V - 2,), (0,), (4, 0)]:
        rows = np.array([[*history, w] for w in range(V)])
        sums = model.probabilities(rows)[:, :, -1].sum(axis=1)
        np.testing.assert_allclose(sums, 1, rtol=0, atol=1e-12)


def test_the_context_is_cut_at_a_document_start_and_a_row_start():
    model = KneserNey([synthetic(9)], 9, eot_id=0, max_order=4)
    after_one = model.probabilities(np.array([[0, 1, 2, 0, 3, 4]]))[:, 0]
    after_another = model.probabilities(np.array([[0, 5, 6, 7, 0, 3, 4]]))[:, 0, 1:]
    fresh = model.probabilities(np.array([[0, 3, 4]]))[:, 0]
    np.testing.assert_array_equal(after_one[:, 3:], after_another[:, 3:])  # 3 and 4 see only "0 3"
    np.testing.assert_array_equal(after_one[:, 3:], fresh)
    assert not np.array_equal(after_one[:, :3], after_another[:, :3])  # the tokens before the EOT differ
    row = model.probabilities(np.array([[5, 6, 7, 8]]))[:, 0]  # a row start sees one token: the bigram scores it
    np.testing.assert_array_equal(row[2:, 0], [row[1, 0]] * 2)
    assert row[3, 2] != row[1, 2]


class ConstantNLL(nn.Module):
    def forward(self, inputs, targets, doc_pos, reduction="none"):
        return torch.ones(targets.shape)


def test_on_text_each_order_is_below_the_last_and_the_counts_are_evaluate_bpbs(demo_data_dir):
    T, budget = 64, 40 * 64 + 17
    got, tokenizer = ngram_bpb(demo_data_dir, budget, T), load_data_tokenizer(demo_data_dir)
    assert got["4gram"] < got["trigram"] < got["bigram"] < got["unigram"] < math.log2(tokenizer.vocab_size)
    assert got["best"] == "4gram"
    token_bytes = tokenizer.token_bytes()
    loader = DataLoader(demo_data_dir, "val", 8, T)
    reference = evaluate_bpb(ConstantNLL(), loader.val_batches(budget), token_bytes)
    assert (got["tokens"], got["bytes"]) == (reference["tokens"], reference["bytes"])


def test_bad_input_is_named(toy_dir, tmp_path):
    with pytest.raises(PPTError, match="seq_len and world_size must be positive"):
        ngram_bpb(toy_dir, 100, 0)
    with pytest.raises(PPTError, match="holds no row of 8 tokens per rank"):
        ngram_bpb(toy_dir, 7, 8)
    with pytest.raises(PPTError, match="meta.json is missing"):
        ngram_bpb(tmp_path, 100, 8)
    with pytest.raises(PPTError, match="max_order must be at least 1"):
        ngram_bpb(toy_dir, 100, 8, max_order=0)
    with pytest.raises(PPTError, match="max_order must be 1 to 4 .* got 5"):
        KneserNey([synthetic(8192)], 8192, 0, max_order=5)
    with pytest.raises(PPTError, match="ngram_bpb's result and a margin of at least 0"):
        in_ngram_regime(2.0, {"bigram": 2.0}, 0.02)
    with pytest.raises(PPTError, match="margin -0.1"):
        in_ngram_regime(2.0, {"bigram": 2.0, "best": "bigram"}, -0.1)


def test_orders_are_capped_where_codes_outgrow_64_bits(toy_dir):
    assert [largest_order(V) for V in (8192, 49152, 65536, 65537, 2**21)] == [4, 4, 4, 3, 3]
    assert [key for key in ngram_bpb(toy_dir, 100, 8, max_order=2)] == ["unigram", "bigram", "best", "tokens", "bytes"]


def test_a_loss_within_the_margin_of_the_best_count_model_is_in_the_ngram_regime():
    counts = {"unigram": 3.0, "bigram": 2.1, "4gram": 1.7, "best": "4gram", "tokens": 10, "bytes": 30}
    assert [in_ngram_regime(bpb, counts) for bpb in (2.5, 1.7, 1.69, 1.67, 1.2)] == [True, True, True, False, False]
    assert in_ngram_regime(1.67, counts, margin=0.05)
