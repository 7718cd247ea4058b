"""Triton kernels of the screening op (math in ppt/kernels/screening.py's docstring).

Three kernels, one program per (batch row, head, tile), no atomics:
  forward : per query tile, loop over the key tiles its window and document reach
  dQ      : same loop; also writes per-program partial sums of d window and d rho
  dK/dV   : per key tile, loop over the query tiles whose window and document reach it; its tiles are (keys x
            queries), so the products it feeds back into dK and dV need no transpose. One program a head (batch row
            0, key tile 0) also sums that head's dQ partials in a fixed order: d window and d rho, deterministic,
            with no launch of their own
Loop bounds come from the window and the document metadata inside the kernel, so no host sync and no wasted tiles
outside [max(doc start, i0 - ceil(w) + 1), i1]; tiles wholly inside window and document skip the mask.

The softmask is squared from u = cos(pi (i - j) / (2 w)): (cos(pi (i - j) / w) + 1) / 2 = u^2, and u >= 0 inside the
window. u is a rank-2 product cos a_i cos a_j + sin a_i sin a_j of per-row and per-column half angles, taken
relative to the current tile (small angles stay accurate on long rows) and turned from tile to tile by angle
addition, so a program evaluates sin/cos once per row and column rather than once per pair; alpha m = (trim u)^2.

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

# The fastest blocks for one class at the model's shape (dK 16, dV 64, windows 2..257, 65,536 tokens) in sweeps on
# an H200 (docs/benchmarks.md). Deep software pipelining (num_stages 3) matters most: the dK/dV pass spent half its
# cycles waiting on its per-iteration loads with one stage. One warp per 32-query tile with its registers capped at
# 168 (12 resident warps per SM in an sm_90 compile) beat one warp per 16 queries on the H200: half the programs,
# each with two row blocks of MMAs in flight (forward 0.172 -> 0.148 ms, dQ 0.252 -> 0.232 ms).
FORWARD_PLAN: Plan = ((None, (32, 16, 1, 4, 168)),)
DQ_PLAN: Plan = ((None, (32, 16, 1, 2, 168)),)
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
def _sincos(x):
    """(sin x, cos x) of fp32 x, |x| < 2**15 (angles here stay below a few thousand), to about 1e-7: one shared
    Cody-Waite reduction to [-pi/4, pi/4] and two short polynomials (Cephes' sinf/cosf), several times fewer
    instructions than two libdevice calls. The prologue of every program evaluates a dozen of them per thread."""
    k = tl.floor(x * 0.6366197723675814 + 0.5)  # nearest multiple of pi/2
    r = ((x - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8  # pi/2 in three parts
    r2 = r * r
    sin_r = r + r * r2 * (-1.6666654611e-1 + r2 * (8.3321608736e-3 + r2 * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * r2 + r2 * r2 * (4.166664568298827e-2 + r2 * (-1.388731625493765e-3 + r2 * 2.443315711809948e-5))
    quadrant = k.to(tl.int32) & 3
    odd = (quadrant & 1) != 0
    sin_x = tl.where(odd, cos_r, sin_r)
    cos_x = tl.where(odd, sin_r, cos_r)
    return tl.where((quadrant & 2) != 0, -sin_x, sin_x), tl.where(((quadrant + 1) & 2) != 0, -cos_x, cos_x)


@triton.jit
def _rotate(cos_a, sin_a, cos_b, sin_b):
    """(cos, sin) of a + b from those of a and b: moves a tile's half angles to the next tile."""
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


@triton.jit
def _half_softmask(cos_row, sin_row, cos_col, sin_col):
    """u = cos(row - col) over a tile from per-row and per-column half angles; the softmask is u^2."""
    return cos_row[:, None] * cos_col[None, :] + sin_row[:, None] * sin_col[None, :]


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


# Rows and columns of the (query x key) tile carry half angles pi * position / (2 w) with positions relative to the
# current key tile: row angles start at (r + i0 - first_key) * half_phase and turn by -BLOCK_N * half_phase per key
# tile, column angles c * half_phase stay put. A handful of sin/cos per program instead of one per pair.


@triton.jit
def _screening_forward_kernel(
    Q, K, V, OUT, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_vb, stride_vt, span_lo, span_hi,
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
    half_phase = _HALF_PI / w  # 0 for w = inf: the softmask is 1

    visible, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, span, BLOCK_M, BLOCK_N)
    q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    sin_row, cos_row = _sincos((rows + (i0 - first_key)).to(tl.float32) * half_phase)
    sin_col, cos_col = _sincos(cols.to(tl.float32) * half_phase)
    sin_step, cos_step = _sincos(-BLOCK_N * half_phase)

    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        trimmed = tl.maximum(rho * s + (1.0 - rho), 0.0)
        u = _half_softmask(cos_row, sin_row, cos_col, sin_col)
        if not _tile_is_inside(i0, j0, span, doc_start_max, BLOCK_M, BLOCK_N):
            lag = (rows + (i0 - j0))[:, None] - cols[None, :]
            u = tl.where(_lag_is_visible(lag, visible[:, None]), u, 0.0)
        root = trimmed * u  # alpha m = root^2
        acc += tl.dot((root * root).to(v.dtype), v, input_precision=PRECISION)
        cos_row, sin_row = _rotate(cos_row, sin_row, cos_step, sin_step)
    _store_rows(OUT, acc, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)


@triton.jit
def _screening_dq_kernel(
    Q, K, V, DOUT, DQ, DW_PART, DRHO_PART, WINDOW, RHO, DOC_START,
    T, H, stride_b, stride_t, stride_vb, stride_vt, n_parts, span_lo, span_hi,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    i0 = tile * BLOCK_M
    b, h = bh // H, bh % H
    part = h * n_parts + b * tl.num_programs(1) + tile  # head-major: a row of n_parts partials a head
    w = tl.load(WINDOW + h)
    span = _span(w, T)
    if (span < span_lo) | (span > span_hi):  # another class's launch handles this head
        return
    rho = tl.load(RHO + h)
    half_phase = _HALF_PI / w

    visible, doc_start_max, first_key, last_key = _query_tile_setup(DOC_START, b, i0, T, span, BLOCK_M, BLOCK_N)
    q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    row_pos = (rows + (i0 - first_key)).to(tl.float32)
    sin_row, cos_row = _sincos(row_pos * half_phase)
    col_pos = cols.to(tl.float32)
    sin_col, cos_col = _sincos(col_pos * half_phase)
    sin_step, cos_step = _sincos(-BLOCK_N * half_phase)

    dq = tl.zeros((BLOCK_M, DK), dtype=tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    drho_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(first_key, last_key, BLOCK_N):
        k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
        v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        g = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # dL / d(alpha m)
        trimmed = tl.maximum(rho * s + (1.0 - rho), 0.0)
        u = _half_softmask(cos_row, sin_row, cos_col, sin_col)
        if not _tile_is_inside(i0, j0, span, doc_start_max, BLOCK_M, BLOCK_N):
            lag = (rows + (i0 - j0))[:, None] - cols[None, :]
            u = tl.where(_lag_is_visible(lag, visible[:, None]), u, 0.0)
        g_root = g * u * trimmed  # every term below carries u: zero outside the mask
        d_base = g_root * u  # dL / d(base) / 2, base = 1 - rho (1 - s)
        dq += tl.dot(d_base.to(k.dtype), k, input_precision=PRECISION)
        drho_acc += d_base * (s - 1.0)
        # d m / d w = u sin(pi lag / (2 w)) pi lag / w^2; the factor pi / w^2 is applied once at the end.
        sin_half_lag = sin_row[:, None] * cos_col[None, :] - cos_row[:, None] * sin_col[None, :]
        dw_acc += g_root * trimmed * sin_half_lag * (row_pos[:, None] - col_pos[None, :])
        cos_row, sin_row = _rotate(cos_row, sin_row, cos_step, sin_step)
        row_pos -= BLOCK_N
    _store_rows(DQ, (2.0 * rho) * dq, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
    tl.store(DW_PART + part, tl.sum(tl.sum(dw_acc, axis=1), axis=0) * (2.0 * half_phase / w))
    tl.store(DRHO_PART + part, 2.0 * tl.sum(tl.sum(drho_acc, axis=1), axis=0))


@triton.jit
def _row_sum(PTR, n, BLOCK: tl.constexpr):
    """The sum of n fp32 values at PTR, always in the same order."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(PTR + start + offs, mask=start + offs < n, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _screening_dkdv_kernel(
    Q, K, V, DOUT, DK_OUT, DV_OUT, DW_PART, DRHO_PART, DW_OUT, DRHO_OUT, WINDOW, RHO, DOC_START, DOC_END,
    T, H, stride_b, stride_t, stride_vb, stride_vt, n_parts, span_lo, span_hi,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SUM_BLOCK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_N
    b, h = bh // H, bh % H
    w = tl.load(WINDOW + h)
    span = _span(w, T)
    if (span < span_lo) | (span > span_hi):  # another class's launch handles this head
        return
    if (b == 0) & (j0 == 0):  # the dQ launches ran before this one, on the same stream
        tl.store(DW_OUT + h, _row_sum(DW_PART + h * n_parts, n_parts, SUM_BLOCK))
        tl.store(DRHO_OUT + h, _row_sum(DRHO_PART + h * n_parts, n_parts, SUM_BLOCK))
    rho = tl.load(RHO + h)
    half_phase = _HALF_PI / w

    keys, queries = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M)
    offs_j = j0 + keys
    doc_end_j = tl.load(DOC_END + b * T + offs_j, mask=offs_j < T, other=0)
    first_query = (j0 // BLOCK_M) * BLOCK_M
    last_query = tl.minimum(tl.minimum(j0 + BLOCK_N - 1 + span, T), tl.max(doc_end_j, axis=0) + 1)
    k = _load_rows(K, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
    v = _load_rows(V, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)
    # tiles are (keys x queries): the key tile is fixed and query tiles move, their half angles turning by
    # +BLOCK_M * half_phase per query tile
    sin_key, cos_key = _sincos(keys.to(tl.float32) * half_phase)
    sin_query, cos_query = _sincos((queries + (first_query - j0)).to(tl.float32) * half_phase)
    sin_step, cos_step = _sincos(BLOCK_M * half_phase)

    dk = tl.zeros((BLOCK_N, DK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, DV), dtype=tl.float32)
    for i0 in range(first_query, last_query, BLOCK_M):
        offs_i = i0 + queries
        doc_start_i = tl.load(DOC_START + b * T + offs_i, mask=offs_i < T, other=0)
        q = _load_rows(Q, b, i0, T, stride_b, stride_t, h * DK, DK, BLOCK_M)
        dout = _load_rows(DOUT, b, i0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_M)
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (keys, queries)
        g = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        trimmed = tl.maximum(rho * s + (1.0 - rho), 0.0)
        u = _half_softmask(cos_key, sin_key, cos_query, sin_query)
        if not _tile_is_inside(i0, j0, span, tl.max(doc_start_i, axis=0), BLOCK_M, BLOCK_N):
            lag = (queries + (i0 - j0))[None, :] - keys[:, None]
            u = tl.where(_lag_is_visible(lag, _visible_count(offs_i, doc_start_i, span)[None, :]), u, 0.0)
        root = trimmed * u
        dv += tl.dot((root * root).to(dout.dtype), dout, input_precision=PRECISION)
        dk += tl.dot((g * root * u).to(q.dtype), q, input_precision=PRECISION)  # dL / d(base) / 2 times q
        cos_query, sin_query = _rotate(cos_query, sin_query, cos_step, sin_step)
    _store_rows(DK_OUT, (2.0 * rho) * dk, b, j0, T, stride_b, stride_t, h * DK, DK, BLOCK_N)
    _store_rows(DV_OUT, dv, b, j0, T, stride_vb, stride_vt, h * DV, DV, BLOCK_N)


def _shape_args(q: Tensor, v: Tensor) -> tuple[int, ...]:
    """T, H and the batch/token strides of the contiguous (B, T, H, D) q/k/dq and v/dout/h tensors."""
    return *q.shape[1:3], q.stride(0), q.stride(1), v.stride(0), v.stride(1)


def _launch_args(q: Tensor, v: Tensor, blocks: Blocks) -> dict[str, object]:
    """The constexprs every kernel takes, and the launch options. fp32 inputs get exact IEEE dots (no TF32 rounding);
    half-precision operands ignore the setting. Multiply-adds are fused into FMAs, as every measurement here used:
    Triton 3.9 warns that its default turns this off in 3.10, so the choice is made here and holds on every Triton."""
    block_m, block_n, warps, stages, *maxnreg = blocks
    return dict(
        DK=q.shape[-1], DV=v.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages, enable_fp_fusion=True, **({"maxnreg": maxnreg[0]} if maxnreg else {}),
    )  # fmt: skip


def plan_classes(plan: Plan) -> list[tuple[int, int, Blocks]]:
    """(smallest span, largest span, blocks) per class of a plan; together the classes cover every int32 span."""
    limits = [limit for limit, _ in plan]
    if not plan or limits[-1] is not None or any(x is None for x in limits[:-1]) or limits[:-1] != sorted(limits[:-1]):
        raise ValueError(f"a plan lists classes by increasing largest span and ends with None (no limit), got {plan}")
    lows = [_INT32_MIN] + [limit + 1 for limit in limits[:-1]]
    return [(lo, _INT32_MAX if limit is None else limit, blocks) for lo, (limit, blocks) in zip(lows, plan)]


def screening_forward(
    q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, plan: Plan | None = None
) -> Tensor:
    """h (B, T, H, dV). Inputs contiguous, validated by the caller (ppt.kernels.screening)."""
    B, T, H, _ = q.shape
    out = torch.empty_like(v)
    for span_lo, span_hi, blocks in plan_classes(plan or FORWARD_PLAN):
        _screening_forward_kernel[(B * H, triton.cdiv(T, blocks[0]))](
            q, k, v, out, window, rho, doc_start, *_shape_args(q, v), span_lo, span_hi, **_launch_args(q, v, blocks)
        )
    return out


def screening_backward(q: Tensor, k: Tensor, v: Tensor, window: Tensor, rho: Tensor, doc_start: Tensor, doc_end: Tensor,
                       grad_out: Tensor, dq_plan: Plan | None = None,
                       dkdv_plan: Plan | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv, d window, d rho); the per-head grads are fp32 sums of per-program partials (deterministic)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    B, T, H, _ = q.shape
    new_grad = torch.empty_like if B * T else torch.zeros_like  # no dK/dV program would write them
    d_window, d_rho = new_grad(window), new_grad(rho)
    # Each dQ program writes its d window and d rho partials into its head's row of `partials`, as long as the
    # smallest query tiles need; with several classes a head's class may fill less of its row, so the rest must read
    # as zeros. The dK/dV launches sum each head's row.
    dq_classes = plan_classes(dq_plan or DQ_PLAN)
    n_parts = B * max(triton.cdiv(T, blocks[0]) for _, _, blocks in dq_classes)
    new_partials = torch.zeros if len(dq_classes) > 1 else torch.empty
    partials = new_partials((2, H, n_parts), device=q.device, dtype=torch.float32)
    for span_lo, span_hi, blocks in dq_classes:
        _screening_dq_kernel[(B * H, triton.cdiv(T, blocks[0]))](
            q, k, v, grad_out, dq, partials[0], partials[1], window, rho, doc_start, *_shape_args(q, v), n_parts,
            span_lo, span_hi, **_launch_args(q, v, blocks),
        )  # fmt: skip
    for span_lo, span_hi, blocks in plan_classes(dkdv_plan or DKDV_PLAN):
        _screening_dkdv_kernel[(B * H, triton.cdiv(T, blocks[1]))](
            q, k, v, grad_out, dk, dv, partials[0], partials[1], d_window, d_rho, window, rho, doc_start, doc_end,
            *_shape_args(q, v), n_parts, span_lo, span_hi, SUM_BLOCK=256, **_launch_args(q, v, blocks),
        )  # fmt: skip
    return dq, dk, dv, d_window, d_rho
