"""Multiscreen screening: windowed, document-masked, unnormalized retrieval as a torch custom op.

For each batch row b, head h and query position i (all tensors are (B, T, H, D), like the model's projections):

    s_ij     = q_i . k_j                                   (q, k unit-normalized per head by the caller)
    alpha_ij = max(1 - rho_h * (1 - s_ij), 0)^2            (trim-and-square; rho = 1/r, the acceptance multiplier)
    m_ij     = (cos(pi * (i - j) / w_h) + 1) / 2           if 0 <= i - j < w_h and j >= doc_start_i, else 0
    h_i      = sum_j alpha_ij * m_ij * v_j                 (no normalization)

`w_h = inf` makes head h see its whole document prefix with m = 1. Gradients flow to q, k, v, window and rho.

`screening(q, k, v, window, rho, screening_metadata(doc_pos))` is the custom op `ppt::screening` (Triton on CUDA,
plain torch elsewhere; autograd and torch.compile), `screening_reference` the same in plain PyTorch (float64-capable).
COST_FORMULAS, FLOP_FORMULAS and PAIR_FORMULAS count it for ppt.flops and FlopCounterMode (`screening_cost`).

Shapes and dtypes: q, k (B, T, H, dK); v (B, T, H, dV); bf16, fp16, fp32 (and fp64 on CPU); window, rho (H,)
float32; meta = (doc_start, doc_end), both (B, T) int32. The CUDA kernels tile head dims of 16, 32, 64 or 128.
Window values (w > 0, not NaN) are checked on the CPU path only: checking CUDA values would sync with the host on
every call, so on CUDA a non-positive or NaN window silently yields zeros or NaNs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

KERNEL_HEAD_DIMS = (16, 32, 64, 128)
_QUERY_CHUNK = 256  # the plain-torch paths materialize (B, H, chunk, T) scores, not (B, H, T, T)


# ----------------------------------------------------------------------------------------------------------------------
# Document metadata


def screening_metadata(doc_pos: Tensor) -> tuple[Tensor, Tensor]:
    """(doc_start, doc_end), both int32 (B, T), from doc_pos (B, T): built on doc_pos's device without a host sync.

    doc_start[t] = t - doc_pos[t] (clamped at 0) is the first key query t may see. doc_end[j] is the last query
    whose document reaches key j, max{i : doc_start[i] <= j}: the dK/dV pass stops there. It is found by a binary
    search in the suffix minimum of doc_start, so it is exact for any doc_pos, not only well-formed packings.
    """
    if doc_pos.dim() != 2 or doc_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"doc_pos must be an int32 or int64 (B, T) tensor, got {tuple(doc_pos.shape)} {doc_pos.dtype}")
    T = doc_pos.shape[1]
    positions = torch.arange(T, device=doc_pos.device, dtype=torch.int64).expand_as(doc_pos)
    doc_start = (positions - doc_pos.long()).clamp_(min=0)
    suffix_min = doc_start.flip(1).cummin(dim=1).values.flip(1).contiguous()
    doc_end = torch.searchsorted(suffix_min, positions.contiguous(), right=True) - 1
    return doc_start.to(torch.int32).contiguous(), doc_end.to(torch.int32).contiguous()


# ----------------------------------------------------------------------------------------------------------------------
# Input validation (shapes and dtypes only: free at trace time, no host sync)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, meta: tuple[Tensor, Tensor],
                  param_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:  # fmt: skip
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"screening expects q, k (B, T, H, dK) and v (B, T, H, dV) with equal B, T, H; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, _ = q.shape
    for name, t in (("window", window), ("rho", rho)):
        if t.shape != (H,) or t.dtype not in param_dtypes:
            raise ValueError(
                f"{name} must be a ({H},) tensor of {param_dtypes} (one value per head), got {tuple(t.shape)} {t.dtype}"
            )
    for name, t in zip(("doc_start", "doc_end"), meta):
        if t.shape != (B, T) or t.dtype != torch.int32:
            raise ValueError(
                f"meta {name} must be int32 ({B}, {T}); build meta with screening_metadata(doc_pos) for this batch, "
                f"got {tuple(t.shape)} {t.dtype}"
            )
    devices = {t.device for t in (q, k, v, window, rho, *meta)}
    if len(devices) != 1:
        raise ValueError(f"screening inputs must all live on one device, got {sorted(str(d) for d in devices)}")


def _check_kernel_inputs(q: Tensor, v: Tensor) -> None:
    if q.shape[-1] not in KERNEL_HEAD_DIMS or v.shape[-1] not in KERNEL_HEAD_DIMS:
        raise ValueError(
            f"the CUDA screening kernel tiles head dims {KERNEL_HEAD_DIMS}; got dK={q.shape[-1]}, dV={v.shape[-1]}. "
            f"Pick supported dims or run on CPU (plain-torch path)"
        )
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the CUDA screening kernel supports bf16, fp16 and fp32, got {q.dtype}")


# ----------------------------------------------------------------------------------------------------------------------
# Plain-PyTorch paths: the reference (autograd through torch ops) and an analytic backward for the CPU op


def _compute_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _chunk_terms(q_chunk: Tensor, k: Tensor, window: Tensor, rho: Tensor, doc_start_chunk: Tensor, i0: int):
    """For queries [i0, i0 + chunk) against keys [0, i0 + chunk): scores s, pre-trim base and softmask m (B, H, C, J;
    m = 0 outside the window and the document), and the phase pi * (i - j) / w (H, C, J) that d m / d w needs."""
    C, J = q_chunk.shape[1], k.shape[1]
    s = torch.einsum("bihd,bjhd->bhij", q_chunk, k)
    base = 1 - rho.view(1, -1, 1, 1) * (1 - s)
    keys = torch.arange(J, device=q_chunk.device)
    lag = (torch.arange(i0, i0 + C, device=q_chunk.device)[:, None] - keys[None, :]).to(s.dtype)
    phase = math.pi * lag / window.view(-1, 1, 1)  # w = inf gives phase 0, i.e. m = 1
    in_window = (lag >= 0) & (lag < window.view(-1, 1, 1))  # (H, C, J)
    in_doc = keys[None, None, :] >= doc_start_chunk[:, :, None]  # (B, C, J)
    valid = in_window[None] & in_doc[:, None]
    m = torch.where(valid, 0.5 * (torch.cos(phase) + 1), torch.zeros((), dtype=s.dtype, device=s.device))
    return s, base, m, phase


def screening_reference(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, meta: tuple[Tensor, Tensor]
) -> Tensor:
    """Plain-PyTorch screening, chunked over queries so memory stays O(T * chunk); computes in float32 (float64 for
    float64 inputs) and returns v's dtype."""
    _check_inputs(q, k, v, window, rho, meta, param_dtypes=(torch.float32, torch.float64))
    doc_start = meta[0]
    dtype = _compute_dtype(q)
    qc, kc, vc, w, r = (t.to(dtype) for t in (q, k, v, window, rho))
    T = q.shape[1]
    chunks = []
    for i0 in range(0, T, _QUERY_CHUNK):
        i1 = min(i0 + _QUERY_CHUNK, T)
        s, base, m, _ = _chunk_terms(qc[:, i0:i1], kc[:, :i1], w, r, doc_start[:, i0:i1], i0)
        weights = base.clamp(min=0).square() * m
        chunks.append(torch.einsum("bhij,bjhd->bihd", weights, vc[:, :i1]))
    return torch.cat(chunks, dim=1).to(v.dtype)


def _screening_backward_torch(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Analytic gradients in plain PyTorch (the CPU backward of the op; custom-op bodies run without autograd)."""
    dtype = _compute_dtype(q)
    qc, kc, vc, w, r, go = (t.to(dtype) for t in (q, k, v, window, rho, grad_out))
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    dw, dr = torch.zeros_like(w), torch.zeros_like(r)
    T = q.shape[1]
    for i0 in range(0, T, _QUERY_CHUNK):
        i1 = min(i0 + _QUERY_CHUNK, T)
        s, base, m, phase = _chunk_terms(qc[:, i0:i1], kc[:, :i1], w, r, doc_start[:, i0:i1], i0)
        trimmed = base.clamp(min=0)
        alpha = trimmed.square()
        g = torch.einsum("bihd,bjhd->bhij", go[:, i0:i1], vc[:, :i1])  # dL/d(alpha * m)
        dv[:, :i1] += torch.einsum("bhij,bihd->bjhd", alpha * m, go[:, i0:i1])
        d_base = g * m * 2 * trimmed  # dL/d(base); zero where trimmed or masked
        ds = d_base * r.view(1, -1, 1, 1)
        dq[:, i0:i1] = torch.einsum("bhij,bjhd->bihd", ds, kc[:, :i1])
        dk[:, :i1] += torch.einsum("bhij,bihd->bjhd", ds, qc[:, i0:i1])
        dr += (d_base * (s - 1)).sum(dim=(0, 2, 3))
        # d m / d w = sin(phase) * phase / (2 w), zero outside the mask (where m is zero) and for w = inf.
        dm_dw = torch.where(m > 0, 0.5 * torch.sin(phase) * phase / w.view(-1, 1, 1), torch.zeros_like(m))
        dw += (g * alpha * dm_dw).sum(dim=(0, 2, 3))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw.to(window.dtype), dr.to(rho.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The custom op: Triton on CUDA, the plain-torch paths elsewhere


@torch.library.custom_op("ppt::screening", mutates_args=())
def _screening_op(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor
) -> Tensor:
    if window.device.type == "cpu":  # value checks read the tensors: only where that costs no device sync
        if bool(torch.isnan(window).any()) or bool((window <= 0).any()):
            raise ValueError(
                f"window must be > 0 (inf allowed, meaning the full document prefix), got {window.tolist()}"
            )
        if not bool(torch.isfinite(rho).all()):
            raise ValueError(f"rho must be finite, got {rho.tolist()}")
    return screening_reference(q, k, v, window, rho, (doc_start, doc_end))


@_screening_op.register_kernel("cuda")
def _screening_cuda(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor
) -> Tensor:
    from ppt.kernels.screening_triton import screening_forward

    return screening_forward(q, k, v, window, rho, doc_start)


@_screening_op.register_fake
def _screening_fake(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor
) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("ppt::screening_backward", mutates_args=())
def _screening_backward_op(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _screening_backward_torch(q, k, v, window, rho, doc_start, grad_out)


@_screening_backward_op.register_kernel("cuda")
def _screening_backward_cuda(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from ppt.kernels.screening_triton import screening_backward

    return screening_backward(q, k, v, window, rho, doc_start, doc_end, grad_out)


@_screening_backward_op.register_fake
def _screening_backward_fake(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(t) for t in (q, k, v, window, rho))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor) -> tuple:
    q, k, v, window, rho, doc_start, doc_end = ctx.saved_tensors
    dq, dk, dv, dw, dr = _screening_backward_op(q, k, v, window, rho, doc_start, doc_end, grad_out.contiguous())
    return dq, dk, dv, dw, dr, None, None


_screening_op.register_autograd(_backward, setup_context=_setup_context)


def screening(q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, meta: tuple[Tensor, Tensor]) -> Tensor:
    """h (B, T, H, dV) = sum_j alpha_ij m_ij v_j (module docstring). meta comes from `screening_metadata(doc_pos)`."""
    _check_inputs(q, k, v, window, rho, meta)
    if q.device.type == "cuda":
        _check_kernel_inputs(q, v)
    q, k, v, doc_start, doc_end = (t.contiguous() for t in (q, k, v, *meta))  # what the kernels index
    return torch.ops.ppt.screening(q, k, v, window, rho, doc_start, doc_end)


# ----------------------------------------------------------------------------------------------------------------------
# Cost model for FLOP/byte counters


def _readable(t: Tensor | None) -> bool:
    """True when t holds real values (not meta, not a fake tensor under tracing)."""
    if t is None or t.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


def _pair_count(T: int, window: Tensor, meta: tuple[Tensor, Tensor] | Tensor | None, B: int, H: int) -> int:
    """In-window, in-document (query, key) pairs summed over batch and heads: query i has min(ceil(w), doc_pos_i + 1)
    keys. Without readable metadata each row is one document; without readable window values every causal pair
    counts (T (T + 1) / 2 per row and head), an upper bound."""
    if not _readable(window):
        return B * H * T * (T + 1) // 2
    doc_start = meta[0] if isinstance(meta, tuple) else meta
    if _readable(doc_start):
        keys_available = (torch.arange(T) - doc_start.detach().cpu().long() + 1).flatten()  # doc_pos + 1 per query
    else:
        keys_available = torch.arange(1, T + 1).repeat(B)
    total = 0
    for w in window.detach().cpu().double().tolist():
        reach = T if math.isinf(w) else math.ceil(w)
        total += int(keys_available.clamp(max=reach).sum())
    return total


def screening_cost(B: int, T: int, H: int, dK: int, dV: int, window: Tensor,
                   meta: tuple[Tensor, Tensor] | Tensor | None,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:  # fmt: skip
    """FLOPs and HBM bytes of one call over in-window, in-document pairs (`_pair_count`): forward 2 (dK + dV) FLOPs a
    pair (q.k and alpha m v), backward 4 (dK + dV) (dQ, dK, the score gradient and dV). Bytes, each tensor once:
    forward reads q, k, v and writes h; backward reads q, k, v, dh and writes dq, dk, dv."""
    pairs = _pair_count(T, window, meta, B, H)
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = B * T * H
    meta_bytes = 2 * 4 * B * T
    return {
        "pairs": pairs,
        "fwd_flops": 2 * (dK + dV) * pairs,
        "bwd_flops": 4 * (dK + dV) * pairs,
        "fwd_bytes": elem * tokens * (2 * dK + 2 * dV) + meta_bytes,
        "bwd_bytes": elem * tokens * (4 * dK + 3 * dV) + meta_bytes,
    }


def _op_cost(direction: str) -> Callable[..., dict[str, int]]:
    """{"flops", "bytes"} of one call of `ppt::screening` ("fwd") or `ppt::screening_backward` ("bwd"), from the op's
    own arguments."""

    def cost(q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, *args: object,
             **kwargs: object) -> dict[str, int]:  # fmt: skip
        counted = screening_cost(*q.shape, v.shape[-1], window, doc_start, q.dtype)
        return {"flops": counted[f"{direction}_flops"], "bytes": counted[f"{direction}_bytes"]}

    return cost


def needed_pairs(q: Tensor, k: Tensor, v: Tensor, window: Tensor, *args: object, **kwargs: object) -> list[tuple]:
    """For the comparison-FLOPs rule: per head, (forward FLOPs per needed pair, reach). A query needs the keys of its
    document inside its head's window, ceil(w) at most (math.inf for w = inf, and for every head when the window
    values cannot be read: the causal upper bound)."""
    flops_per_pair = 2 * (q.shape[-1] + v.shape[-1])
    if not _readable(window):
        return [(flops_per_pair, math.inf)] * q.shape[2]
    return [(flops_per_pair, math.inf if math.isinf(w) else math.ceil(w)) for w in window.detach().cpu().tolist()]


def _flops_only(cost_formula: Callable[..., dict[str, int]]) -> Callable[..., int]:
    def flops(*args: object, **kwargs: object) -> int:
        return cost_formula(*args, **kwargs)["flops"]

    # FlopCounterMode hands a formula marked _get_raw the op's tensors, not only their shapes: window values and
    # document metadata then reach _pair_count
    flops._get_raw = True
    return flops


# Keyed by op packet, as FlopCounterMode looks ops up; each takes the op's arguments (extra keywords such as
# out_val are ignored). COST_FORMULAS gives {"flops", "bytes"}, FLOP_FORMULAS the FLOPs alone.
COST_FORMULAS = {torch.ops.ppt.screening: _op_cost("fwd"), torch.ops.ppt.screening_backward: _op_cost("bwd")}
FLOP_FORMULAS = {op: _flops_only(cost_formula) for op, cost_formula in COST_FORMULAS.items()}
# ppt.flops's comparison rule: the pairs the forward op needs (the rule counts a backward as twice its forward)
PAIR_FORMULAS: dict[object, Callable[..., list[tuple]]] = {torch.ops.ppt.screening: needed_pairs}
