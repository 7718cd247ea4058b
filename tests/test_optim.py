"""ppt/optim.py: orthogonalization numerics, group coverage, training progress, checkpoint round trips, schedules."""

import copy
import math

import pytest
import third_arch
import torch
import torch.nn as nn
from architectures import fresh, smallest_config_per_class

from ppt.common import PPTError
from ppt.optim import (
    DEFAULT_LR,
    MUON_COEFFICIENTS,
    POLAR_COEFFICIENTS,
    aurora_direction,
    build_optimizer,
    lr_multiplier,
    newton_schulz,
    set_lr,
)

ARCHITECTURES = smallest_config_per_class()  # one config of each architecture of ppt/model.py


def fixed_batch(vocab: int, B: int = 4, T: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------------------------------------------------
# Orthogonalization


def test_polar_iteration_matches_svd_polar_factor():
    G = torch.randn(3, 40, 12, generator=torch.Generator().manual_seed(0))
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    torch.testing.assert_close(newton_schulz(G, 12, POLAR_COEFFICIENTS), U @ Vh, atol=1e-4, rtol=0)
    torch.testing.assert_close(newton_schulz(G.mT, 12, POLAR_COEFFICIENTS), (U @ Vh).mT, atol=1e-4, rtol=0)


def test_muon_iteration_brings_singular_values_near_one():
    G = torch.randn(64, 24, generator=torch.Generator().manual_seed(0)) * 50
    singular_values = torch.linalg.svdvals(newton_schulz(G, 5, MUON_COEFFICIENTS))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25


def test_aurora_balances_rows_of_tall_matrices():
    G = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(0))
    G[:, :8] *= 10  # a few dominant rows: plain orthogonalization hands them most of the update
    plain = newton_schulz(G, 12, POLAR_COEFFICIENTS).square().sum(-1)
    balanced_direction = aurora_direction(G)
    balanced = balanced_direction.square().sum(-1)
    assert balanced.std() < 0.3 * plain.std()
    assert abs(balanced.mean().item() - 16 / 64) < 0.01  # still orthonormal columns: mean squared row norm n / m
    torch.testing.assert_close(aurora_direction(G.mT), balanced_direction.mT)  # wide = transposed tall


def test_aurora_on_square_matrices_is_the_polar_factor():
    G = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    U, _, Vh = torch.linalg.svd(G)
    torch.testing.assert_close(aurora_direction(G), U @ Vh, atol=2e-3, rtol=0)


class ThreeMatrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(24, 8, generator=generator))
        self.b = nn.Parameter(torch.randn(24, 8, generator=generator))  # same shape as a: orthogonalized in one batch
        self.c = nn.Parameter(torch.randn(3, 8, 16, generator=generator))  # a per-head stack

    def param_roles(self) -> dict[str, str]:
        return {"a": "matrix", "b": "matrix", "c": "matrix"}


@pytest.mark.parametrize("name", ["muon", "aurora"])
def test_first_orthogonal_step_matches_the_formula(name):
    model = ThreeMatrices()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    lr, momentum, decay = 0.05, 0.9, 0.1
    build_optimizer(model, name, lr=lr, momentum=momentum, weight_decay=decay).step()
    for n, p in model.named_parameters():
        update = grads[n].lerp((1 - momentum) * grads[n], momentum)  # Nesterov on a fresh momentum buffer
        direction = newton_schulz(update, 5, MUON_COEFFICIENTS) if name == "muon" else aurora_direction(update)
        scale = max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
        expected = before[n] * (1 - lr * decay) - lr * scale * direction
        torch.testing.assert_close(p.detach(), expected, atol=1e-5, rtol=1e-5)


def test_newton_schulz_matches_the_iteration_written_elementwise():
    G = torch.randn(5, 24, 40, generator=torch.Generator().manual_seed(0))
    for (a, b, c), steps in ((MUON_COEFFICIENTS, 5), (POLAR_COEFFICIENTS, 12)):
        X = G / G.norm(dim=(-2, -1), keepdim=True)
        for _ in range(steps):
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
        torch.testing.assert_close(newton_schulz(G, steps, (a, b, c)), X, atol=1e-5, rtol=0)
        torch.testing.assert_close(newton_schulz(G.mT, steps, (a, b, c)), X.mT, atol=1e-5, rtol=0)


def per_matrix_steps(model: nn.Module, name: str, grads: list[dict], lr: float, decay: float) -> None:
    """The optimizer's update written one parameter at a time (defaults: momentum 0.95, betas 0.9/0.95, AdamW
    at 3e-3 for embeddings and scalars, no decay on scalars)."""
    roles, state = model.param_roles(), {}
    for step, step_grads in enumerate(grads, start=1):
        for n, p in model.named_parameters():
            g = step_grads[n]
            with torch.no_grad():
                if roles[n] == "matrix":
                    buffer = state.setdefault(n, torch.zeros_like(p)).lerp_(g, 0.05)
                    update = g.lerp(buffer, 0.95)
                    direction = (
                        newton_schulz(update, 5, MUON_COEFFICIENTS) if name == "muon" else aurora_direction(update)
                    )
                    p.mul_(1 - lr * decay).add_(direction, alpha=-lr * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5)
                else:
                    m, v = state.setdefault(n, (torch.zeros_like(p), torch.zeros_like(p)))
                    m.lerp_(g, 0.1)
                    v.mul_(0.95).addcmul_(g, g, value=0.05)
                    denom = (v / (1 - 0.95**step)).sqrt_().add_(1e-8)
                    p.mul_(1 - 3e-3 * (0.0 if roles[n] == "scalar" else decay))
                    p.addcdiv_(m, denom, value=-3e-3 / (1 - 0.9**step))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("name", ["muon", "aurora"])
def test_batched_step_equals_the_per_matrix_step(name, architecture):
    """The optimizer updates lists of tensors at once and orthogonalizes every matrix of a shape (up to
    transposition) in one batch; three steps on each architecture's mix of wide, tall, per-head stacked, embedding
    and scalar parameters give what the update gives one parameter at a time, to fp32 rounding (wide matrices are
    orthogonalized as a transposed copy, not a transposed view)."""
    batched, reference = fresh(architecture), fresh(architecture)
    generator = torch.Generator().manual_seed(1)
    grads = [{n: torch.randn(p.shape, generator=generator) for n, p in batched.named_parameters()} for _ in range(3)]
    optimizer = build_optimizer(batched, name, lr=0.05, weight_decay=0.1)
    for step_grads in grads:
        for n, p in batched.named_parameters():
            p.grad = step_grads[n].clone()
        optimizer.step()
    per_matrix_steps(reference, name, grads, lr=0.05, decay=0.1)
    roles = batched.param_roles()
    for (n, p), expected in zip(batched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, expected, atol=1e-6, rtol=1e-6, msg=n)
        if roles[n] != "matrix":  # AdamW through lists: the same ops, bit for bit
            assert torch.equal(p, expected), n


# ---------------------------------------------------------------------------------------------------------------------
# Groups


@pytest.mark.parametrize("name", ["adamw", "muon", "aurora"])
def test_every_parameter_in_exactly_one_group(name):
    model = third_arch.build()
    optimizer = build_optimizer(model, name)
    in_groups = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(in_groups) == sorted(id(p) for p in model.parameters())
    roles = {group["role"]: group for group in optimizer.param_groups}
    assert set(roles) == {"matrix", "embedding", "scalar"}
    assert roles["matrix"]["algorithm"] == ("adamw" if name == "adamw" else name)
    assert roles["matrix"]["lr"] == roles["matrix"]["initial_lr"] == DEFAULT_LR[name]
    assert roles["embedding"]["algorithm"] == roles["scalar"]["algorithm"] == "adamw"
    assert roles["scalar"]["weight_decay"] == 0.0


class MislabelledModel(nn.Module):
    def __init__(self, roles: dict[str, str]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.gain = nn.Parameter(torch.ones(4))
        self.roles = roles

    def param_roles(self) -> dict[str, str]:
        return self.roles


@pytest.mark.parametrize(
    "roles, message",
    [
        ({"weight": "matrix"}, "missing"),
        ({"weight": "matrix", "gain": "scalar", "ghost": "scalar"}, "not trainable"),
        ({"weight": "matrix", "gain": "bias"}, "invalid roles"),
        ({"weight": "matrix", "gain": "matrix"}, "call it 'scalar'"),
    ],
)
def test_bad_param_roles_are_rejected(roles, message):
    with pytest.raises(PPTError, match=message):
        build_optimizer(MislabelledModel(roles), "muon")


def test_frozen_parameters_are_left_out():
    model = third_arch.build()
    model.ln_f.weight.requires_grad_(False)
    roles = model.param_roles()
    model.param_roles = lambda: {n: r for n, r in roles.items() if n != "ln_f.weight"}
    optimizer = build_optimizer(model, "muon")
    assert all(p is not model.ln_f.weight for g in optimizer.param_groups for p in g["params"])


def test_unknown_optimizer_name():
    with pytest.raises(PPTError, match="adamw, muon, aurora"):
        build_optimizer(third_arch.build(), "sgd")


# ---------------------------------------------------------------------------------------------------------------------
# Training progress and state


@pytest.mark.parametrize("name, lr", [("adamw", 3e-3), ("muon", 0.02), ("aurora", 0.05)])
def test_a_few_steps_reduce_loss_on_a_fixed_batch(name, lr):
    model = third_arch.build()
    optimizer = build_optimizer(model, name, lr=lr, weight_decay=0.1)
    idx, targets = fixed_batch(model.config.vocab_size)
    losses = []
    for _ in range(8):
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("name", ["adamw", "muon", "aurora"])
def test_state_dict_round_trip_resumes_identically(name):
    model = third_arch.build()
    idx, targets = fixed_batch(model.config.vocab_size, B=2, T=16)

    def step(model, optimizer):
        model(idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    optimizer = build_optimizer(model, name)
    step(model, optimizer)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())  # the live state is updated in place
    step(model, optimizer)

    resumed = third_arch.build()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = build_optimizer(resumed, name)
    resumed_optimizer.load_state_dict(saved_optimizer)
    step(resumed, resumed_optimizer)
    for (key, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=key)


def test_set_lr_scales_each_group_from_its_own_base():
    optimizer = build_optimizer(third_arch.build(), "muon", lr=0.02, adamw_lr=1e-3, scalar_lr=4e-3)
    set_lr(optimizer, 0.5)
    rates = {group["role"]: group["lr"] for group in optimizer.param_groups}
    assert rates == pytest.approx({"matrix": 0.01, "embedding": 5e-4, "scalar": 2e-3})


# ---------------------------------------------------------------------------------------------------------------------
# Schedules


def test_warmup_is_linear_and_reaches_one():
    assert [lr_multiplier(s, 100, 4) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_cosine_decays_from_one_to_the_floor():
    values = [lr_multiplier(s, 100, 10, "cosine", min_lr_frac=0.1) for s in range(10, 101)]
    assert values[0] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert values[45] == pytest.approx(0.55)  # halfway through the decay
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_holds_then_cools_down_linearly():
    values = [lr_multiplier(s, 100, 10, "wsd", cooldown_frac=0.2) for s in range(101)]
    assert values[10:80] == pytest.approx([1.0] * 70)
    assert values[90] == pytest.approx(0.5)
    assert values[100] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_constant_and_bad_schedules():
    assert lr_multiplier(50, 100) == 1.0
    with pytest.raises(PPTError, match="cosine"):
        lr_multiplier(0, 100, schedule="linear")
    with pytest.raises(PPTError, match="total_steps"):
        lr_multiplier(0, 0)
    assert math.isfinite(lr_multiplier(200, 100, 0, "cosine"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("name", ["muon", "aurora"])
def test_compiled_orthogonalization_matches_eager_on_cuda(name, architecture):
    """base_train compiles the orthogonalizations (and replays them from CUDA graphs) whenever it compiles the model:
    three steps over each architecture's matrices (per-head stacks too), each graph replayed on new gradients, give
    the eager optimizer's parameters to the bf16 iteration's rounding."""
    models = [fresh(architecture).cuda() for _ in range(2)]
    optimizers = [build_optimizer(m, name, compile=compiled) for m, compiled in zip(models, (False, True))]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in models[0].named_parameters()}
        for model, optimizer in zip(models, optimizers):
            for n, p in model.named_parameters():
                p.grad = grads[n].cuda()
            optimizer.step()
    for (n, eager), compiled in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-2, msg=n)
