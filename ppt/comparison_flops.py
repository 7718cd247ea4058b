"""Comparison FLOPs: one rule for every token mixer, read from the trace of ppt/flops.py (SPEC.md, "Measurement";
docs/flops.md). What runs are compared by; MFU keeps its own convention (ppt/flops.py)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ppt.common import PPTError
from ppt.flops import traced_step, unwrap_model


@dataclass
class ComparisonFlops:
    """The comparison-FLOPs rule of one model at one row length, described by a traced forward.

    A step's comparison FLOPs are 3 x the forward FLOPs the model's math needs for the tokens trained on: 6 N per
    token (N: matmul parameters, a tied head once) plus 3 x every token mixer's forward FLOPs over the (query, key)
    pairs it needs. A query at document position p needs min(reach, p + 1) keys of a head: reach is the row length
    (the whole document prefix) for causal attention, the window for screening. A mixer that no pair formula
    describes counts at its traced (dense) forward FLOPs per row; `dense` lists those. A mixer may also declare its
    pairs itself (ppt.flops.declare_token_mixer). A model whose forward cannot be traced on meta gets a rule that
    says why (`untraced`) and counts 6N alone, N estimated from the parameters.
    """

    seq_len: int
    params_matmul: int
    # per (op, model part), in model order: {"op", "part", "calls"} and "heads": [[FLOPs per pair, reach, how many
    # heads per row], ...] for pair-counted calls and/or "dense_flops_per_row" for the rest
    mixers: list[dict]
    untraced: str | None = None  # why the trace failed: then N is every parameter of 2+ dimensions and no mixer counts

    def __post_init__(self) -> None:
        keys = np.arange(1, self.seq_len + 1, dtype=np.int64)  # keys a query at document position p has: p + 1
        self._position_flops = np.zeros(self.seq_len, dtype=np.int64)  # mixer forward FLOPs of a query at p
        for mixer in self.mixers:
            for flops_per_pair, reach, heads in mixer.get("heads", []):
                self._position_flops += flops_per_pair * heads * np.minimum(keys, reach)
        self._dense_flops_per_row = sum(mixer.get("dense_flops_per_row", 0) for mixer in self.mixers)

    @property
    def dense(self) -> list[dict]:
        """The mixers counted at their dense traced cost."""
        return [mixer for mixer in self.mixers if "dense_flops_per_row" in mixer]

    def warning(self) -> str | None:
        """One line saying what this rule cannot count as the rule says: a failed trace, or the mixers counted
        densely and how to count them by their pairs; None if there is nothing to say."""
        if self.untraced:
            return (
                f"comparison FLOPs count 6N alone (N = {self.params_matmul:,}, every parameter of 2 or more "
                f"dimensions) and no token mixer: {self.untraced}"
            )
        if not self.mixers:
            return (
                "comparison FLOPs found no token mixer in the traced forward, so they count 6N alone: the trace finds "
                "a mixer in matmuls between activations, SDPA, custom ops and declarations, not in elementwise "
                "products or cumsums. Call ppt.flops.declare_token_mixer in the mixer's forward (docs/flops.md)"
            )
        if not self.dense:
            return None
        names = ", ".join(f"{mixer['op']} in {mixer['part']}" for mixer in self.dense)
        return (
            f"comparison FLOPs: {names} mixes tokens with matmuls no pair formula describes, so it counts at its dense "
            "traced cost (every pair it computes). To count only the pairs it needs, call "
            "F.scaled_dot_product_attention(is_causal=True), declare them with ppt.flops.declare_token_mixer in its "
            "forward, or make it a custom op with a PAIR_FORMULAS entry beside it (docs/flops.md)"
        )

    def step_flops(self, doc_pos_counts: np.ndarray) -> int:
        """Comparison FLOPs of training on tokens whose document positions are counted by `doc_pos_counts`
        (counts[p] = tokens at document position p; with whole rows as documents, every p once per row). Exact."""
        counts = np.asarray(doc_pos_counts, dtype=np.int64)
        if counts.shape != (self.seq_len,):
            raise PPTError(
                f"document-position counts must have one entry per position of a {self.seq_len}-token row, got shape "
                f"{counts.shape}"
            )
        tokens = int(counts.sum())
        mixers = int(counts @ self._position_flops) + self._dense_flops_per_row * tokens // self.seq_len
        return 6 * self.params_matmul * tokens + 3 * mixers

    def per_token(self, doc_pos_counts: np.ndarray | None = None) -> float:
        """Comparison FLOPs per token of these document positions (default: one document per row)."""
        counts = np.ones(self.seq_len, dtype=np.int64) if doc_pos_counts is None else np.asarray(doc_pos_counts)
        return self.step_flops(counts) / int(counts.sum())

    def state_dict(self) -> dict:
        """Plain JSON-able values: what checkpoints and manifests store."""
        state = {"seq_len": self.seq_len, "params_matmul": self.params_matmul, "mixers": self.mixers}
        return state | ({"untraced": self.untraced} if self.untraced else {})

    @classmethod
    def from_state_dict(cls, state: dict) -> ComparisonFlops:
        return cls(int(state["seq_len"]), int(state["params_matmul"]), list(state["mixers"]), state.get("untraced"))


def comparison_flops_rule(model: nn.Module, seq_len: int) -> ComparisonFlops:
    """The comparison-FLOPs rule of `model` for rows of `seq_len` tokens, read from one traced forward of one row.

    Learned reaches (screening windows) are read at the model's current values, so call it again when they may have
    moved. The trace runs on meta: a fraction of a second for a 360M model. A model that cannot be traced (a forward
    with value-dependent code, a custom op without a cost formula) gets the `untraced` rule instead of an error, so
    that it still trains; its `warning()` says what the rule could not count.
    """
    model = unwrap_model(model)
    try:
        trace = traced_step(model, 1, seq_len, torch.float32, backward=False)
    except PPTError as exc:
        params = {id(p): p.numel() for p in model.parameters() if p.ndim >= 2}  # a shared (tied) tensor once
        return ComparisonFlops(seq_len, sum(params.values()), [], untraced=str(exc))
    mixers = []
    for (op, part), tally in trace.counted_mixers().items():
        mixer: dict = {"op": op, "part": part, "calls": tally["calls"]}
        heads: Counter = Counter()
        for (flops_per_pair, reach), count in tally["heads"].items():
            heads[(round(flops_per_pair), seq_len if math.isinf(reach) else min(seq_len, math.ceil(reach)))] += count
        if heads:
            mixer["heads"] = [[flops_per_pair, reach, count] for (flops_per_pair, reach), count in heads.items()]
        if tally["dense_flops"]:
            mixer["dense_flops_per_row"] = round(tally["dense_flops"])
        mixers.append(mixer)
    return ComparisonFlops(seq_len, round(trace.weight_flops / (2 * seq_len)), mixers)
