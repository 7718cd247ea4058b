import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from ppt.baselines import ngram_bpb
from ppt.common import PPTError
from ppt.data import DataLoader
from ppt.loss_eval import evaluate_bpb
from ppt.shard_writer import new_meta
from ppt.shards import list_shards, load_data_tokenizer, read_shard, shard_path, write_meta, write_shard
from ppt.tokenizer import train_demo_tokenizer


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


def by_hand(data_dir, eval_tokens: int, seq_len: int, world_size: int) -> dict[str, float | int]:
    """Counts in dicts, probabilities one target at a time, over the targets the val loaders of every rank give."""
    tokenizer = load_data_tokenizer(data_dir)
    V, nbytes = tokenizer.vocab_size, tokenizer.token_bytes().tolist()
    pairs = Counter()
    for path in list_shards(data_dir, "train"):
        tokens = read_shard(path)[1].tolist()
        pairs.update(zip(tokens[:-1], tokens[1:]))
    unigram_counts, context_counts, followers = Counter(), Counter(), Counter()
    for (v, w), n in pairs.items():
        unigram_counts[w] += n
        context_counts[v] += n
        followers[v] += 1
    total = sum(pairs.values())
    scored = []
    for rank in range(world_size):
        val = DataLoader(data_dir, "val", 3, seq_len, rank=rank, world_size=world_size)
        for inputs, targets, _ in val.val_batches(eval_tokens):
            scored += zip(inputs.flatten().tolist(), targets.flatten().tolist())
    nll = {"unigram": 0.0, "bigram": 0.0}
    for v, w in scored:
        p = (unigram_counts[w] + 1) / (total + V)
        c, t = context_counts[v], followers[v]
        q = (pairs[v, w] + t * p) / (c + t) if c else p
        if nbytes[w]:
            nll["unigram"] -= math.log(p)
            nll["bigram"] -= math.log(q)
    total_bytes = sum(nbytes[w] for _, w in scored)
    return {**{k: s / (math.log(2) * total_bytes) for k, s in nll.items()}, "tokens": len(scored), "bytes": total_bytes}


@pytest.mark.parametrize("eval_tokens, seq_len, world_size", [(40, 8, 1), (10**6, 8, 1), (70, 6, 2), (10**6, 7, 3)])
def test_matches_a_hand_computation_on_the_targets_the_val_loader_gives(toy_dir, eval_tokens, seq_len, world_size):
    got = ngram_bpb(toy_dir, eval_tokens, seq_len, world_size)
    expected = by_hand(toy_dir, eval_tokens, seq_len, world_size)
    assert (got["tokens"], got["bytes"]) == (expected["tokens"], expected["bytes"])
    assert got["unigram"] == pytest.approx(expected["unigram"], rel=0, abs=1e-9)
    assert got["bigram"] == pytest.approx(expected["bigram"], rel=0, abs=1e-9)


class ConstantNLL(nn.Module):
    def forward(self, inputs, targets, doc_pos, reduction="none"):
        return torch.ones(targets.shape)


def test_on_text_the_bigram_is_below_the_unigram_and_the_counts_are_evaluate_bpbs(demo_data_dir):
    T, budget = 64, 40 * 64 + 17
    got = ngram_bpb(demo_data_dir, budget, T)
    assert got["bigram"] < got["unigram"] < math.log2(load_data_tokenizer(demo_data_dir).vocab_size)
    token_bytes = load_data_tokenizer(demo_data_dir).token_bytes()
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
