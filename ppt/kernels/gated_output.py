"""Multiscreen's gated output projection as a torch custom op: the sum over heads of the gated, TanhNorm-ed
screening output through each head's output matrix.

For each token (h, g: (B, T, H, dV), the screening output and the gate's input; w: (H, d, dV)):

    tanh_norm(x) = x * tanh(|x|) / |x|          (|x| floored at 1e-8; keeps direction, bounds the norm below 1)
    p_head       = tanh_norm(h_head) * tanh(silu(g_head))
    y            = sum_head p_head @ w_head^T    (B, T, d)

`gated_output(h, g, w)` is the custom op `ppt::gated_output` on CUDA under torch.compile, else
`gated_output_reference(h, g, w)` (plain PyTorch, float64-capable); COST_FORMULAS gives the op's {"matmul",
"elementwise", "bytes"}. The op's forward is one Triton kernel (gated_output_triton.py) that forms p in registers and
never writes it; its backward is plain torch ops, which torch.compile fuses. Why the split, measured on an H200 at
Multiscreen-d16's micro-batch (bench_gated_output, docs/benchmarks.md): the kernel's forward takes 0.250 ms against
0.370 for the compiled reference, and fwd+bwd 0.882 against 1.049; with a Triton backward that also kept dL/dp in
registers, fwd+bwd took 1.458 ms. The kernel takes h and g in bf16, fp16 or fp32 (w cast to their dtype, as autocast
casts a matmul's weight), head dims dV and model widths d that are powers of two from 16 to 64 and 16 to 1024, a
head's (dV, d) tile of w at most 128 KB (larger ones overflow an H100/H200's shared memory); other shapes run the
reference. ppt.flops traces the model on meta, where this is the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_KERNEL_DV = (16, 32, 64)
_KERNEL_D = (16, 32, 64, 128, 256, 512, 1024)
_KERNEL_MAX_W_TILE = 128 * 1024  # bytes of one head's w, which the kernel pipelines through shared memory
_EPS = 1e-8  # tanh_norm's floor on the norm


def tanh_norm(x: Tensor) -> Tensor:
    """Rescale x to norm tanh(|x|): keeps direction, bounds the norm below 1, near identity for small x."""
    norm = x.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    return x * (torch.tanh(norm) / norm)


def gated_output_reference(h: Tensor, g: Tensor, w: Tensor) -> Tensor:
    """y (B, T, d) = sum_head (tanh_norm(h) * tanh(silu(g)))_head @ w_head^T, in plain PyTorch."""
    return torch.einsum("bthv,hdv->btd", tanh_norm(h) * torch.tanh(F.silu(g)), w)


@torch.library.custom_op("ppt::gated_output", mutates_args=())
def _gated_output_op(h: Tensor, g: Tensor, w: Tensor) -> Tensor:
    return gated_output_reference(h, g, w)


@_gated_output_op.register_kernel("cuda")
def _gated_output_cuda(h: Tensor, g: Tensor, w: Tensor) -> Tensor:
    from ppt.kernels.gated_output_triton import gated_output_forward

    return gated_output_forward(h, g, w)


@_gated_output_op.register_fake
def _gated_output_fake(h: Tensor, g: Tensor, w: Tensor) -> Tensor:
    return h.new_empty((*h.shape[:2], w.shape[1]))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    h, g, w = ctx.saved_tensors
    # torch ops, which torch.compile fuses as it did the reference's backward: the matmuls in the operands' dtype
    # (bf16 under autocast), the elementwise math in fp32
    acc = torch.promote_types(h.dtype, torch.float32)
    d_p = torch.einsum("btd,hdv->bthv", grad_y, w).to(acc)
    hf, gf = h.to(acc), g.to(acc)
    norm = hf.norm(dim=-1, keepdim=True)
    floored = norm.clamp_min(_EPS)
    t = torch.tanh(floored)
    scale = t / floored
    sig = torch.sigmoid(gf)
    gate = torch.tanh(gf * sig)
    unit = hf * scale
    d_unit = d_p * gate
    d_g = d_p * unit * (1 - gate * gate) * sig * (1 + gf * (1 - sig))
    slope = torch.where(norm > _EPS, ((1 - t * t) * floored - t) / floored**3, torch.zeros_like(norm))
    d_h = d_unit * scale + hf * slope * (hf * d_unit).sum(dim=-1, keepdim=True)
    d_w = torch.einsum("btd,bthv->hdv", grad_y, (unit * gate).to(h.dtype))
    return d_h.to(h.dtype), d_g.to(g.dtype), d_w.to(w.dtype)


_gated_output_op.register_autograd(_backward, setup_context=_setup_context)


def _kernel_shapes(h: Tensor, g: Tensor, w: Tensor) -> bool:
    return (
        h.dim() == 4
        and g.shape == h.shape
        and w.dim() == 3
        and w.shape[0] == h.shape[2]
        and w.shape[2] == h.shape[3]
        and h.shape[3] in _KERNEL_DV
        and w.shape[1] in _KERNEL_D
        and h.shape[3] * w.shape[1] * h.element_size() <= _KERNEL_MAX_W_TILE
        and h.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and g.dtype == h.dtype
    )


def gated_output(h: Tensor, g: Tensor, w: Tensor) -> Tensor:
    """The op on CUDA under torch.compile (y in h's dtype), else the reference (y in the einsum's dtype). Eager, the
    op's backward is unfused fp32 passes: its fwd+bwd took 10.1 ms on an H200 where compiled it takes 0.88."""
    if h.device.type == "cuda" and torch.compiler.is_compiling() and _kernel_shapes(h, g, w):
        return torch.ops.ppt.gated_output(h.contiguous(), g.contiguous(), w.to(h.dtype).contiguous())
    return gated_output_reference(h, g, w)


# Cost model, for a trace that meets the op itself (a direct call, or CUDA tensors): the reference's matmul FLOPs, so
# N and MFU are those of the reference; the backward's torch ops are traced as they run
def forward_cost(h: Tensor, g: Tensor, w: Tensor) -> dict[str, int]:
    """{"matmul", "elementwise", "bytes"} of one `ppt::gated_output` call: the einsum's matmul FLOPs, the kernel's
    elementwise work per element of p, and its bytes: reads h, g and w, writes y."""
    B, T, H, dV = h.shape
    d = w.shape[1]
    elem = h.element_size()
    return {
        "matmul": 2 * B * T * H * dV * d,
        "elementwise": 12 * B * T * H * dV,
        "bytes": elem * (2 * B * T * H * dV + H * d * dV + B * T * d),
    }


COST_FORMULAS: dict[object, Callable[..., dict[str, int]]] = {torch.ops.ppt.gated_output: forward_cost}
