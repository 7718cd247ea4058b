"""The screening op: reference vs a naive formula, the op's autograd and registrations, the Triton kernels (in the
CPU interpreter, and on CUDA when present) against a float64 reference, metadata, cost formulas and input errors."""

import math
import os
import subprocess
import textwrap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ppt.kernels.screening import (
    FLOP_FORMULAS,
    screening,
    screening_cost,
    screening_metadata,
    screening_reference,
)

F64 = torch.float64


def random_doc_pos(B: int, T: int, mean_doc_len: float, generator: torch.Generator) -> torch.Tensor:
    """doc_pos for rows packed with documents of random length (geometric, mean mean_doc_len)."""
    doc_pos = torch.empty(B, T, dtype=torch.int32)
    starts = torch.rand(B, T, generator=generator) < 1 / mean_doc_len
    starts[:, 0] = True
    for b in range(B):
        pos = 0
        for t in range(T):
            pos = 0 if starts[b, t] else pos + 1
            doc_pos[b, t] = pos
    return doc_pos


def random_inputs(B, T, H, dK, dV, dtype=F64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=F64), dim=-1)
    q, k, v = unit(B, T, H, dK), unit(B, T, H, dK), torch.randn(B, T, H, dV, generator=g, dtype=F64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def naive_screening(q, k, v, window, rho, doc_pos):
    """The definition, one query at a time, float64."""
    B, T, H, _ = q.shape
    out = torch.zeros(v.shape, dtype=F64)
    for b in range(B):
        for h in range(H):
            w, r = float(window[h]), float(rho[h])
            for i in range(T):
                j = torch.arange(i + 1)
                lag = (i - j).double()
                keep = (lag < w) & (j >= i - int(doc_pos[b, i]))
                s = k[b, : i + 1, h].double() @ q[b, i, h].double()
                alpha = (1 - r * (1 - s)).clamp(min=0) ** 2
                m = 0.5 * (torch.cos(math.pi * lag / w) + 1) * keep
                out[b, i, h] = (alpha * m) @ v[b, : i + 1, h].double()
    return out


WINDOWS = [1.0, 3.5, 40.0, float("inf")]  # a one-token head, short, longer than most documents, full prefix
RHOS = [1.0, 2.0, 1.3, 1.7]


def test_metadata_matches_definition():
    g = torch.Generator().manual_seed(1)
    doc_pos = random_doc_pos(3, 50, 8, g)
    doc_pos[2] = torch.tensor([0, 5, 1, 0, 2] * 10, dtype=torch.int32)  # malformed: still a well-defined mask
    doc_start, doc_end = screening_metadata(doc_pos)
    t = torch.arange(50)
    assert torch.equal(doc_start, (t - doc_pos).clamp(min=0).int())
    for b in range(3):
        for j in range(50):
            assert doc_end[b, j] == max(i for i in range(50) if doc_start[b, i] <= j)
    assert doc_start.dtype == doc_end.dtype == torch.int32


def test_reference_matches_naive_formula():
    g = torch.Generator().manual_seed(2)
    B, T, H = 2, 28, 4
    doc_pos = random_doc_pos(B, T, 10, g)
    q, k, v = random_inputs(B, T, H, 8, 5)
    window, rho = torch.tensor(WINDOWS, dtype=F64), torch.tensor(RHOS, dtype=F64)
    got = screening_reference(q, k, v, window, rho, screening_metadata(doc_pos))
    torch.testing.assert_close(got, naive_screening(q, k, v, window, rho, doc_pos), rtol=1e-12, atol=1e-12)


def test_reference_chunks_long_rows_without_seams():
    """T above the query chunk: outputs past the chunk boundary still match the one-shot formula."""
    g = torch.Generator().manual_seed(3)
    doc_pos = random_doc_pos(1, 300, 100, g)
    q, k, v = random_inputs(1, 300, 2, 4, 3)
    window, rho = torch.tensor([7.5, float("inf")], dtype=F64), torch.tensor([1.5, 1.0], dtype=F64)
    got = screening_reference(q, k, v, window, rho, screening_metadata(doc_pos))
    torch.testing.assert_close(got[:, 250:], naive_screening(q, k, v, window, rho, doc_pos)[:, 250:])


def test_op_gradients_match_reference_autograd():
    """The op's analytic backward (CPU) equals autograd through the reference, for all five inputs."""
    g = torch.Generator().manual_seed(4)
    B, T, H = 2, 60, 4
    meta = screening_metadata(random_doc_pos(B, T, 15, g))
    leaves = [*random_inputs(B, T, H, 8, 6, seed=4), torch.tensor(WINDOWS), torch.tensor(RHOS)]
    grad_out = torch.randn(B, T, H, 6, generator=g, dtype=F64)
    ref_in = [x.detach().clone().requires_grad_() for x in leaves]
    op_in = [x.detach().clone().requires_grad_() for x in leaves]
    ref_out = screening_reference(*ref_in, meta)
    op_out = screening(*op_in, meta)
    torch.testing.assert_close(op_out, ref_out)
    ref_grads = torch.autograd.grad(ref_out, ref_in, grad_out)
    op_grads = torch.autograd.grad(op_out, op_in, grad_out)
    for name, a, b in zip(["q", "k", "v", "window", "rho"], op_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")
    assert op_grads[3][3] == 0  # the full-prefix head's softmask is constant


def test_op_gradcheck_float64():
    g = torch.Generator().manual_seed(5)
    meta = screening_metadata(random_doc_pos(1, 12, 5, g))
    q, k, v = (x.requires_grad_() for x in random_inputs(1, 12, 2, 4, 3, seed=5))
    # windows and lags stay away from the mask edge so finite differences see a smooth function
    window = torch.tensor([3.4, 9.7], dtype=F64, requires_grad=True)
    rho = torch.tensor([1.2, 0.9], dtype=F64, requires_grad=True)
    fn = lambda q, k, v, w, r: screening_reference(q, k, v, w, r, meta)
    assert torch.autograd.gradcheck(fn, (q, k, v, window, rho), fast_mode=True)
    op = lambda q, k, v, w, r: torch.ops.ppt.screening(q, k, v, w, r, *meta)  # the op's own (analytic) backward
    assert torch.autograd.gradcheck(op, (q, k, v, window, rho), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the output keeps it, as the fake says
def test_opcheck(dtype):
    g = torch.Generator().manual_seed(6)
    meta = screening_metadata(random_doc_pos(2, 20, 6, g))
    q, k, v = (x.requires_grad_() for x in random_inputs(2, 20, 4, 8, 8, dtype=dtype, seed=6))
    args = (q, k, v, torch.tensor(WINDOWS).requires_grad_(), torch.tensor(RHOS).requires_grad_(), *meta)
    torch.library.opcheck(torch.ops.ppt.screening.default, args)


def test_cost_counts_in_window_in_document_pairs():
    g = torch.Generator().manual_seed(7)
    B, T, H, dK, dV = 2, 30, 4, 16, 64
    doc_pos = random_doc_pos(B, T, 9, g)
    window = torch.tensor(WINDOWS)
    brute = sum(
        1
        for b in range(B)
        for h in range(H)
        for i in range(T)
        for j in range(i + 1)
        if i - j < WINDOWS[h] and j >= i - int(doc_pos[b, i])
    )
    cost = screening_cost(B, T, H, dK, dV, window, screening_metadata(doc_pos), torch.bfloat16)
    assert cost["pairs"] == brute
    assert cost["fwd_flops"] == 2 * (dK + dV) * brute and cost["bwd_flops"] == 2 * cost["fwd_flops"]
    assert cost["fwd_bytes"] == 2 * B * T * H * (2 * dK + 2 * dV) + 8 * B * T
    assert cost["bwd_bytes"] == 2 * B * T * H * (4 * dK + 3 * dV) + 8 * B * T  # q, k, v, dh in; dq, dk, dv out
    # without readable values: an upper bound from shapes alone
    estimate = screening_cost(B, T, H, dK, dV, torch.empty(H, device="meta"), None)
    assert estimate["pairs"] == B * H * T * (T + 1) // 2


def test_flop_counter_counts_forward_and_backward():
    B, T, H = 2, 24, 4
    meta = screening_metadata(torch.arange(T, dtype=torch.int32).expand(B, T))
    q, k, v = (x.requires_grad_() for x in random_inputs(B, T, H, 16, 32, dtype=torch.float32))
    window, rho = torch.tensor(WINDOWS), torch.tensor(RHOS)
    with FlopCounterMode(custom_mapping=FLOP_FORMULAS, display=False) as counter:
        screening(q, k, v, window, rho, meta).sum().backward()
    expected = screening_cost(B, T, H, 16, 32, window, meta)
    assert counter.get_total_flops() == expected["fwd_flops"] + expected["bwd_flops"]


def test_bad_inputs_raise_clear_errors():
    meta = screening_metadata(torch.zeros(1, 8, dtype=torch.int32))
    q, k, v = random_inputs(1, 8, 2, 4, 4, dtype=torch.float32)
    window, rho = torch.tensor([2.0, 3.0]), torch.ones(2)
    with pytest.raises(ValueError, match="q, k"):
        screening(q, k[:, :4], v, window, rho, meta)
    with pytest.raises(ValueError, match="one floating dtype"):
        screening(q, k.double(), v, window, rho, meta)
    with pytest.raises(ValueError, match="window must be"):
        screening(q, k, v, torch.tensor([2.0, 3.0, 4.0]), rho, meta)
    with pytest.raises(ValueError, match="screening_metadata"):
        screening(q, k, v, window, rho, screening_metadata(torch.zeros(1, 9, dtype=torch.int32)))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="window must be > 0"):
            screening(q, k, v, torch.tensor([2.0, bad]), rho, meta)
    with pytest.raises(ValueError, match="doc_pos"):
        screening_metadata(torch.zeros(8, dtype=torch.int32))


def test_kernel_rejects_untileable_head_dims():
    from ppt.kernels.screening import _check_kernel_inputs

    q, _, v = random_inputs(1, 8, 2, 24, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head dims \(16, 32, 64, 128\).*dK=24"):
        _check_kernel_inputs(q, v)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels in the CPU interpreter (TRITON_INTERPRET must be set before triton is imported: a subprocess)

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {test_dir!r})
    from test_screening import WINDOWS, RHOS, random_doc_pos, random_inputs
    from ppt.kernels.screening import screening_metadata, screening_reference
    from ppt.kernels.screening_triton import screening_backward, screening_forward

    torch.use_deterministic_algorithms(True)  # new tensors start as NaN: an element no kernel writes shows up
    g = torch.Generator().manual_seed(8)
    B, T, H, dK, dV = 2, 40, 4, 16, 16  # T not a multiple of any block; several documents per row
    meta = screening_metadata(random_doc_pos(B, T, 15, g))
    q, k, v = random_inputs(B, T, H, dK, dV, dtype=torch.float32, seed=8)
    window, rho = torch.tensor(WINDOWS), torch.tensor(RHOS)
    grad_out = torch.randn(B, T, H, dV, generator=g)

    leaves = [x.double().requires_grad_() for x in (q, k, v, window, rho)]
    ref_out = screening_reference(*leaves, meta)
    refs = [ref_out, *torch.autograd.grad(ref_out, leaves, grad_out.double())]
    errors = {{}}
    one = lambda blocks: ((None, blocks),)
    two = lambda short, long: ((8, short), (None, long))  # spans <= 8 (windows 1, 3.5) and longer (40, inf)
    for label, fwd_plan, dq_plan, dkdv_plan in [
        ("square", one((16, 16, 4, 1)), one((16, 16, 4, 1)), one((16, 16, 4, 1))),
        ("mixed", one((32, 16, 4, 1)), one((16, 32, 4, 1)), one((32, 16, 4, 1))),
        ("classes", two((16, 16, 4, 1), (32, 16, 4, 1, 96)), two((16, 32, 4, 1), (16, 16, 4, 1)),
         two((16, 32, 4, 1, 128), (32, 16, 4, 1))),  # a fifth number caps the registers
    ]:
        out = screening_forward(q, k, v, window, rho, meta[0], plan=fwd_plan)
        grads = screening_backward(q, k, v, window, rho, *meta, grad_out, dq_plan=dq_plan, dkdv_plan=dkdv_plan)
        for name, got, ref in zip(["out", "dq", "dk", "dv", "dwindow", "drho"], [out, *grads], refs):
            err = (got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
            errors[label + " " + name] = float(err) if torch.isfinite(got).all() else float("inf")
    empty = screening_backward(*(x[:, :0] for x in (q, k, v)), window, rho, *(m[:, :0] for m in meta), grad_out[:, :0])
    errors["empty batch d window, d rho"] = float(torch.cat(empty[3:]).abs().max())  # zeros, not unwritten memory
    print(json.dumps(errors))
    """
)


def test_triton_kernels_in_interpreter_match_float64_reference(check_in_interpreter):
    check_in_interpreter(_INTERPRETER_SCRIPT.format(test_dir=os.path.dirname(os.path.abspath(__file__))), 19)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _poison_cuda_allocator():
    """Fill recently freed memory with NaN, so an output element the kernel forgets to write shows up."""
    torch.full((64 * 2**20,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _cuda_case(B, T, H, dK, dV, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    meta = [t.cuda() for t in screening_metadata(random_doc_pos(B, T, 300, g))]
    q, k, v = random_inputs(B, T, H, dK, dV, dtype=dtype, seed=seed, device="cuda")
    windows = torch.tensor((WINDOWS * H)[:H]).cuda()
    rho = (1 + torch.rand(H, generator=g)).cuda()
    grad_out = torch.randn(B, T, H, dV, generator=g).to("cuda", dtype)
    return q, k, v, windows, rho, meta, grad_out


def _relative_error(got, ref):
    return float((got.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-12))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dK,dV,tol", [(torch.bfloat16, 16, 64, 1e-2), (torch.bfloat16, 64, 128, 1e-2),
                                              (torch.float32, 32, 16, 1e-4)])  # fmt: skip
def test_cuda_matches_float64_reference(dtype, dK, dV, tol):
    seed = int(torch.randint(0, 2**31, ()))  # fresh inputs every run
    q, k, v, window, rho, meta, grad_out = _cuda_case(2, 1000, 4, dK, dV, dtype, seed)
    leaves = [x.double().requires_grad_() for x in (q, k, v, window, rho)]
    ref_out = screening_reference(*leaves, meta)
    refs = [ref_out, *torch.autograd.grad(ref_out, leaves, grad_out.double())]

    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, window, rho)]
    _poison_cuda_allocator()
    out = screening(*inputs, meta)
    _poison_cuda_allocator()
    grads = torch.autograd.grad(out, inputs, grad_out)
    for name, got, ref in zip(["out", "dq", "dk", "dv", "dwindow", "drho"], [out, *grads], refs):
        assert torch.isfinite(got).all(), f"{name} has non-finite (unwritten?) elements, seed {seed}"
        assert _relative_error(got, ref) <= tol, f"{name}: {_relative_error(got, ref):.2e} > {tol}, seed {seed}"


@cuda
@pytest.mark.gpu
def test_cuda_backward_is_deterministic_and_compile_matches_eager():
    q, k, v, window, rho, meta, grad_out = _cuda_case(2, 700, 4, 16, 64, torch.bfloat16, seed=9)

    def loss_and_grads(fn):
        inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, window, rho)]
        out = fn(*inputs, meta)
        return [out, *torch.autograd.grad(out, inputs, grad_out)]

    eager = loss_and_grads(screening)
    again = loss_and_grads(screening)
    compiled = loss_and_grads(torch.compile(screening, fullgraph=True))
    for a, b, c in zip(eager, again, compiled):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [((None, (16, 16, 1, 1)),), ((None, (64, 32, 4, 2)),), ((None, (32, 64, 4, 3)),),
     ((4, (16, 16, 1, 1)), (64, (32, 16, 2, 2)), (None, (64, 64, 4, 2)))],
)  # fmt: skip
def test_cuda_kernels_agree_across_block_configs(plan):
    """The kernels are exact for any tiling and any split into window classes, not only the default one (T = 1000
    leaves partial tiles)."""
    from ppt.kernels.screening_triton import screening_backward, screening_forward

    q, k, v, window, rho, meta, grad_out = _cuda_case(2, 1000, 4, 16, 64, torch.bfloat16, seed=10)
    leaves = [x.double().requires_grad_() for x in (q, k, v, window, rho)]
    ref_out = screening_reference(*leaves, meta)
    refs = [ref_out, *torch.autograd.grad(ref_out, leaves, grad_out.double())]
    out = screening_forward(q, k, v, window, rho, meta[0], plan=plan)
    grads = screening_backward(q, k, v, window, rho, *meta, grad_out, dq_plan=plan, dkdv_plan=plan)
    for name, got, ref in zip(["out", "dq", "dk", "dv", "dwindow", "drho"], [out, *grads], refs):
        assert torch.isfinite(got).all() and _relative_error(got, ref) <= 1e-2, name


# ----------------------------------------------------------------------------------------------------------------------
# Tools around the kernels


E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "bench_multiscreen_e2e.sh")


def test_bench_multiscreen_e2e_answers_help():
    result = subprocess.run(["bash", E2E, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("usage:")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["17"],
        ["16", "1", "seed", "--ref", "/nonexistent"],
        ["16", "--compile-mode", "fast"],
        ["16", "--compile-mode"],
    ],
)
def test_bench_multiscreen_e2e_names_what_it_needs(args):
    result = subprocess.run(["bash", E2E, *args], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
