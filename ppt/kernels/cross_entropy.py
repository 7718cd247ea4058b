"""The language-model loss with its gradient taken in the forward, and the output head around it.

For logits z (N, V) and targets t (N,) (-1 = ignored), n_kept = #{i : t_i != -1}:

    loss = (1 / n_kept) sum over kept rows i of (logsumexp_j z_ij - z_i,t_i)     F.cross_entropy(z.float(), t, -1)
    g    = d loss / d z = (softmax(z) - onehot(t)) / n_kept on kept rows, 0 on ignored ones

`linear_cross_entropy(x, weight, targets)` (x (..., d), weight (V, d), targets (...) int64) is
F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1) whose backward never passes over the (N, V)
logits elementwise. Its forward takes the head's matmul, then the op `ppt::cross_entropy_grad_(z, targets)` (one
Triton program per row on CUDA: two reads of the row, the second mostly from L2, and g written over it; plain torch
elsewhere, as `cross_entropy_with_grad_reference`), and keeps g in the logits' memory. Its backward is the head's two
matmuls on g, the incoming gradient (1 / gradient-accumulation steps, say) multiplied into their small results:
dx = grad (g W) (N, d) and dW = grad (g^T x) (V, d). Autograd through F.cross_entropy reads the logits in the forward,
again in the backward, writes their gradient and multiplies it by the incoming one. The matmuls are plain torch ops,
so ppt.flops traces them as the same three head matmuls; COST_FORMULAS counts the op.

Dtypes: z bf16, fp16 or fp32 on CUDA (fp64 too elsewhere), contiguous; the loss is fp32 (fp64 for fp64 z).
With every target ignored the loss is NaN and g is zero, as F.cross_entropy gives. Target values are checked off
CUDA only (a check on CUDA syncs with the host): there a target outside [0, V) other than -1 makes the loss NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_inputs(z: Tensor, targets: Tensor) -> None:
    if z.dim() != 2 or z.shape[1] == 0 or not z.dtype.is_floating_point:
        raise ValueError(f"cross entropy expects floating logits (N, V) with V >= 1, got {tuple(z.shape)} {z.dtype}")
    if targets.shape != z.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 ({z.shape[0]},), one per row of logits, got {tuple(targets.shape)} {targets.dtype}"
        )
    if z.device != targets.device:
        raise ValueError(f"logits on {z.device} but targets on {targets.device}: put both on one device")
    if z.device.type == "cuda" and z.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the CUDA cross-entropy kernel takes logits in {KERNEL_DTYPES}, got {z.dtype}")


def cross_entropy_with_grad_reference(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(mean loss, g in z's dtype) in fp32 (fp64 for fp64 z), the kernel's math unchunked."""
    _check_inputs(z, targets)
    bad = (targets < -1) | (targets >= z.shape[1])
    if targets.device.type == "cpu" and bool(bad.any()):  # a check of CUDA values would sync with the host
        raise ValueError(f"targets must lie in [0, {z.shape[1]}) or be -1 (ignored), got {targets[bad][:5].tolist()}")
    logits = z.to(torch.promote_types(z.dtype, torch.float32))
    lse = logits.logsumexp(dim=1)
    kept = targets != -1
    safe_targets = torch.where(kept, targets, 0).unsqueeze(1)
    n_kept = kept.sum()
    row_loss = torch.where(kept, lse - logits.gather(1, safe_targets).squeeze(1), 0)
    g = torch.exp(logits - lse.unsqueeze(1))
    g.scatter_add_(1, safe_targets, -kept.to(g.dtype).unsqueeze(1))  # softmax - onehot on kept rows
    g *= (kept.to(g.dtype) / n_kept.clamp(min=1)).unsqueeze(1)  # ignored rows: zero
    return row_loss.sum() / n_kept, g.to(z.dtype)  # 0 / 0 = NaN with every target ignored


@torch.library.custom_op("ppt::cross_entropy_grad_", mutates_args=("z",))
def _cross_entropy_grad_(z: Tensor, targets: Tensor) -> Tensor:
    loss, g = cross_entropy_with_grad_reference(z, targets)
    z.copy_(g)
    return loss


@_cross_entropy_grad_.register_kernel("cuda")
def _cross_entropy_grad_cuda(z: Tensor, targets: Tensor) -> Tensor:
    from ppt.kernels.cross_entropy_triton import cross_entropy_grad_

    _check_inputs(z, targets)
    if not z.is_contiguous():
        raise ValueError("the CUDA cross-entropy kernel overwrites z row by row: pass contiguous logits")
    return cross_entropy_grad_(z, targets.contiguous())


@_cross_entropy_grad_.register_fake
def _cross_entropy_grad_fake(z: Tensor, targets: Tensor) -> Tensor:
    return z.new_empty((), dtype=torch.promote_types(z.dtype, torch.float32))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        g = F.linear(x, weight).flatten(0, -2)  # the logits (under autocast in its dtype) until the op overwrites them
        loss = torch.ops.ppt.cross_entropy_grad_(g, targets.flatten())
        ctx.save_for_backward(x, weight, g)
        return loss

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, g = ctx.saved_tensors
        # the incoming gradient is multiplied into the (N, d) and (V, d) results in fp32 (or fp64), never into g
        dtype = torch.promote_types(g.dtype, torch.float32)
        scale = grad_loss.to(dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = ((g @ weight.to(g.dtype)).to(dtype) * scale).to(x.dtype).view_as(x)
        if ctx.needs_input_grad[1]:
            dw = ((g.t() @ x.flatten(0, -2).to(g.dtype)).to(dtype) * scale).to(weight.dtype)
        return dx, dw, None


def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1), mean over kept targets, with the
    gradient taken in the forward; see the module docstring. For training losses: it always computes g."""
    if x.shape[:-1] != targets.shape or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy takes x (..., d), weight (V, d) and targets x.shape[:-1]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    return _LinearCrossEntropy.apply(x, weight, targets)


# Cost model for ppt.flops: no matmul work inside the op (the head's matmuls are traced as torch ops)
def forward_cost(z: Tensor, targets: Tensor) -> dict[str, int]:
    """{"reduction", "elementwise", "bytes"} of one call. Per logit: 4 FLOPs for the row statistics (scale, subtract,
    exp, sum; the max is a compare), 4 for g (scale, subtract, exp, multiply). Bytes: z read once (its second read
    mostly hits L2), g written once over it, targets read, scalars left out."""
    logits = z.numel()
    return {"reduction": 4 * logits, "elementwise": 4 * logits, "bytes": 2 * z.element_size() * logits + 8 * len(z)}


COST_FORMULAS: dict[object, Callable[..., dict[str, int]]] = {torch.ops.ppt.cross_entropy_grad_: forward_cost}
