"""Triton forward of the gated output projection (math in ppt/kernels/gated_output.py's docstring): one program per
BLOCK_T rows; for each head it forms p = tanh_norm(h) * tanh(silu(g)) in registers and adds p @ w[head]^T into the
(BLOCK_T, d) output tile, so p is never written. The backward is torch ops (gated_output.py).
"""

# ruff: noqa: ANN001  (Triton reads a kernel argument's annotation as its type or constexpr marker)

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_T rows, num_warps, num_stages): bench_gated_output --sweep's fastest at d = 256 (f6f05c4; H200, torch 2.11)
FORWARD_BLOCKS = (128, 8, 3)
_EPS = tl.constexpr(1e-8)  # tanh_norm's floor on the norm, as in the reference


@triton.jit
def _tanh(x):
    """tanh in fp32: its odd series through x^9 below |x| = 1/4, where 1 - 2 / (e^{2x} + 1) would cancel (to 0 at
    x = 1e-8), that form above (exact at both ends: e^{2x} = inf gives 1, e^{2x} = 0 gives -1)."""
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835)))))
    return tl.where(tl.abs(x) < 0.25, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _tanh_approx(x):
    """The GPU's one-instruction tanh (MUFU.TANH, relative error about 2**-11): for half-precision outputs, whose own
    rounding (2**-9) is larger."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _load_head(PTR, rows, row_ok, head, H: tl.constexpr, DV: tl.constexpr):
    offs = rows[:, None] * (H * DV) + head * DV + tl.arange(0, DV)[None, :]
    return tl.load(PTR + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _gated_output_kernel(
    H_IN, G, W, Y, n_rows,
    H: tl.constexpr, DV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
    FAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    cols_d, cols_v = tl.arange(0, D), tl.arange(0, DV)
    acc = tl.zeros((BLOCK_T, D), dtype=tl.float32)
    for head in range(H):
        h = _load_head(H_IN, rows, row_ok, head, H, DV)
        g = _load_head(G, rows, row_ok, head, H, DV)
        n = tl.maximum(tl.sqrt(tl.sum(h * h, axis=1)), _EPS)
        t = _tanh(n)
        if FAST:  # tanh, and sigmoid as 0.5 tanh(g / 2) + 0.5, by MUFU.TANH: 2 special functions an element, not 4
            gate = _tanh_approx(g * (0.5 * _tanh_approx(0.5 * g) + 0.5))
        else:
            gate = _tanh(g * tl.sigmoid(g))
        p = h * (t / n)[:, None] * gate
        w_t = tl.load(W + head * D * DV + cols_v[:, None] + cols_d[None, :] * DV)  # (DV, D): w[head]^T
        acc += tl.dot(p.to(w_t.dtype), w_t, input_precision=PRECISION)
    tl.store(Y + rows[:, None] * D + cols_d[None, :], acc.to(Y.dtype.element_ty), mask=row_ok[:, None])


def forward_blocks(d: int, dv: int, element_size: int) -> tuple[int, int, int]:
    """FORWARD_BLOCKS with fewer rows past d = 256 (the fp32 (rows, d) accumulator keeps to 32K elements) and 2 stages
    past a 32 KB tile of w: every shape fits sm_90's shared memory (tests/test_gated_output.py compiles the worst)."""
    rows, warps, stages = FORWARD_BLOCKS
    return min(rows, 32768 // d), warps, stages if dv * d * element_size <= 32768 else 2


def gated_output_forward(h: Tensor, g: Tensor, w: Tensor, blocks: tuple[int, int, int] | None = None) -> Tensor:
    """y (B, T, d) in h's dtype; h, g (B, T, H, dV) and w (H, d, dV) contiguous, one dtype, checked by the caller."""
    B, T, H, dV = h.shape
    d = w.shape[1]
    block_t, warps, stages = blocks or forward_blocks(d, dV, h.element_size())
    y = h.new_empty((B, T, d))
    n_rows, fp32 = B * T, h.dtype == torch.float32
    if n_rows:
        _gated_output_kernel[(triton.cdiv(n_rows, block_t),)](
            h, g, w, y, n_rows, H=H, DV=dV, D=d, BLOCK_T=block_t,
            PRECISION="ieee" if fp32 else "tf32",  # exact fp32 dots (no TF32 rounding); half precision ignores it
            FAST=not fp32 and os.environ.get("TRITON_INTERPRET") != "1",  # MUFU.TANH: no inline asm in the interpreter
            num_warps=warps, num_stages=stages, enable_fp_fusion=True,  # FMAs on every Triton (3.10 turns them off)
        )  # fmt: skip
    return y
