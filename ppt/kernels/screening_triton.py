"""Triton kernels of the screening op (math in ppt/kernels/screening.py's docstring).

The pair weight alpha m = (trim(s) u)^2 with u = cos(pi (i - j) / (2 w)) (the softmask is u^2, u >= 0 inside the
window) is a product of sums over per-query and per-key factors, so the tensor cores compute trim(s) u in one dot:
with half angles a_i = pi i / (2 w) and b_j = pi j / (2 w),

    trim(s) u = (rho s + 1 - rho) (cos a_i cos b_j + sin a_i sin b_j) = Q'_i . K'_j
    Q'_i = [rho q_i cos a_i, rho q_i sin a_i, (1 - rho) cos a_i, (1 - rho) sin a_i]
    K'_j = [k_j cos b_j,     k_j sin b_j,     cos b_j,           sin b_j]

and alpha m = max(Q'_i . K'_j, 0)^2 (clamping the product clamps trim, as u >= 0 where the mask keeps pairs). The
same query factors turned by a quarter turn give trim(s) sin(a_i - b_j), what d window needs. Per pair the kernels
keep only the clamp, the square and the mask; the folded keys K' are written once per call (3x the bytes of k),
the folded queries are formed in each program's prologue (and written once by dQ for the dK/dV pass).

Three kernels, one program per (batch row, head, tile), no atomics:
  forward : per query tile, loop over the key tiles its window and document reach
  dQ      : same loop; writes Q', dq and per-program partial sums of d window and d rho (reduced by torch afterwards)
  dK/dV   : per key tile, loop over the query tiles whose window and document reach it; its tiles are (keys x
            queries), so the products it feeds back into dK and dV need no transpose
Loop bounds come from the window and the document metadata inside the kernel, so no host sync and no wasted tiles
outside [max(doc start, i0 - ceil(w) + 1), i1]; tiles wholly inside window and document skip the mask.

Each kernel runs as a plan of window classes: one launch per class, each with its own tile sizes, over every head;
a program whose head's span ceil(min(w, T)) lies outside its class returns at once. Short windows want small tiles
(they would mostly compute masked-out pairs), long ones large tiles (fewer reloads of the keys from L2), and no
window value ever reaches the host. The default plans have one class.

Operands go to tensor cores in the input dtype (bf16/fp16) with fp32 accumulation; fp32 inputs use IEEE dots.
"""

# ruff: noqa: ANN001  (Triton reads a kernel argument's annotation as its type or constexpr marker)

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages[, maxnreg]): a fifth number caps registers per thread, which
# trades spills for resident warps (the kernels are latency-bound at small tiles)
Blocks = tuple[int, ...]
Plan = tuple[tuple[int | None, Blocks], ...]  # ((largest span of the class, None for no limit), blocks) by span

# The fastest blocks for one class at the model's shape (dK 16, dV 64, windows 2..257, 65,536 tokens) in a sweep on
# an H200 (docs/benchmarks.md). Deep software pipelining (num_stages 3) matters most: the dK/dV pass spent half its
# cycles waiting on its per-iteration loads with one stage.
FORWARD_PLAN: Plan = ((None, (32, 16, 1, 3)),)
DQ_PLAN: Plan = ((None, (32, 16, 1, 3)),)
DKDV_PLAN: Plan = ((None, (16, 32, 1, 3)),)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_HALF_PI = tl.constexpr(1.5707963267948966)


def _interpreter_loop_bounds_compat() -> None:
    """Triton 3.6's interpreter turns a `range` bound into a Python int with int(array); numpy >= 2.4 refuses that
    for the one-element arrays in which the interpreter holds scalars (later Tritons squeeze the array first). Give
    the interpreter the later rule, so loops bounded by tensors run under both."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_bounds", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_bounds = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_loop_bounds_compat()


@triton.jit
def _span(w, T):
    """ceil(min(w, T)) as int32: how many keys back a window reaches (w = inf reaches the whole row)."""
    return tl.ceil(tl.minimum(w, T.to(tl.float32))).to(tl.int32)


@triton.jit
def _sincos(x, x_low):
    """(sin, cos) of the angle x + x_low given as two fp32 parts (x exact, |x| < 2**15), to about 1e-7 plus the
    rounding of x_low: one shared Cody-Waite reduction of x to [-pi/4, pi/4], x_low added after it, and two short
    polynomials (Cephes' sinf/cosf), several times fewer instructions than two libdevice calls."""
    k = tl.floor((x + x_low) * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    r = ((x - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8 + x_low  # pi/2 in 3 parts
    r2 = r * r
    sin_r = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    quadrant = k.to(tl.int32) & 3
    odd = (quadrant & 1) != 0
    sin_x = tl.where(odd, cos_r, sin_r)
    cos_x = tl.where(odd, sin_r, cos_r)
    return tl.where((quadrant & 2) != 0, -sin_x, sin_x), tl.where(((quadrant + 1) & 2) != 0, -cos_x, cos_x)


@triton.jit
def _half_angle_sincos(pos, w):
    """(sin, cos) of the half angle pi * pos / (2 w) of integer positions 0 <= pos < 2**16 (0 angle for w = inf).

    A float32 product pos * theta would be off by up to half an ulp of thousands of radians (1.2e-4 at position
    4096, w = 2.5), and queries and keys must agree on their angles to far better than that: theta splits into its
    8 high bits, whose product with pos is exact, and the rest, whose 256x smaller product joins after the range
    reduction (a few 1e-6 at most up to position 4096)."""
    theta = _HALF_PI / w
    theta_high = (theta.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    p = pos.to(tl.float32)
    return _sincos(p * theta_high, p * (theta - theta_high))


@triton.jit
def _two_column_tile(col0, col1, TAIL: tl.constexpr):
    """A (rows, TAIL) tile with per-row values col0 and col1 in its first two columns and zeros after."""
    col = tl.arange(0, TAIL)[None, :]
    return tl.where(col == 0, col0[:, None], tl.where(col == 1, col1[:, None], 0.0))


@triton.jit
def _visible_count(offs_i, doc_start_i, span):
    """Per query row: how many keys back from itself it sees, min(span, i - doc_start + 1), never below 0."""
    return tl.maximum(tl.minimum(span, offs_i - doc_start_i + 1), 0)


@triton.jit
def _lag_is_visible(lag, visible):
    """0 <= lag < visible in one unsigned compare (a negative lag wraps to a large unsigned number)."""
    return lag.to(tl.uint32, bitcast=True) < visible.to(tl.uint32, bitcast=True)


@triton.jit
def _tile_is_inside(i0, j0, span, doc_start_max, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True when every pair of the tile is causal, in the window and in the document: the mask can be skipped."""
    return (j0 + BLOCK_N - 1 <= i0) & (i0 + BLOCK_M - 1 - j0 < span) & (j0 >= doc_start_max)


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
def _query_tile_setup(DOC_START, b, i0, T, span, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per query tile: how many keys each row sees, the largest doc start, and the key range [first_key, last_key)."""
    offs_i = i0 + tl.arange(0, BLOCK_M)
    row_ok = offs_i < T
    doc_start_i = tl.load(DOC_START + b * T + offs_i, mask=row_ok, other=0)
    doc_start_min = tl.min(tl.where(row_ok, doc_start_i, T), axis=0)
    doc_start_max = tl.max(doc_start_i, axis=0)
    first_key = tl.maximum(doc_start_min, i0 - span + 1)
    first_key = (first_key // BLOCK_N) * BLOCK_N
    last_key = tl.minimum(i0 + BLOCK_M, T)
    return _visible_count(offs_i, doc_start_i, span), doc_start_max, first_key, last_key


# Folded rows are (B, T, H, 2 dK + TAIL): the cos part, the sin part, then the two softmask columns padded to the
# dot's smallest width. Each kernel loads them as three tiles, so every dot keeps power-of-two shapes.
TAIL = tl.constexpr(16)


@triton.jit
def _load_folded(PTR, b, start, T, stride_b, stride_t, h, DK: tl.constexpr, ROWS: tl.constexpr):
    """The cos, sin and softmask tiles of `ROWS` folded rows of head h."""
    col = h * (2 * DK + TAIL)
    cos_part = _load_rows(PTR, b, start, T, stride_b, stride_t, col, DK, ROWS)
    sin_part = _load_rows(PTR, b, start, T, stride_b, stride_t, col + DK, DK, ROWS)
    tail = _load_rows(PTR, b, start, T, stride_b, stride_t, col + 2 * DK, TAIL, ROWS)
    return cos_part, sin_part, tail


@triton.jit
def _store_folded(PTR, cos_part, sin_part, tail, b, start, T, stride_b, stride_t, h, DK: tl.constexpr,
                  ROWS: tl.constexpr):  # fmt: skip
    col = h * (2 * DK + TAIL)
    _store_rows(PTR, cos_part, b, start, T, stride_b, stride_t, col, DK, ROWS)
    _store_rows(PTR, sin_part, b, start, T, stride_b, stride_t, col + DK, DK, ROWS)
    _store_rows(PTR, tail, b, start, T, stride_b, stride_t, col + 2 * DK, TAIL, ROWS)


@triton.jit
def _folded_dot(a_cos, a_sin, a_tail, b_cos, b_sin, b_tail, PRECISION: tl.constexpr):
    """Q'.K'^T of two folded tiles (fp32 accumulation)."""
    acc = tl.dot(a_cos, tl.trans(b_cos), input_precision=PRECISION)
    acc = tl.dot(a_sin, tl.trans(b_sin), acc, input_precision=PRECISION)
    return tl.dot(a_tail, tl.trans(b_tail), acc, input_precision=PRECISION)


@triton.jit
def _fold_queries(Q, b, i0, T, stride_b, stride_t, h, w, rho, DK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Q' of a query tile in fp32 (cos part, sin part, softmask tail), the raw q and the rows' half angles."""
    offs_i = i0 + tl.arange(0, BLOCK_M)
    sin_a, cos_a = _half_angle_sincos(offs_i, w)
    q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M).to(tl.float32)
    tail = _two_column_tile((1.0 - rho) * cos_a, (1.0 - rho) * sin_a, TAIL)
    return (rho * q) * cos_a[:, None], (rho * q) * sin_a[:, None], tail, q, sin_a, cos_a


@triton.jit
def _fold_keys_kernel(
    K, KF, WINDOW, T, H, stride_b, stride_t, stride_fb, stride_ft, DK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK
    b, h = bh // H, bh % H
    sin_b, cos_b = _half_angle_sincos(t0 + tl.arange(0, BLOCK), tl.load(WINDOW + h))
    k = _load_rows(K, b, t0, T, stride_b, stride_t, h * DK, DK, BLOCK).to(tl.float32)
    tail = _two_column_tile(cos_b, sin_b, TAIL)
    _store_folded(KF, k * cos_b[:, None], k * sin_b[:, None], tail, b, t0, T, stride_fb, stride_ft, h, DK, BLOCK)


@triton.jit
def _forward_kernel(
    Q, KF, V, OUT, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_fb, stride_ft, stride_vb, stride_vt, span_lo, span_hi,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    i0 = tl.program_id(1) * BLOCK_M
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    span = _span(w, T)
    if (span < span_lo) | (span > span_hi):  # another class's launch handles this head
        return
    rho = tl.load(RHO + h)

    visible, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, span, BLOCK_M, BLOCK_N)
    q_cos, q_sin, q_tail, _, _, _ = _fold_queries(Q, b, i0, T, stride_b, stride_t, h, w, rho, DK, BLOCK_M)
    dtype = V.dtype.element_ty
    q_cos, q_sin, q_tail = q_cos.to(dtype), q_sin.to(dtype), q_tail.to(dtype)
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)

    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k_cos, k_sin, k_tail = _load_folded(KF, b, j0, T, stride_fb, stride_ft, h, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        root = tl.maximum(_folded_dot(q_cos, q_sin, q_tail, k_cos, k_sin, k_tail, PRECISION), 0.0)  # alpha m = root^2
        if not _tile_is_inside(i0, j0, span, doc_start_max, BLOCK_M, BLOCK_N):
            lag = (rows + (i0 - j0))[:, None] - cols[None, :]
            root = tl.where(_lag_is_visible(lag, visible[:, None]), root, 0.0)
        acc += tl.dot((root * root).to(dtype), v, input_precision=PRECISION)
    _store_rows(OUT, acc, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)


@triton.jit
def _dq_kernel(
    Q, KF, V, DOUT, DQ, QF, DW_PART, DRHO_PART, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_fb, stride_ft, stride_vb, stride_vt, span_lo, span_hi,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    i0 = tile * BLOCK_M
    b, h = bh // H, bh % H
    part = (h * (tl.num_programs(0) // H) + b) * tl.num_programs(1) + tile  # head-major: (H, B * tiles) partials
    w = tl.load(WINDOW + h)
    span = _span(w, T)
    if (span < span_lo) | (span > span_hi):  # another class's launch handles this head; its partials are zero here
        tl.store(DW_PART + part, 0.0)
        tl.store(DRHO_PART + part, 0.0)
        return
    rho = tl.load(RHO + h)

    visible, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, span, BLOCK_M, BLOCK_N)
    q_cos, q_sin, q_tail, q, sin_a, cos_a = _fold_queries(Q, b, i0, T, stride_b, stride_t, h, w, rho, DK, BLOCK_M)
    _store_folded(QF, q_cos, q_sin, q_tail, b, i0, T, stride_fb, stride_ft, h, DK, BLOCK_M)  # for the dK/dV pass
    dtype = V.dtype.element_ty
    # Q' turned a quarter turn: [rho q sin a, -rho q cos a, (1 - rho) sin a, -(1 - rho) cos a] . K'_j
    # = trim(s) sin(a_i - b_j), the softmask's derivative up to the factor pi lag / w^2 applied below
    t_cos, t_sin = q_sin.to(dtype), (-q_cos).to(dtype)
    t_tail = _two_column_tile((1.0 - rho) * sin_a, (rho - 1.0) * cos_a, TAIL).to(dtype)
    q_cos, q_sin, q_tail = q_cos.to(dtype), q_sin.to(dtype), q_tail.to(dtype)
    dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    lag = ((rows + (i0 - first_key))[:, None] - cols[None, :]).to(tl.float32)

    g_cos = tl.zeros((BLOCK_M, DK), dtype=tl.float32)  # sum_j dL/d(alpha m) root K'_j, by part
    g_sin = tl.zeros((BLOCK_M, DK), dtype=tl.float32)
    g_tail = tl.zeros((BLOCK_M, TAIL), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k_cos, k_sin, k_tail = _load_folded(KF, b, j0, T, stride_fb, stride_ft, h, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        root = tl.maximum(_folded_dot(q_cos, q_sin, q_tail, k_cos, k_sin, k_tail, PRECISION), 0.0)
        trim_sin = _folded_dot(t_cos, t_sin, t_tail, k_cos, k_sin, k_tail, PRECISION)
        g = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # dL / d(alpha m)
        if not _tile_is_inside(i0, j0, span, doc_start_max, BLOCK_M, BLOCK_N):
            root = tl.where(_lag_is_visible(lag.to(tl.int32), visible[:, None]), root, 0.0)
        g_root = g * root  # dL / d root / 2; zero outside the mask
        g_root_op = g_root.to(dtype)
        g_cos = tl.dot(g_root_op, k_cos, g_cos, input_precision=PRECISION)
        g_sin = tl.dot(g_root_op, k_sin, g_sin, input_precision=PRECISION)
        g_tail = tl.dot(g_root_op, k_tail, g_tail, input_precision=PRECISION)
        dw_acc += g_root * trim_sin * lag  # d root / d w = trim(s) sin(a_i - b_j) pi lag / (2 w^2)
        lag -= BLOCK_N
    # dq = 2 rho (cos a g_cos + sin a g_sin); d rho = 2 sum_i [q . (cos a g_cos + sin a g_sin) - (cos a, sin a) . tail]
    g_q = cos_a[:, None] * g_cos + sin_a[:, None] * g_sin
    _store_rows(DQ, (2.0 * rho) * g_q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    tail_col = tl.arange(0, TAIL)[None, :]
    g_softmask = tl.sum(tl.where(tail_col == 0, cos_a[:, None], tl.where(tail_col == 1, sin_a[:, None], 0.0)) * g_tail,
                        axis=1)  # fmt: skip
    tl.store(DRHO_PART + part, 2.0 * (tl.sum(tl.sum(q * g_q, axis=1) - g_softmask, axis=0)))
    tl.store(DW_PART + part, tl.sum(tl.sum(dw_acc, axis=1), axis=0) * (2.0 * _HALF_PI / (w * w)))


@triton.jit
def _dkdv_kernel(
    QF, KF, V, DOUT, DK_OUT, DV_OUT, WINDOW, DOC_START, DOC_END,
    T, H, stride_b, stride_t, stride_fb, stride_ft, stride_vb, stride_vt, span_lo, span_hi,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_N
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    span = _span(w, T)
    if (span < span_lo) | (span > span_hi):  # another class's launch handles this head
        return

    keys, queries = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M)
    offs_j = j0 + keys
    doc_end_j = tl.load(DOC_END + b * T + offs_j, mask=offs_j < T, other=0)
    first_query = (j0 // BLOCK_M) * BLOCK_M
    last_query = tl.minimum(tl.minimum(j0 + BLOCK_N - 1 + span, T), tl.max(doc_end_j, axis=0) + 1)
    k_cos, k_sin, k_tail = _load_folded(KF, b, j0, T, stride_fb, stride_ft, h, DK, BLOCK_N)
    v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
    dtype = V.dtype.element_ty

    dk_cos = tl.zeros((BLOCK_N, DK), dtype=tl.float32)  # sum_i dL/d(alpha m) root Q'_i, cos and sin parts
    dk_sin = tl.zeros((BLOCK_N, DK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, DV), dtype=tl.float32)
    for i0 in range(first_query, last_query, BLOCK_M):
        offs_i = i0 + queries
        doc_start_i = tl.load(DOC_START + b * T + offs_i, mask=offs_i < T, other=0)
        q_cos, q_sin, q_tail = _load_folded(QF, b, i0, T, stride_fb, stride_ft, h, DK, BLOCK_M)
        dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
        root = tl.maximum(_folded_dot(k_cos, k_sin, k_tail, q_cos, q_sin, q_tail, PRECISION), 0.0)  # (keys, queries)
        g = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        if not _tile_is_inside(i0, j0, span, tl.max(doc_start_i, axis=0), BLOCK_M, BLOCK_N):
            lag = (queries + (i0 - j0))[None, :] - keys[:, None]
            root = tl.where(_lag_is_visible(lag, _visible_count(offs_i, doc_start_i, span)[None, :]), root, 0.0)
        dv += tl.dot((root * root).to(dtype), dout, input_precision=PRECISION)
        g_root = (g * root).to(dtype)
        dk_cos = tl.dot(g_root, q_cos, dk_cos, input_precision=PRECISION)
        dk_sin = tl.dot(g_root, q_sin, dk_sin, input_precision=PRECISION)
    # K'_j's cos and sin parts are k_j cos b_j and k_j sin b_j; its softmask columns do not depend on k
    sin_b, cos_b = _half_angle_sincos(offs_j, w)
    dk = 2.0 * (cos_b[:, None] * dk_cos + sin_b[:, None] * dk_sin)
    _store_rows(DK_OUT, dk, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
    _store_rows(DV_OUT, dv, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)


def _precision(q: Tensor) -> str:
    """fp32 inputs get exact IEEE dots (no TF32 rounding); half-precision operands ignore the setting."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _shape_args(q: Tensor, folded: Tensor, v: Tensor) -> tuple[int, ...]:
    """T, H and the batch/token strides of the contiguous (B, T, H, D) q/k/dq, folded and v/dout/h tensors."""
    B, T, H, _ = q.shape
    return T, H, q.stride(0), q.stride(1), folded.stride(0), folded.stride(1), v.stride(0), v.stride(1)


def folded_empty(x: Tensor) -> Tensor:
    """An empty (B, T, H, 2 dK + 16) tensor for the folded queries or keys of x (B, T, H, dK)."""
    return x.new_empty((*x.shape[:3], 2 * x.shape[-1] + TAIL.value))


def fold_keys(k: Tensor, window: Tensor, rows_per_program: int = 64) -> Tensor:
    """K' (B, T, H, 2 dK + 16) of k (module docstring), in k's dtype."""
    B, T, H, dK = k.shape
    folded = folded_empty(k)
    _fold_keys_kernel[(B * H, triton.cdiv(T, rows_per_program))](
        k, folded, window, T, H, k.stride(0), k.stride(1), folded.stride(0), folded.stride(1),
        DK=dK, BLOCK=rows_per_program, num_warps=4,
    )  # fmt: skip
    return folded


def _launch_options(blocks: Blocks) -> dict[str, int]:
    warps, stages, *maxnreg = blocks[2:]
    return dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg[0]} if maxnreg else {}))


def plan_classes(plan: Plan) -> list[tuple[int, int, Blocks]]:
    """(smallest span, largest span, blocks) per class of a plan; together the classes cover every int32 span."""
    limits = [limit for limit, _ in plan]
    if not plan or limits[-1] is not None or any(x is None for x in limits[:-1]) or limits[:-1] != sorted(limits[:-1]):
        raise ValueError(f"a plan lists classes by increasing largest span and ends with None (no limit), got {plan}")
    lows = [_INT32_MIN] + [limit + 1 for limit in limits[:-1]]
    return [(lo, _INT32_MAX if limit is None else limit, blocks) for lo, (limit, blocks) in zip(lows, plan)]


def forward_class(
    q: Tensor, k_folded: Tensor, v: Tensor, out: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor,
    span_lo: int, span_hi: int, blocks: Blocks,
) -> None:  # fmt: skip
    """One class's forward launch: writes `out` for the heads whose span lies in [span_lo, span_hi]."""
    B, T, H, dK = q.shape
    block_m, block_n = blocks[:2]
    _forward_kernel[(B * H, triton.cdiv(T, block_m))](
        q, k_folded, v, out, window, rho, doc_start, *_shape_args(q, k_folded, v), span_lo, span_hi,
        DK=dK, DV=v.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), **_launch_options(blocks),
    )  # fmt: skip


def dq_class(
    q: Tensor, k_folded: Tensor, v: Tensor, grad_out: Tensor, dq: Tensor, q_folded: Tensor, window: Tensor,
    rho: Tensor, doc_start: Tensor, span_lo: int, span_hi: int, blocks: Blocks,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One class's dQ launch: writes `dq` and `q_folded` (Q') for the heads whose span lies in [span_lo, span_hi]
    and returns their d window and d rho (zero for the other heads), each an fp32 (H,) sum of per-program partials."""
    B, T, H, dK = q.shape
    block_m, block_n = blocks[:2]
    n_tiles = triton.cdiv(T, block_m)
    partials = torch.empty((2, H, B * n_tiles), device=q.device, dtype=torch.float32)
    _dq_kernel[(B * H, n_tiles)](
        q, k_folded, v, grad_out, dq, q_folded, partials[0], partials[1], window, rho, doc_start,
        *_shape_args(q, k_folded, v), span_lo, span_hi,
        DK=dK, DV=v.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), **_launch_options(blocks),
    )  # fmt: skip
    # sums over each head's contiguous row of partials (a strided (B, H, tiles) sum took 25 us each on an H200);
    # two sums, not one: the op's outputs must not alias each other
    return partials[0].sum(dim=1), partials[1].sum(dim=1)


def dkdv_class(
    q_folded: Tensor, k_folded: Tensor, v: Tensor, grad_out: Tensor, dk: Tensor, dv: Tensor, window: Tensor,
    doc_start: Tensor, doc_end: Tensor, span_lo: int, span_hi: int, blocks: Blocks,
) -> None:  # fmt: skip
    """One class's dK/dV launch: writes `dk` and `dv` for the heads whose span lies in [span_lo, span_hi]."""
    B, T, H, dK = dk.shape
    block_m, block_n = blocks[:2]
    _dkdv_kernel[(B * H, triton.cdiv(T, block_n))](
        q_folded, k_folded, v, grad_out, dk, dv, window, doc_start, doc_end, *_shape_args(dk, k_folded, v),
        span_lo, span_hi,
        DK=dK, DV=v.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(dk), **_launch_options(blocks),
    )  # fmt: skip


def screening_forward(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, plan: Plan | None = None
) -> Tensor:
    """h (B, T, H, dV). Inputs contiguous, validated by the caller (ppt.kernels.screening)."""
    out = torch.empty_like(v)
    k_folded = fold_keys(k, window)
    for span_lo, span_hi, blocks in plan_classes(plan or FORWARD_PLAN):
        forward_class(q, k_folded, v, out, window, rho, doc_start, span_lo, span_hi, blocks)
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
    dq_plan: Plan | None = None,
    dkdv_plan: Plan | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d window, d rho); the per-head grads are fp32 sums of per-program partials (deterministic)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    k_folded, q_folded = fold_keys(k, window), folded_empty(q)
    d_window = d_rho = None
    for span_lo, span_hi, blocks in plan_classes(dq_plan or DQ_PLAN):
        sums = dq_class(q, k_folded, v, grad_out, dq, q_folded, window, rho, doc_start, span_lo, span_hi, blocks)
        d_window, d_rho = sums if d_window is None else (d_window + sums[0], d_rho + sums[1])
    for span_lo, span_hi, blocks in plan_classes(dkdv_plan or DKDV_PLAN):
        dkdv_class(q_folded, k_folded, v, grad_out, dk, dv, window, doc_start, doc_end, span_lo, span_hi, blocks)
    return dq, dk, dv, d_window, d_rho
