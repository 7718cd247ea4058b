"""Comparison FLOPs: one rule for every token mixer, read from the token mixer calls the trace of ppt/flops.py lists
(SPEC.md, "Measurement"; docs/flops.md). What runs are compared by; MFU keeps its own convention (ppt/flops.py)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn

from ppt.common import PPTError
from ppt.flops import NO_FORMULAS, MixerCall, OpFormulas, _Trace, traced_step, unwrap_model


@dataclass
class ComparisonFlops:
    """The comparison-FLOPs rule of one model at one row length: 6N per token plus 3 x every token mixer's forward
    FLOPs over the (query, key) pairs it needs, min(reach, p + 1) keys of a head for a query at document position p.
    A mixer whose pairs are not known counts at its traced (dense) forward FLOPs per row (`dense` lists those)."""

    seq_len: int
    params_matmul: int
    # per (op, model part), in model order: {"op", "part", "calls"} and "heads": [[FLOPs per pair, reach, how many
    # heads per row], ...] for pair-counted calls and/or "dense_flops_per_row" for the rest (with, where the trace
    # saw the heads but not their reach, "heads_of_unknown_reach": [FLOPs per pair, heads per row] of one call)
    mixers: list[dict]
    untraced: str | None = None  # why the trace failed: then N is every parameter of 2+ dimensions and no mixer counts
    trace: object = field(default=None, repr=False, compare=False)  # what `refreshed` replays (ppt.flops._Trace)

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
        declarations = []
        for mixer in self.dense:
            flops_per_pair, heads = mixer.get("heads_of_unknown_reach", ("2 * (d_qk + d_v)", "n_heads"))
            call = f"ppt.flops.declare_token_mixer([({flops_per_pair}, reach)] * {heads})"
            declarations.append(f"{mixer['op']} in {mixer['part']}: {call}")
        return (
            "comparison FLOPs count a token mixer at its dense traced cost (every pair it computes), not the pairs it "
            f"needs, until its module's forward declares them: {'; '.join(declarations)}, where reach is how many keys "
            "back a query needs at most (its window; math.inf for the whole prefix; docs/flops.md)"
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

    def refreshed(self, model: nn.Module, formulas: OpFormulas = NO_FORMULAS) -> ComparisonFlops:
        """The rule at the model's current learned reaches (windows move as it trains): its trace's small-tensor ops and
        pair formulas run again on the new values, in milliseconds where a new trace of the forward takes a fraction of
        a second; the same rule as a new trace. A rule without a trace (one loaded from a checkpoint) traces anew."""
        if self.trace is None:
            return comparison_flops_rule(model, self.seq_len, formulas)
        mixers = _counted_mixers(self.trace.replayed_mixers(unwrap_model(model)), self.seq_len)
        return ComparisonFlops(self.seq_len, self.params_matmul, mixers, trace=self.trace)

    def state_dict(self) -> dict:
        """Plain JSON-able values: what checkpoints and manifests store."""
        state = {"seq_len": self.seq_len, "params_matmul": self.params_matmul, "mixers": self.mixers}
        return state | ({"untraced": self.untraced} if self.untraced else {})

    @classmethod
    def from_state_dict(cls, state: dict) -> ComparisonFlops:
        return cls(int(state["seq_len"]), int(state["params_matmul"]), list(state["mixers"]), state.get("untraced"))


def comparison_flops_rule(
    model: nn.Module, seq_len: int, formulas: OpFormulas = NO_FORMULAS, trace: _Trace | None = None
) -> ComparisonFlops:
    """The rule of `model` for rows of `seq_len` tokens, from one traced forward of one row (learned reaches such as
    screening windows at their current values), or from `trace`, a traced step of one row whose forward is that
    (its mixers and weight FLOPs do not depend on autocast or the backward: base_train traces a step once for MFU and
    this rule). A model that cannot be traced gets the `untraced` rule, 6N alone with N every parameter of 2+
    dimensions, instead of an error, so that it still trains."""
    model = unwrap_model(model)
    try:
        trace = trace or traced_step(model, 1, seq_len, torch.float32, backward=False, formulas=formulas)
    except PPTError as exc:
        params = {id(p): p.numel() for p in model.parameters() if p.ndim >= 2}  # a shared (tied) tensor once
        return ComparisonFlops(seq_len, sum(params.values()), [], untraced=str(exc))
    params_matmul = round(trace.weight_flops / (2 * seq_len))
    return ComparisonFlops(seq_len, params_matmul, _counted_mixers(trace.mixers, seq_len), trace=trace)


def _counted_mixers(calls: list[MixerCall], seq_len: int) -> list[dict]:
    """The mixer calls of one row, tallied per (op, model part) in model order. In a part with a declaration, the
    declaration alone counts; a call whose heads all have a known reach counts by its pairs, any other densely."""
    declared = {call.part for call in calls if call.op == "declare_token_mixer"}
    mixers: dict[tuple[str, str], dict] = {}
    pairs: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for op, part, flops_per_row, heads in calls:
        if part in declared and op != "declare_token_mixer":
            continue
        mixer = mixers.setdefault((op, part), {"op": op, "part": part, "calls": 0})
        mixer["calls"] += 1
        if heads and not any(math.isnan(reach) for _, reach in heads):
            pairs[op, part].update((round(fpp), math.ceil(min(seq_len, reach))) for fpp, reach in heads)
            continue
        mixer["dense_flops_per_row"] = mixer.get("dense_flops_per_row", 0.0) + flops_per_row
        if heads:  # the trace knows the heads, not how many pairs each needs
            mixer["heads_of_unknown_reach"] = [round(heads[0][0]), len(heads)]
    for key, mixer in mixers.items():
        if pairs[key]:
            mixer["heads"] = [[flops_per_pair, reach, count] for (flops_per_pair, reach), count in pairs[key].items()]
        if "dense_flops_per_row" in mixer:
            mixer["dense_flops_per_row"] = round(mixer["dense_flops_per_row"])
    return list(mixers.values())
