"""The gated output projection: the reference against the formula, the op's autograd (torch ops) and registrations,
the Triton forward (in the CPU interpreter, compiled for sm_90, and on CUDA when present) against float64, the cost
formula, the fallback shapes."""

import os
import textwrap

import pytest
import torch

from ppt.kernels.gated_output import COST_FORMULAS, _kernel_shapes, gated_output, gated_output_reference, tanh_norm

F64 = torch.float64


def random_case(B, T, H, dV, d, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, dV, generator=g, dtype=F64) * 0.7
    h[0, 1, 0] = 0  # a zero row: tanh_norm's floor
    gate_input = torch.randn(B, T, H, dV, generator=g, dtype=F64) * 2
    w = torch.randn(H, d, dV, generator=g, dtype=F64) * 0.2
    grad_y = torch.randn(B, T, d, generator=g, dtype=F64)
    return [x.to(device=device, dtype=dtype) for x in (h, gate_input, w, grad_y)]


def test_reference_matches_the_formula_head_by_head():
    h, g, w, _ = random_case(2, 5, 3, 4, 6)
    y = torch.zeros(2, 5, 6, dtype=F64)
    for head in range(3):
        x = h[:, :, head]
        norm = x.norm(dim=-1, keepdim=True)
        unit = torch.where(norm > 0, x * torch.tanh(norm) / norm.clamp_min(1e-300), x)
        p = unit * torch.tanh(g[:, :, head] * torch.sigmoid(g[:, :, head]))
        y += p @ w[head].T
    torch.testing.assert_close(gated_output_reference(h, g, w), y, rtol=1e-12, atol=1e-12)
    assert tanh_norm(torch.tensor([[3.0, 4.0]], dtype=F64)).norm() < 1  # the norm is bounded below 1


def test_op_gradients_match_reference_autograd():
    h, g, w, grad_y = random_case(2, 7, 3, 4, 6)
    leaves = [x.clone().requires_grad_() for x in (h, g, w)]
    ref = torch.autograd.grad(gated_output_reference(*leaves), leaves, grad_y)
    op_leaves = [x.clone().requires_grad_() for x in (h, g, w)]
    y = torch.ops.ppt.gated_output(*op_leaves)
    torch.testing.assert_close(y, gated_output_reference(h, g, w))
    for got, want in zip(torch.autograd.grad(y, op_leaves, grad_y), ref):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(torch.ops.ppt.gated_output, [x.clone().requires_grad_() for x in (h, g, w)])


def test_op_backward_in_bf16_keeps_the_dtypes_and_agrees_with_float64():
    h, g, w, grad_y = random_case(2, 33, 3, 16, 32, dtype=torch.bfloat16, seed=1)
    leaves = [x.clone().requires_grad_() for x in (h, g, w)]
    grads = torch.autograd.grad(torch.ops.ppt.gated_output(*leaves), leaves, grad_y)
    exact = [x.double().requires_grad_() for x in (h, g, w)]
    refs = torch.autograd.grad(gated_output_reference(*exact), exact, grad_y.double())
    for name, got, ref in zip(["dh", "dg", "dw"], grads, refs):
        assert got.dtype == torch.bfloat16, name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err <= 1e-2, f"{name}: {err:.2e}"


def test_opcheck():
    h, g, w, _ = random_case(1, 3, 2, 4, 8, dtype=torch.float32)
    torch.library.opcheck(torch.ops.ppt.gated_output.default, (h, g, w.requires_grad_()))


def test_gated_output_off_cuda_is_the_reference_and_traces_as_its_ops():
    h, g, w, _ = random_case(1, 3, 2, 4, 8, dtype=torch.float32)
    torch.testing.assert_close(gated_output(h, g, w), gated_output_reference(h, g, w), rtol=0, atol=0)
    with torch.device("meta"):  # ppt.flops traces the model on meta: the same aten ops as the reference's
        meta = [torch.empty_like(x, device="meta") for x in (h, g, w)]
    assert gated_output(*meta).shape == (1, 3, 8)


def test_cost_formula_counts_the_matmuls():
    h, g, w, _ = random_case(2, 8, 3, 16, 32, dtype=torch.bfloat16)
    forward = COST_FORMULAS[torch.ops.ppt.gated_output](h, g, w)
    assert forward["matmul"] == 2 * 2 * 8 * 3 * 16 * 32  # 2 FLOPs per multiply-add of the (H dV) x d product
    assert forward["bytes"] == 2 * (2 * 2 * 8 * 3 * 16 + 3 * 32 * 16 + 2 * 8 * 32)


# ----------------------------------------------------------------------------------------------------------------------
# The Triton forward in the CPU interpreter (TRITON_INTERPRET must be set before triton is imported: a subprocess)

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {test_dir!r})
    from test_gated_output import random_case
    from ppt.kernels.gated_output import gated_output_reference
    from ppt.kernels.gated_output_triton import gated_output_forward

    h, g, w, _ = random_case(2, 37, 3, 16, 32, dtype=torch.float32, seed=3)  # 74 rows: no block divides them
    ref = gated_output_reference(*(x.double() for x in (h, g, w)))
    errors = {{}}
    for blocks in [(16, 4, 1), (32, 4, 2), None]:  # None: FORWARD_BLOCKS, one program over every row
        y = gated_output_forward(h, g, w, blocks)
        errors[str(blocks)] = float((y.double() - ref).abs().max() / ref.abs().max())
    print(json.dumps(errors))
    """
)


def test_triton_forward_in_interpreter_matches_float64_reference(check_in_interpreter):
    check_in_interpreter(_INTERPRETER_SCRIPT.format(test_dir=os.path.dirname(os.path.abspath(__file__))), 3)


# The shapes the kernel takes, compiled ahead of time for an H100/H200 (sm_90; no GPU needed): a launch whose shared
# memory passes the GPU's 227 KB fails, and only a compile shows how much it asks.
SM90_SHARED_MEMORY = 232448


def sm90_shared_memory(dV, d, dtype):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ppt.kernels.gated_output_triton import _gated_output_kernel as kernel
    from ppt.kernels.gated_output_triton import forward_blocks

    rows, warps, stages = forward_blocks(d, dV, torch.empty((), dtype=dtype).element_size())
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    fp32 = dtype == torch.float32  # exact dots and tanh, as the kernel runs fp32 inputs
    constants = dict(H=4, DV=dV, D=d, BLOCK_T=rows, PRECISION="ieee" if fp32 else "tf32", FAST=not fp32)
    pointers = ("H_IN", "G", "W", "Y")
    signature = {n: "constexpr" if n in constants else "*" + name if n in pointers else "i32" for n in kernel.arg_names}
    # pointers and n_rows divisible by 16, as Triton specializes them at launch for these shapes
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in constants}
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


# the largest tiles of w in each dtype at three stages and at two (dV = 64, the widest head, has the largest tiles of
# h and g at each width)
@pytest.mark.parametrize(
    "dtype,d", [(torch.bfloat16, 256), (torch.bfloat16, 1024), (torch.float32, 128), (torch.float32, 512)]
)
def test_kernel_shapes_fit_sm90_shared_memory(dtype, d):
    assert _kernel_shapes(*random_case(1, 2, 4, 64, d, dtype=dtype)[:3])
    assert sm90_shared_memory(64, d, dtype) <= SM90_SHARED_MEMORY


def test_larger_tiles_of_w_run_the_reference():
    assert not _kernel_shapes(*random_case(1, 2, 4, 64, 1024, dtype=torch.float32)[:3])  # 256 KB
    assert not _kernel_shapes(*random_case(1, 2, 4, 128, 256, dtype=torch.bfloat16)[:3])  # dV 128


# ----------------------------------------------------------------------------------------------------------------------
# CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dV,d,tol", [(torch.bfloat16, 64, 256, 1e-2), (torch.float32, 32, 64, 1e-4)])
def test_cuda_matches_float64_reference(dtype, dV, d, tol):
    h, g, w, grad_y = random_case(3, 1000, 4, dV, d, dtype=dtype, seed=int(torch.randint(0, 2**31, ())), device="cuda")
    leaves = [x.double().requires_grad_() for x in (h, g, w)]
    ref_y = gated_output_reference(*leaves)
    refs = [ref_y, *torch.autograd.grad(ref_y, leaves, grad_y.double())]
    inputs = [x.clone().requires_grad_() for x in (h, g, w)]
    y = torch.ops.ppt.gated_output(*inputs)  # the op itself: eager gated_output calls the reference
    for name, got, ref in zip(["y", "dh", "dg", "dw"], [y, *torch.autograd.grad(y, inputs, grad_y)], refs):
        assert torch.isfinite(got).all(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err <= tol, f"{name}: {err:.2e} > {tol}"


@cuda
@pytest.mark.gpu
def test_cuda_op_is_deterministic_and_compiled_gated_output_matches_it():
    h, g, w, grad_y = random_case(2, 700, 4, 64, 256, dtype=torch.bfloat16, seed=5, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (h, g, w)]
    assert torch.equal(gated_output(*leaves), gated_output_reference(*leaves))  # eager: the reference
    first = torch.autograd.grad(torch.ops.ppt.gated_output(*leaves), leaves, grad_y)
    second = torch.autograd.grad(torch.ops.ppt.gated_output(*leaves), leaves, grad_y)
    compiled = torch.compile(gated_output, fullgraph=True)  # compiled: the op
    third = torch.autograd.grad(compiled(*leaves), leaves, grad_y)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b)
        # inductor fuses the backward's torch ops and may round their fp32 math differently before the bf16 cast
        assert float((c.double() - a.double()).abs().max() / a.double().abs().max()) <= 1e-2
