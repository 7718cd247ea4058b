"""The comparison-FLOPs rule: against a brute-force count of needed pairs for a grouped-query decoder, the loader's
document-position counts, mixers without a pair formula, and exact counts through a training run. (Multiscreen's
learned windows, and a resumed run that refreshes the rule, are tests/test_model.py's.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import third_arch
import torch
import torch.nn as nn
import torch.nn.functional as F

from ppt.comparison_flops import ComparisonFlops, comparison_flops_rule
from ppt.data import DataLoader
from ppt.flops import OpFormulas, declare_token_mixer
from scripts import base_train


def random_doc_pos(rows: int, T: int, seed: int) -> np.ndarray:
    """Rows packed with documents of random lengths (some longer than the row), as the loader builds doc_pos."""
    rng = np.random.default_rng(seed)
    doc_pos = np.zeros((rows, T), dtype=np.int64)
    for row in doc_pos:
        start = -int(rng.integers(0, 2 * T))  # a fragment of a document begun before the row counts from the row start
        for t in range(T):
            if t and rng.random() < 0.08:
                start = t
            row[t] = t - max(start, 0)
    return doc_pos


def brute_force(doc_pos: np.ndarray, N: int, heads: list[tuple[int, float]]) -> int:
    """6 N per token + 3 x sum over heads (FLOPs per pair, window) and queries t of FLOPs per pair x the keys j the
    model may use: j <= t, j in t's document, t - j < window."""
    pairs = 0
    for row in doc_pos:
        for t, p in enumerate(row):
            for flops_per_pair, window in heads:
                pairs += flops_per_pair * sum(1 for j in range(t - p, t + 1) if t - j < window)
    return 6 * N * doc_pos.size + 3 * pairs


def matmul_params(model: nn.Module) -> int:
    """Every matrix (or per-head stack of matrices) once: the tied head shares the embedding's."""
    return sum(p.numel() for p in model.parameters() if p.ndim >= 2)


def test_a_gqa_decoder_counts_causal_in_document_pairs_at_every_query_head():
    model = third_arch.build(n_head=4, n_kv_head=2)
    L, H, Q = model.config.n_layer, model.config.n_head, model.config.d_model // model.config.n_head
    doc_pos = random_doc_pos(3, 40, seed=1)
    rule = comparison_flops_rule(model, 40)
    counts = np.bincount(doc_pos.ravel(), minlength=40)
    n = matmul_params(model) - model.wpe.weight.numel()  # the position table is read by index, not multiplied
    assert rule.params_matmul == n
    assert rule.step_flops(counts) == brute_force(doc_pos, n, [(2 * (Q + Q), math.inf)] * L * H)
    assert rule.warning() is None
    # one document per row: 6N + 3 x 4 x L x H x Q x (T + 1) / 2, half the MFU convention's attention term
    assert rule.per_token() == 6 * rule.params_matmul + 6 * L * H * Q * 41


class EinsumAttentionLM(nn.Module):
    """Causal attention written by hand: the trace cannot tell which of the T x T pairs it needs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 48, bias=False)

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        q, k, v = self.qkv(self.embed(idx)).chunk(3, dim=-1)
        T = idx.shape[1]
        scores = torch.einsum("btd,bsd->bts", q, k).masked_fill(torch.ones(T, T).triu(1).bool().to(idx.device), -1e9)
        y = torch.einsum("bts,bsd->btd", scores.softmax(-1), v)
        return F.cross_entropy(F.linear(y, self.embed.weight).flatten(0, 1), targets.flatten())


def test_a_mixer_without_a_pair_formula_counts_densely_and_says_so():
    rule = comparison_flops_rule(EinsumAttentionLM(), 8)
    [mixer] = rule.dense
    assert (mixer["op"], mixer["calls"], mixer["dense_flops_per_row"]) == ("bmm", 2, 2 * (2 * 8 * 8 * 16))  # q.k, p.v
    assert rule.per_token() == 6 * (16 * 48 + 64 * 16) + 3 * 2 * (2 * 8 * 8 * 16) / 8
    assert "bmm in (top level): ppt.flops.declare_token_mixer([(2 * (d_qk + d_v), reach)] * n_heads)" in rule.warning()


class LinearAttentionLM(nn.Module):
    """Causal linear attention whose state is built by outer products and a cumsum: no matmul between activations.
    `declare`: its forward tells the rule what it needs, as a researcher's model.py would."""

    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.declare = declare
        self.embed = nn.Embedding(64, 16)
        self.qkv = nn.Linear(16, 48, bias=False)

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        q, k, v = self.qkv(self.embed(idx)).chunk(3, dim=-1)
        if self.declare:
            declare_token_mixer([(4 * 16 * 16, 1)])  # one head; per token: the state update k v^T and the read q S
        state = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(dim=1)  # (B, T, dK, dV)
        y = (q.unsqueeze(-1) * state).sum(dim=-2)
        return F.cross_entropy(F.linear(y, self.embed.weight).flatten(0, 1), targets.flatten())


class DeclaredEinsumAttentionLM(EinsumAttentionLM):
    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        declare_token_mixer([(2 * (16 + 16), math.inf)])  # one head over the causal prefix, as SDPA counts
        return super().forward(idx, targets, doc_pos, reduction)


def test_a_mixer_the_trace_cannot_see_is_reported_not_counted_as_zero_silently():
    rule = comparison_flops_rule(LinearAttentionLM(declare=False), 8)
    assert rule.mixers == [] and rule.per_token() == 6 * (16 * 48 + 64 * 16)
    assert "no token mixer" in rule.warning() and "declare_token_mixer" in rule.warning()


def test_a_declared_mixer_counts_its_pairs_in_place_of_what_the_trace_saw():
    doc_pos = np.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    counts = np.bincount(doc_pos.ravel(), minlength=8)
    n = 16 * 48 + 64 * 16
    linear = comparison_flops_rule(LinearAttentionLM(declare=True), 8)
    assert linear.step_flops(counts) == 6 * n * 8 + 3 * (4 * 16 * 16) * 8  # reach 1: a cost per token
    assert linear.warning() is None
    declared = comparison_flops_rule(DeclaredEinsumAttentionLM(), 8)
    assert [m["op"] for m in declared.mixers] == ["declare_token_mixer"] and declared.dense == []  # no bmm left
    assert declared.step_flops(counts) == brute_force(doc_pos, n, [(64, math.inf)])
    assert declared.warning() is None


@pytest.mark.parametrize("heads", [[], [(0, 1)], [(64, 0.5)], [(float("nan"), 1)], [64]])
def test_a_bad_declaration_is_refused_by_name(heads):
    class BadLM(LinearAttentionLM):
        def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
            declare_token_mixer(heads)
            return super().forward(idx, targets)

    rule = comparison_flops_rule(BadLM(declare=False), 8)
    assert "declare_token_mixer takes one" in rule.untraced


def test_declare_token_mixer_does_nothing_in_training_and_compiles_into_one_graph():
    torch.manual_seed(0)
    model = LinearAttentionLM(declare=True)
    idx = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break would raise
    assert torch.equal(compiled(idx, idx), LinearAttentionLM.forward(model, idx, idx))


@torch.library.custom_op("ppt_test::window_mix", mutates_args=())
def window_mix(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    return x * window.sum()


@window_mix.register_fake
def _(x, window):
    return torch.empty_like(x)


window_mix.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


class WindowMixLM(nn.Module):
    """A researcher's mixer: a custom op whose heads look back a learned number of keys."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.log_window = nn.Parameter(torch.tensor([math.log(2.0), math.log(3.0)]))

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        x = self.embed(idx)
        x = x + window_mix(x, self.log_window.exp() + 1)  # windows 3 and 4
        return F.cross_entropy(F.linear(x, self.embed.weight).flatten(0, 1), targets.flatten())


def test_a_new_mixer_counts_through_the_pair_formula_handed_to_the_rule():
    formulas = OpFormulas(
        cost={torch.ops.ppt_test.window_mix: lambda x, window: {"flops": 0, "bytes": 0}},
        pairs={torch.ops.ppt_test.window_mix: lambda x, window: [(10, math.ceil(w)) for w in window.tolist()]},
    )
    model = WindowMixLM()
    rule = comparison_flops_rule(model, 8, formulas)
    doc_pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    counts = np.bincount(doc_pos.ravel(), minlength=8)
    assert rule.step_flops(counts) == brute_force(doc_pos, 64 * 16, [(10, 3), (10, 4)])
    assert rule.warning() is None
    with torch.no_grad():  # trained: windows 2 and 5, computed from the parameter by the ops the trace recorded
        model.log_window.copy_(torch.tensor([0.0, math.log(4.0)]))
    refreshed = rule.refreshed(model, formulas)
    assert refreshed.step_flops(counts) == brute_force(doc_pos, 64 * 16, [(10, 2), (10, 5)])
    assert refreshed == comparison_flops_rule(model, 8, formulas)


class SlidingWindowLM(EinsumAttentionLM):
    """Sliding-window attention through SDPA with a mask tensor, which the trace cannot read: 3 keys per query."""

    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.declare = declare

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        if self.declare:
            declare_token_mixer([(2 * (16 + 16), 3)])  # one head, its window
        q, k, v = self.qkv(self.embed(idx)).unsqueeze(1).chunk(3, dim=-1)
        T = idx.shape[1]
        window = torch.ones(T, T, device=idx.device).tril().triu(-2).bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        return F.cross_entropy(F.linear(y.squeeze(1), self.embed.weight).flatten(0, 1), targets.flatten())


def test_sdpa_with_a_mask_counts_densely_until_its_pairs_are_declared_with_the_line_it_names():
    rule = comparison_flops_rule(SlidingWindowLM(declare=False), 8)
    [mixer] = rule.dense
    assert mixer["op"] == "scaled_dot_product_attention" and mixer["dense_flops_per_row"] == 2 * 8 * 8 * (16 + 16)
    line = "scaled_dot_product_attention in (top level): ppt.flops.declare_token_mixer([(64, reach)] * 1)"
    assert line in rule.warning()  # the numbers the trace knows: 2 (d_qk + d_v) and the heads
    declared = comparison_flops_rule(SlidingWindowLM(declare=True), 8)
    doc_pos = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    assert declared.dense == [] and declared.warning() is None
    assert declared.step_flops(np.ones(8, dtype=np.int64)) == brute_force(doc_pos, 16 * 48 + 64 * 16, [(64, 3)])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_loader_counts_the_document_positions_of_the_batches_it_returned(short_docs, prefetch):
    loader = DataLoader(short_docs, "train", 3, 32, seed=5, prefetch=prefetch)
    batches = [next(loader) for _ in range(4)]
    expected = np.bincount(torch.cat([b[2] for b in batches]).numpy().ravel(), minlength=32)
    assert np.array_equal(loader.take_doc_pos_counts(), expected)
    assert expected[0] > 3 * 4 and expected.sum() == 3 * 4 * 32  # documents start inside rows
    assert not loader.take_doc_pos_counts().any()  # handed over, so counted once
    next(loader)
    loader.load_state_dict(loader.state_dict())
    assert not loader.take_doc_pos_counts().any()
    loader.close()


# ---- through training ------------------------------------------------------------------------------------------


def run_argv(data: Path, out: Path, config: str, *extra: str) -> list[str]:
    return [
        "--config", config, "--data-dir", str(data), "--out-dir", str(out), "--tag", out.name, "--seq-len", "32",
        "--total-batch-tokens", "128", "--device-batch-size", "2", "--target-tokens", str(6 * 128),
        "--eval-every", "0", "--eval-tokens", "64", "--save-every", "0", "--compile", "off", "--device", "cpu", *extra,
    ]  # fmt: skip


def step_rows(out: Path) -> list[tuple[int, int, float]]:
    history = json.loads((out / f"{out.name}.json").read_text())["history"]
    return [(h["step"], h["comparison_flops"], h["loss"]) for h in history if "loss" in h]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_a_run_counts_the_documents_of_the_batches_it_trained_on(short_docs, tmp_path):
    out = tmp_path / "vanilla"
    base_train.main(run_argv(short_docs, out, "gpt2-tiny", "--data-seed", "3"))
    manifest = json.loads((out / "vanilla.json").read_text())
    rule = ComparisonFlops.from_state_dict(manifest["comparison_flops_rule"])
    loader = DataLoader(short_docs, "train", 2, 32, seed=3, prefetch=0)  # the run's batches, again
    expected, total, cfg = [], 0, third_arch.CONFIGS["gpt2-tiny"]
    for _ in range(6):
        doc_pos = torch.cat([next(loader)[2] for _ in range(2)]).numpy()
        heads = [(4 * cfg.d_model // cfg.n_head, math.inf)] * cfg.n_layer * cfg.n_head
        total += brute_force(doc_pos, rule.params_matmul, heads)
        expected.append(total)
    assert [flops for _, flops, _ in step_rows(out)] == expected
    assert manifest["final_val"]["comparison_flops"] == manifest["comparison_flops"] == total

    out = tmp_path / "whole-rows"
    base_train.main(run_argv(short_docs, out, "gpt2-tiny", "--data-seed", "3", "--no-doc-masks"))
    flops = [flops for _, flops, _ in step_rows(out)]
    assert flops == [k * 128 * rule.per_token() for k in range(1, 7)]  # every row one document
    assert flops[-1] > total
