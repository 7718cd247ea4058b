"""The cross-entropy op with its gradient taken in the forward, and linear_cross_entropy around it: against
F.cross_entropy's autograd in float64, ignored targets, bad input, the cost formula, the Triton kernel in the CPU
interpreter and on CUDA."""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from ppt.common import init_runtime
from ppt.kernels.cross_entropy import (
    COST_FORMULAS,
    cross_entropy_with_grad_reference,
    linear_cross_entropy,
)

F64 = torch.float64


def case(N=6, V=37, d=8, dtype=F64, seed=0, ignored=(1, 4)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=F64).to(dtype)
    w = torch.randn(V, d, generator=g, dtype=F64).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = -1
    return x, w, targets


def reference_grads(x, w, targets, grad_scale):
    leaves = [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    loss = F.cross_entropy(F.linear(*leaves), targets, ignore_index=-1)
    return loss, torch.autograd.grad(loss * grad_scale, leaves)


def test_op_matches_cross_entropy_and_its_gradient():
    x, w, targets = case()
    z = F.linear(x, w).requires_grad_()
    ref = F.cross_entropy(z, targets, ignore_index=-1)
    (ref_g,) = torch.autograd.grad(ref, z)
    g = z.detach().clone()
    loss = torch.ops.ppt.cross_entropy_grad_(g, targets)  # g written over the logits
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(g, ref_g, rtol=1e-12, atol=1e-15)
    assert g[1].abs().max() == 0 and g[4].abs().max() == 0  # ignored rows get no gradient


@pytest.mark.parametrize("grad_scale", [1.0, 1 / 3])
def test_linear_cross_entropy_gradients_match_autograd(grad_scale):
    x, w, targets = case(N=12, ignored=(0, 5, 7))
    x3, t3 = x.view(3, 4, -1), targets.view(3, 4)  # any leading shape
    leaves = [x3.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = linear_cross_entropy(*leaves, t3)
    grads = torch.autograd.grad(loss * grad_scale, leaves)  # an incoming gradient other than 1 scales dx and dW
    ref_loss, ref_grads = reference_grads(x, w, targets, grad_scale)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.reshape(ref.shape), ref, rtol=1e-10, atol=1e-14)


def test_linear_cross_entropy_in_float32_matches_float64():
    x, w, targets = case(N=64, V=300, d=16, dtype=torch.float32, seed=3, ignored=(2,))
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = linear_cross_entropy(*leaves, targets)
    loss.backward()
    ref_loss, ref_grads = reference_grads(x, w, targets, 1.0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    for leaf, ref in zip(leaves, ref_grads):
        torch.testing.assert_close(leaf.grad.double(), ref, rtol=1e-4, atol=1e-7)


def test_compiled_matches_eager():
    """Under torch.compile the op's write over the logits is functionalized: the backward must still see g."""
    x, w, targets = case(N=32, V=300, d=16, dtype=torch.float32, seed=4)
    results = []
    for fn in (linear_cross_entropy, torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = fn(*leaves, targets)
        (loss * 0.5).backward()
        results.append([loss.detach(), *(leaf.grad for leaf in leaves)])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-8)


def test_every_target_ignored_gives_nan_loss_and_zero_gradients_like_f_cross_entropy():
    x, w, targets = case(ignored=range(6))
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = linear_cross_entropy(*leaves, targets)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(F.linear(x, w), targets, ignore_index=-1))
    assert all(leaf.grad.abs().max() == 0 for leaf in leaves)


def test_bad_inputs_raise_clear_errors():
    x, w, targets = case()
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 37\) or be -1"):
        torch.ops.ppt.cross_entropy_grad_(F.linear(x, w), torch.where(targets == -1, 37, targets))
    with pytest.raises(ValueError, match="targets must be int64"):
        cross_entropy_with_grad_reference(F.linear(x, w), targets.int())
    with pytest.raises(ValueError, match=r"floating logits \(N, V\)"):
        cross_entropy_with_grad_reference(F.linear(x, w)[None], targets)
    with pytest.raises(ValueError, match=r"weight \(V, d\)"):
        linear_cross_entropy(x, w.t(), targets)


def test_opcheck():
    x, w, targets = case(dtype=torch.float32)
    torch.library.opcheck(torch.ops.ppt.cross_entropy_grad_.default, (F.linear(x, w), targets))


def test_cost_formula_counts_every_logit():
    z = torch.empty(10, 300, dtype=torch.bfloat16, device="meta")
    cost = COST_FORMULAS[torch.ops.ppt.cross_entropy_grad_](z, torch.empty(10, dtype=torch.int64, device="meta"))
    assert cost == {"reduction": 4 * 3000, "elementwise": 4 * 3000, "bytes": 2 * 2 * 3000 + 8 * 10}


# ----------------------------------------------------------------------------------------------------------------------
# The Triton kernel in the CPU interpreter (TRITON_INTERPRET must be set before triton is imported: a subprocess)

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from ppt.kernels.cross_entropy import cross_entropy_with_grad_reference
    from ppt.kernels.cross_entropy_triton import cross_entropy_grad_

    g = torch.Generator().manual_seed(5)
    z = 4 * torch.randn(7, 300, generator=g)  # V not a power of two: a masked tail in every chunk loop
    targets = torch.randint(0, 300, (7,), generator=g)
    targets[2] = -1
    ref_loss, ref_g = cross_entropy_with_grad_reference(z.double(), targets)
    errors = {}
    for blocks in [(128, 4), (512, 4)]:  # three chunks, and one chunk wider than the row
        grad = z.clone()
        loss = cross_entropy_grad_(grad, targets, blocks)
        errors[f"{blocks} loss"] = float((loss.double() - ref_loss).abs() / ref_loss.abs())
        errors[f"{blocks} g"] = float((grad.double() - ref_g).abs().max() / ref_g.abs().max())
    grad = z.clone()
    cross_entropy_grad_(grad, torch.full((7,), -1))
    errors["all ignored g"] = float(grad.abs().max())
    print(json.dumps(errors))
    """
)


def test_triton_kernel_in_interpreter_matches_float64_reference(check_in_interpreter):
    check_in_interpreter(_INTERPRETER_SCRIPT, 5)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_cuda_matches_float64_reference(dtype, tol):
    x, w, targets = case(N=1000, V=49152, d=64, seed=int(torch.randint(0, 2**31, ())), ignored=(3, 500))
    x, w = (t.to("cuda", dtype) / 4 for t in (x, w))
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    torch.full((64 * 2**20,), float("nan"), device="cuda")  # poison freed memory: an unwritten element shows
    loss = linear_cross_entropy(*leaves, targets.cuda())
    loss.backward()
    ref_loss, ref_grads = reference_grads(x.cpu(), w.cpu(), targets, 1.0)
    assert abs(float(loss.detach()) - float(ref_loss)) <= tol * float(ref_loss)
    for leaf, ref in zip(leaves, ref_grads):
        err = (leaf.grad.cpu().double() - ref).abs().max() / ref.abs().max()
        assert torch.isfinite(leaf.grad).all() and err <= tol, f"{err:.2e}"


def test_a_second_process_takes_the_compiled_loss_from_aotautograds_cache():
    """linear_cross_entropy is a custom autograd.Function, which AOTAutograd's cache passes over unless the runtime
    lets it in: then a run after the first (a study's next run, a relaunch) skips the joint trace and the partition."""
    init_runtime("cpu")
    x, w, targets = case(dtype=torch.float32)
    x.requires_grad_()
    with fresh_cache():
        for process in ("first", "second"):
            torch._dynamo.reset()  # what a new process starts from, the on-disk caches aside
            counters.clear()
            torch.compile(linear_cross_entropy)(x, w, targets).backward()
            assert counters["aot_autograd"].get("autograd_cache_bypass", 0) == 0, process
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_an_edited_custom_function_is_never_served_from_aotautograds_cache():
    """What the runtime's setting admits to the cache stays safe to admit: a Function whose backward changed (a fork
    editing its loss) compiles again and gives its own gradient, not the cached one."""

    def function_with_backward(scale: float) -> type[torch.autograd.Function]:
        class Doubled(torch.autograd.Function):  # the same name and forward each time: only the backward differs
            @staticmethod
            def forward(ctx, x):
                return 2 * x

            @staticmethod
            def backward(ctx, grad):
                return scale * grad

        return Doubled

    init_runtime("cpu")
    with fresh_cache():
        for scale, cache in ((2.0, "miss"), (3.0, "miss"), (2.0, "hit")):  # the first backward again: from the cache
            torch._dynamo.reset()
            counters.clear()
            x = torch.ones(4, requires_grad=True)
            torch.compile(function_with_backward(scale).apply)(x).sum().backward()
            assert torch.equal(x.grad, torch.full((4,), scale))
            assert counters["aot_autograd"][f"autograd_cache_{cache}"] == 1, (scale, dict(counters["aot_autograd"]))
