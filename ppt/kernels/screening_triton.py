"""Triton kernels of the screening op (math in ppt/kernels/screening.py's docstring).

Three kernels, one program per (batch row, head, tile), no atomics:
  forward : per query tile, loop over the key tiles its window and document reach
  dQ      : same loop; also writes per-program partial sums of d window and d rho (reduced by torch afterwards)
  dK/dV   : per key tile, loop over the query tiles whose window and document reach it
Loop bounds come from the window and the document metadata inside the kernel, so no host sync and no wasted tiles
outside [max(doc start, i0 - ceil(w) + 1), i1]; tiles wholly inside window and document skip the mask. The softmask
cos(pi (i - j) / w) is a rank-2 product cos a_i cos a_j + sin a_i sin a_j of per-row and per-column angles, taken
relative to the current tile (small angles stay accurate on long rows) and turned from tile to tile by angle
addition, so a program evaluates sin/cos once per row and column rather than once per pair.
Operands go to tensor cores in the input dtype (bf16/fp16) with fp32 accumulation; fp32 inputs use IEEE dots.
"""

# ruff: noqa: ANN001  (Triton reads a kernel argument's annotation as its type or constexpr marker)

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) per kernel: the fastest of a sweep on an H200 at the model's
# shape (dK 16, dV 64, windows 2..257; scripts/bench_screening.py --sweep). Small tiles win: most heads' windows are
# short, so larger tiles mostly compute masked-out pairs.
FORWARD_BLOCKS = (32, 16, 2, 3)
DQ_BLOCKS = (32, 16, 2, 2)
DKDV_BLOCKS = (16, 32, 1, 1)


@triton.jit
def _span(w, T):
    """ceil(min(w, T)) as int32: how many keys back a window reaches (w = inf reaches the whole row)."""
    return tl.ceil(tl.minimum(w, T.to(tl.float32))).to(tl.int32)


@triton.jit
def _rotate(cos_a, sin_a, cos_b, sin_b):
    """(cos, sin) of a + b from those of a and b: moves a tile's softmask angles to the next tile."""
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


@triton.jit
def _softmask(cos_row, sin_row, cos_col, sin_col):
    """(cos(row - col) + 1) / 2 over a tile, the angles being pi * position / w (angle addition: rank 2)."""
    return 0.5 + 0.5 * (cos_row[:, None] * cos_col[None, :] + sin_row[:, None] * sin_col[None, :])


@triton.jit
def _in_mask(i0, j0, w, doc_start_i, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which pairs of the (query tile at i0, key tile at j0) are causal, in the window and in the document."""
    offs_i = i0 + tl.arange(0, BLOCK_M)
    offs_j = j0 + tl.arange(0, BLOCK_N)
    lag = offs_i[:, None] - offs_j[None, :]
    return (lag >= 0) & (lag.to(tl.float32) < w) & (offs_j[None, :] >= doc_start_i[:, None])


@triton.jit
def _tile_is_inside(i0, j0, w, doc_start_max, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True when every pair of the tile is causal, in the window and in the document: the mask can be skipped."""
    return (j0 + BLOCK_N - 1 <= i0) & ((i0 + BLOCK_M - 1 - j0).to(tl.float32) < w) & (j0 >= doc_start_max)


@triton.jit
def _load_rows(PTR, b, start, T, stride_b, stride_t, col_offset, D: tl.constexpr, ROWS: tl.constexpr):
    """A (ROWS, D) tile of a contiguous (B, T, H, D) tensor, zeros past the end of the row."""
    offs = start + tl.arange(0, ROWS)
    ptrs = PTR + b * stride_b + offs[:, None] * stride_t + col_offset + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=(offs < T)[:, None], other=0.0)


@triton.jit
def _store_rows(PTR, x, b, start, T, stride_b, stride_t, col_offset, D: tl.constexpr, ROWS: tl.constexpr):
    offs = start + tl.arange(0, ROWS)
    ptrs = PTR + b * stride_b + offs[:, None] * stride_t + col_offset + tl.arange(0, D)[None, :]
    tl.store(ptrs, x.to(PTR.dtype.element_ty), mask=(offs < T)[:, None])


@triton.jit
def _query_tile_setup(DOC_START, b, i0, T, w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per query tile: doc_start of its rows, the largest of them, and the key range [first_key, last_key)."""
    offs_i = i0 + tl.arange(0, BLOCK_M)
    row_ok = offs_i < T
    doc_start_i = tl.load(DOC_START + b * T + offs_i, mask=row_ok, other=0)
    doc_start_min = tl.min(tl.where(row_ok, doc_start_i, T), axis=0)
    doc_start_max = tl.max(doc_start_i, axis=0)
    first_key = tl.maximum(doc_start_min, i0 - _span(w, T) + 1)
    first_key = (first_key // BLOCK_N) * BLOCK_N
    last_key = tl.minimum(i0 + BLOCK_M, T)
    return doc_start_i, doc_start_max, first_key, last_key


# Rows and columns of the (query x key) tile carry angles pi * position / w with positions relative to the
# current key tile: row angles start at pi (r + i0 - first_key) / w and turn by -pi BLOCK_N / w per key tile, column
# angles pi c / w stay put. A handful of sin/cos per program instead of one per column per tile.


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_vb, stride_vt,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    i0 = tl.program_id(1) * BLOCK_M
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    rho = tl.load(RHO + h)
    phase = 3.141592653589793 / w  # 0 for w = inf: the softmask is 1

    doc_start_i, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, w, BLOCK_M, BLOCK_N)
    q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    row_angle = (tl.arange(0, BLOCK_M) + (i0 - first_key)).to(tl.float32) * phase
    cos_row, sin_row = tl.cos(row_angle), tl.sin(row_angle)
    col_angle = tl.arange(0, BLOCK_N).to(tl.float32) * phase
    cos_col, sin_col = tl.cos(col_angle), tl.sin(col_angle)
    cos_step, sin_step = tl.cos(-BLOCK_N * phase), tl.sin(-BLOCK_N * phase)

    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        trimmed = tl.maximum(1.0 - rho + rho * s, 0.0)
        m = _softmask(cos_row, sin_row, cos_col, sin_col)
        if not _tile_is_inside(i0, j0, w, doc_start_max, BLOCK_M, BLOCK_N):
            m = tl.where(_in_mask(i0, j0, w, doc_start_i, BLOCK_M, BLOCK_N), m, 0.0)
        p = trimmed * trimmed * m
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        cos_row, sin_row = _rotate(cos_row, sin_row, cos_step, sin_step)
    _store_rows(OUT, acc, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)


@triton.jit
def _dq_kernel(
    Q, K, V, DOUT, DQ, DW_PART, DRHO_PART, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_vb, stride_vt,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    i0 = tile * BLOCK_M
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    rho = tl.load(RHO + h)
    phase = 3.141592653589793 / w

    doc_start_i, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, w, BLOCK_M, BLOCK_N)
    q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
    row_pos = (tl.arange(0, BLOCK_M) + (i0 - first_key)).to(tl.float32)
    cos_row, sin_row = tl.cos(row_pos * phase), tl.sin(row_pos * phase)
    col_pos = tl.arange(0, BLOCK_N).to(tl.float32)
    cos_col, sin_col = tl.cos(col_pos * phase), tl.sin(col_pos * phase)
    cos_step, sin_step = tl.cos(-BLOCK_N * phase), tl.sin(-BLOCK_N * phase)

    dq = tl.zeros((BLOCK_M, DK), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    drho_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        g = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # dL / d(alpha m)
        if not _tile_is_inside(i0, j0, w, doc_start_max, BLOCK_M, BLOCK_N):
            g = tl.where(_in_mask(i0, j0, w, doc_start_i, BLOCK_M, BLOCK_N), g, 0.0)
        trimmed = tl.maximum(1.0 - rho + rho * s, 0.0)
        g_m = g * _softmask(cos_row, sin_row, cos_col, sin_col)
        d_base = 2.0 * g_m * trimmed  # dL / d(base), base = 1 - rho (1 - s)
        dq += tl.dot(d_base.to(k.dtype), k, input_precision=PRECISION)
        drho_acc += d_base * (s - 1.0)
        # d m / d w = sin(pi lag / w) * pi lag / (2 w^2); the factor pi / (2 w^2) is applied once at the end.
        sin_lag = sin_row[:, None] * cos_col[None, :] - cos_row[:, None] * sin_col[None, :]
        lag = row_pos[:, None] - col_pos[None, :]
        dw_acc += g * trimmed * trimmed * sin_lag * lag
        cos_row, sin_row = _rotate(cos_row, sin_row, cos_step, sin_step)
        row_pos -= BLOCK_N
    _store_rows(DQ, rho * dq, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    part = bh * tl.num_programs(1) + tile
    tl.store(DW_PART + part, tl.sum(tl.sum(dw_acc, axis=1), axis=0) * (0.5 * phase / w))
    tl.store(DRHO_PART + part, tl.sum(tl.sum(drho_acc, axis=1), axis=0))


@triton.jit
def _dkdv_kernel(
    Q, K, V, DOUT, DK_OUT, DV_OUT, WINDOW, RHO, DOC_START, DOC_END,
    T, H, stride_b, stride_t, stride_vb, stride_vt,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_N
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    rho = tl.load(RHO + h)
    phase = 3.141592653589793 / w

    offs_j = j0 + tl.arange(0, BLOCK_N)
    doc_end_j = tl.load(DOC_END + b * T + offs_j, mask=offs_j < T, other=0)
    first_query = (j0 // BLOCK_M) * BLOCK_M
    last_query = tl.minimum(tl.minimum(j0 + BLOCK_N - 1 + _span(w, T), T), tl.max(doc_end_j, axis=0) + 1)
    k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
    v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
    # here the key tile is fixed and query tiles move: row angles turn by +pi BLOCK_M / w per query tile
    row_angle = (tl.arange(0, BLOCK_M) + (first_query - j0)).to(tl.float32) * phase
    cos_row, sin_row = tl.cos(row_angle), tl.sin(row_angle)
    col_angle = tl.arange(0, BLOCK_N).to(tl.float32) * phase
    cos_col, sin_col = tl.cos(col_angle), tl.sin(col_angle)
    cos_step, sin_step = tl.cos(BLOCK_M * phase), tl.sin(BLOCK_M * phase)

    dk = tl.zeros((BLOCK_N, DK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, DV), dtype=tl.float32)
    for i0 in range(first_query, last_query, BLOCK_M):
        offs_i = i0 + tl.arange(0, BLOCK_M)
        doc_start_i = tl.load(DOC_START + b * T + offs_i, mask=offs_i < T, other=0)
        q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
        dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (queries, keys)
        g = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        trimmed = tl.maximum(1.0 - rho + rho * s, 0.0)
        m = _softmask(cos_row, sin_row, cos_col, sin_col)
        if not _tile_is_inside(i0, j0, w, tl.max(doc_start_i, axis=0), BLOCK_M, BLOCK_N):
            m = tl.where(_in_mask(i0, j0, w, doc_start_i, BLOCK_M, BLOCK_N), m, 0.0)
        p = trimmed * trimmed * m
        dv += tl.dot(tl.trans(p.to(dout.dtype)), dout, input_precision=PRECISION)
        d_base = 2.0 * g * m * trimmed
        dk += tl.dot(tl.trans(d_base.to(q.dtype)), q, input_precision=PRECISION)
        cos_row, sin_row = _rotate(cos_row, sin_row, cos_step, sin_step)
    _store_rows(DK_OUT, rho * dk, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
    _store_rows(DV_OUT, dv, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)


def _precision(q: Tensor) -> str:
    """fp32 inputs get exact IEEE dots (no TF32 rounding); half-precision operands ignore the setting."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _shape_args(q: Tensor, v: Tensor) -> tuple[int, ...]:
    """T, H and the batch/token strides of the contiguous (B, T, H, D) q/k/dq and v/dout/h tensors."""
    B, T, H, _ = q.shape
    return T, H, q.stride(0), q.stride(1), v.stride(0), v.stride(1)


def screening_forward(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, blocks: tuple | None = None
) -> Tensor:
    """h (B, T, H, dV). Inputs contiguous, validated by the caller (ppt.kernels.screening)."""
    B, T, H, dK = q.shape
    dV = v.shape[-1]
    block_m, block_n, warps, stages = blocks or FORWARD_BLOCKS
    out = torch.empty_like(v)
    grid = (B * H, triton.cdiv(T, block_m))
    _forward_kernel[grid](
        q, k, v, out, window, rho, doc_start, *_shape_args(q, v),
        DK=dK, DV=dV, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def screening_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: Tensor,
    rho: Tensor,
    doc_start: Tensor,
    doc_end: Tensor,
    grad_out: Tensor,
    dq_blocks: tuple | None = None,
    dkdv_blocks: tuple | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d window, d rho); the per-head grads are fp32 sums of per-program partials (deterministic)."""
    B, T, H, dK = q.shape
    dV = v.shape[-1]
    precision = _precision(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    block_m, block_n, warps, stages = dq_blocks or DQ_BLOCKS
    n_tiles = triton.cdiv(T, block_m)
    partials = torch.empty((2, B, H, n_tiles), device=q.device, dtype=torch.float32)  # d window, d rho per program
    _dq_kernel[(B * H, n_tiles)](
        q, k, v, grad_out, dq, partials[0], partials[1], window, rho, doc_start, *_shape_args(q, v),
        DK=dK, DV=dV, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip

    block_m, block_n, warps, stages = dkdv_blocks or DKDV_BLOCKS
    _dkdv_kernel[(B * H, triton.cdiv(T, block_n))](
        q, k, v, grad_out, dk, dv, window, rho, doc_start, doc_end, *_shape_args(q, v),
        DK=dK, DV=dV, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv, partials[0].sum(dim=(0, 2)), partials[1].sum(dim=(0, 2))  # separate tensors: no aliasing
