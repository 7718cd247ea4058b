"""Triton kernel of the cross-entropy op (math in ppt/kernels/cross_entropy.py's docstring).

One program per row of logits, two passes over the vocabulary in BLOCK_V chunks (masked tail):
  pass 1  the row's max and sum of exp, one exp per logit (each chunk rescales the running sum by the new max):
          logsumexp, and the row's loss
  pass 2  re-reads the row, which this program read a moment ago and so mostly finds in L2, and writes the row of
          g = (softmax - onehot) / n_kept over it, in the logits' dtype: each element is read before it is written,
          by the same thread
Exponentials are taken in base 2 (x2 = z log2 e, one multiply), so each is a bare exp2. The vocabulary size is a
constexpr, so every loop bound is a plain int.
"""

# ruff: noqa: ANN001  (Triton reads a kernel argument's annotation as its type or constexpr marker)

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_V logits per loop step, num_warps). Few rows may be in flight, or a row leaves L2 before its second pass.
# (16384, 16) took 7.47 ms at 131,072 x 49,152 bf16 on an H200, (8192, 16) 8.36, (2048, 4) 9.18, (16384, 32) 10.69
# (docs/benchmarks.md, "The training loss through the tied head").
FORWARD_BLOCKS = (16384, 16)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_kernel(Z, TARGETS, N_KEPT, ROW_LOSS, V: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # N * V passes 2**31 at the models' sizes: 64-bit offsets
    z_row = Z + row * V
    target = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: running max m2 and sum of exp2(x2 - m2); the first chunk starts them (it holds at least one logit)
    x2 = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * _LOG2E
    m2 = tl.max(x2, axis=0)
    total = tl.sum(tl.exp2(x2 - m2), axis=0)
    for v0 in range(BLOCK_V, V, BLOCK_V):
        offs = v0 + cols
        x2 = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * _LOG2E
        new_m2 = tl.maximum(m2, tl.max(x2, axis=0))
        total = total * tl.exp2(m2 - new_m2) + tl.sum(tl.exp2(x2 - new_m2), axis=0)
        m2 = new_m2
    lse2 = m2 + tl.log2(total)

    # the row's loss: 0 where ignored; NaN for a target outside [0, V) other than -1 (a check would sync the host)
    kept = target != -1
    in_range = (target >= 0) & (target < V)
    z_target = tl.load(z_row + tl.where(in_range, target, 0)).to(tl.float32)
    row_loss = (lse2 - z_target * _LOG2E) * _LN2
    tl.store(ROW_LOSS + row, tl.where(in_range, row_loss, tl.where(kept, float("nan"), 0.0)))

    # pass 2: g = share (softmax - onehot), share = 1 / n_kept on kept rows and 0 on ignored ones (a zero row)
    share = tl.where(kept, 1.0 / tl.load(N_KEPT).to(tl.float32), 0.0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        z = tl.load(z_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        p = tl.exp2(z * _LOG2E - lse2)
        g = share * tl.where(offs == target, p - 1.0, p)
        tl.store(z_row + offs, g.to(Z.dtype.element_ty), mask=offs < V)


def cross_entropy_grad_(z: Tensor, targets: Tensor, blocks: tuple[int, int] | None = None) -> Tensor:
    """The mean loss (fp32); overwrites z with g = d loss / d z. z (N, V) contiguous, targets (N,) int64, validated
    by the caller (ppt.kernels.cross_entropy); `blocks` (BLOCK_V a power of two, num_warps) overrides FORWARD_BLOCKS."""
    N, V = z.shape
    block_v, num_warps = blocks or FORWARD_BLOCKS
    block_v = min(block_v, triton.next_power_of_2(V))
    n_kept = (targets != -1).sum()
    row_loss = torch.empty(N, device=z.device, dtype=torch.float32)
    if N:
        _cross_entropy_kernel[(N,)](
            z, targets, n_kept, row_loss, V=V, BLOCK_V=block_v, num_warps=num_warps,
            enable_fp_fusion=True,  # FMAs on every Triton (3.10 turns them off by default)
        )  # fmt: skip
    return row_loss.sum() / n_kept  # 0 / 0 = NaN with every target ignored, as F.cross_entropy gives
