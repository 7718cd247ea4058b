"""Optimizers and the learning-rate schedule. Fixed: never imports ppt.model; it reads `model.param_roles()`.

- `adamw`: torch's AdamW over every parameter (fused on CUDA); weight decay on matrices and embeddings only.
- `muon`: Muon (momentum, then Newton-Schulz orthogonalization) for "matrix" parameters, AdamW for the rest.
- `aurora`: Aurora (orthogonalization with a row-balancing preconditioner for non-square matrices) for "matrix"
  parameters, AdamW for the rest. Meant for Multiscreen, whose per-head matrices are mostly non-square.

Matrix parameters of more than two dimensions (per-head stacks `(H, m, n)`) are a batch of `m x n` matrices.
Every param group carries `role`, `algorithm` and `initial_lr`; a schedule sets `lr = initial_lr * multiplier`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from ppt.common import PPTError

ROLES = ("matrix", "embedding", "scalar")
OPTIMIZERS = ("adamw", "muon", "aurora")
DEFAULT_LR = {"adamw": 3e-3, "muon": 0.02, "aurora": 2**-3}  # the main rate of each (matrices for muon, aurora)
BETAS, EPS = (0.9, 0.95), 1e-8  # AdamW's, wherever it runs

# Tuned quintic coefficients (Keller Jordan's Muon): pushes singular values to roughly [0.7, 1.2] in 5 steps.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# p(x) = 2x - 1.5x^3 + 0.5x^5 has a super-attracting fixed point at 1: slower, but converges to the polar factor.
POLAR_COEFFICIENTS = (2.0, -1.5, 0.5)


def newton_schulz(G: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """Approximate orthogonalization U V^T of G = U S V^T over the last two dims (leading dims are a batch), in bf16
    on CUDA (tensor cores; the iteration tolerates it) and fp32 elsewhere; returns G's dtype."""
    a, b, c = coefficients
    X = G.bfloat16() if G.is_cuda else G.float()
    wide = X.size(-2) <= X.size(-1)
    if not wide:  # iterate on the smaller Gram matrix X X^T
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius >= spectral norm, so singular values <= 1
    shape = X.shape
    X = X.reshape(-1, *shape[-2:])  # baddbmm takes one batch dim
    # X <- a X + (b A + c A^2) X with A = X X^T, the sums in the matmuls' epilogues (baddbmm): an Aurora step over
    # multiscreen-d16 took 9.0 ms this way against 15.2 ms with the elementwise ops, on an H200 (docs/benchmarks.md)
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    X = X.reshape(shape)
    return (X if wide else X.mT).to(G.dtype)


def aurora_direction(
    G: torch.Tensor, preconditioner_steps: int = 2, beta: float = 0.5, eps: float = 1e-7
) -> torch.Tensor:
    """Polar factor of D G, the diagonal D rebalancing rows so a tall m x n result has rows of equal norm: plain
    orthogonalization lets some rows carry far more of the update than others. Each preconditioner step rescales rows
    toward the mean squared row norm n / m (damped by the exponent `beta`) and re-orthogonalizes; square matrices need
    no balancing, wide ones are handled transposed."""
    m, n = G.size(-2), G.size(-1)
    if m == n:
        return newton_schulz(G, 12, POLAR_COEFFICIENTS)
    X = G.float() if m > n else G.float().mT
    target_row_sq = min(m, n) / max(m, n)
    row_scale = 1.0 / X.norm(dim=-1, keepdim=True).clamp(min=eps)
    for step in range(preconditioner_steps):
        U = newton_schulz(row_scale * X, 12, POLAR_COEFFICIENTS).float()
        if step < preconditioner_steps - 1:
            row_sq = U.square().sum(dim=-1, keepdim=True).clamp(min=eps * eps)
            row_scale = row_scale * (target_row_sq / row_sq) ** beta
    return (U if m > n else U.mT).to(G.dtype)


class GraphedOnCuda:
    """fn(x) replayed from a CUDA graph captured once per input shape: one launch instead of one per kernel. The
    result lives in the graph's memory and is overwritten by the next call with the same shape; use it before then."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return self.fn(x)
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.graphs:
            static_input = x.clone()
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):  # warm-up off the capture: compilation, cuBLAS workspaces
                self.fn(static_input)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_output = self.fn(static_input)
            self.graphs[key] = (graph, static_input, static_output)
        graph, static_input, static_output = self.graphs[key]
        static_input.copy_(x)
        graph.replay()
        return static_output


class HybridOptimizer(torch.optim.Optimizer):
    """One optimizer for Muon/Aurora groups (matrices) and AdamW groups (embeddings, scalars), each group's
    `algorithm` picking its update; state_dict and param_groups are torch's own, as in any optimizer."""

    def __init__(self, param_groups: list[dict], lr: float = 1e-3, compile: bool = False) -> None:
        defaults = dict(lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0, momentum=0.95, nesterov=True)
        super().__init__(param_groups, defaults)
        # The orthogonalizations are hundreds of small batched ops (an Aurora step over multiscreen-d16: 144 matmuls
        # among ~800 ops). The step runs right after the loop's host sync, so the GPU idles while the host issues
        # them: compiled and replayed from a CUDA graph per matrix shape, the step's GPU span at multiscreen-d16 on an
        # H200 fell from 10.9 ms (eager) through 8.4 ms (compiled) to 4.6-6.0 ms (docs/benchmarks.md).
        self.muon_direction = partial(newton_schulz, steps=5, coefficients=MUON_COEFFICIENTS)
        self.aurora_direction = aurora_direction
        if compile:
            self.muon_direction = GraphedOnCuda(torch.compile(self.muon_direction, dynamic=False))
            self.aurora_direction = GraphedOnCuda(torch.compile(self.aurora_direction, dynamic=False))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            if params := [p for p in group["params"] if p.grad is not None]:
                update = self._adamw_update if group["algorithm"] == "adamw" else self._orthogonal_updates
                update(params, group)

    # Both updates treat a group's tensors as lists (torch._foreach_*): a handful of launches per group instead of
    # several per parameter, since a step of small tensors is bound by how fast the host issues kernels.

    def _adamw_update(self, params: list[torch.Tensor], group: dict) -> None:
        beta1, beta2 = group["betas"]
        by_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # one list per bias correction
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0  # a Python int: bias corrections without a device sync
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            by_step[state["step"]].append(p)
        for step, ps in by_step.items():
            grads = [p.grad for p in ps]
            exp_avgs = [self.state[p]["exp_avg"] for p in ps]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in ps]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            denoms = torch._foreach_div(exp_avg_sqs, 1 - beta2**step)
            torch._foreach_sqrt_(denoms)
            torch._foreach_add_(denoms, group["eps"])
            if group["weight_decay"]:
                torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_addcdiv_(ps, exp_avgs, denoms, value=-group["lr"] / (1 - beta1**step))

    def _orthogonal_updates(self, params: list[torch.Tensor], group: dict) -> None:
        """Nesterov momentum, then one batched orthogonalization per matrix shape up to transposition (a wide matrix
        is orthogonalized as its tall transpose, which the iteration does anyway), then a decoupled-decay step."""
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        grads = [p.grad for p in params]
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, buffers, group["momentum"]) if group["nesterov"] else buffers

        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)  # (rows, cols) of the tall form -> params
        for i, p in enumerate(params):
            by_shape[(max(p.shape[-2:]), min(p.shape[-2:]))].append(i)
        direction = self.muon_direction if group["algorithm"] == "muon" else self.aurora_direction
        directions: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for (rows, cols), indices in by_shape.items():
            tall = [updates[i] if updates[i].shape[-2] == rows else updates[i].mT for i in indices]
            stacked = direction(torch.cat([u.reshape(-1, rows, cols) for u in tall]))
            for i, u, d in zip(indices, tall, stacked.split([u.numel() // (rows * cols) for u in tall])):
                d = d.view(u.shape)
                directions[i] = d if d.shape == params[i].shape else d.mT

        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        # Orthogonal updates have unit singular values; tall matrices get sqrt(rows/cols) so entries' RMS matches.
        by_scale: dict[float, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_scale[max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5].append(i)
        for scale, indices in by_scale.items():
            torch._foreach_add_(
                [params[i] for i in indices], [directions[i] for i in indices], alpha=-group["lr"] * scale
            )


def parameters_by_role(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters grouped by `model.param_roles()`; raises unless every one has exactly one valid role."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    roles = model.param_roles()
    unknown = {name: role for name, role in roles.items() if role not in ROLES}
    if unknown:
        raise PPTError(f"param_roles() gives invalid roles {unknown}; use one of {ROLES}")
    missing, extra = trainable.keys() - roles.keys(), roles.keys() - trainable.keys()
    if missing or extra:
        raise PPTError(
            f"param_roles() must name every trainable parameter once: missing {sorted(missing)}, "
            f"not trainable parameters {sorted(extra)}; fix param_roles() in ppt/model.py"
        )
    grouped: dict[str, list[nn.Parameter]] = {role: [] for role in ROLES}
    for name, p in trainable.items():
        if roles[name] == "matrix" and p.ndim < 2:
            raise PPTError(f"parameter {name} has role 'matrix' but shape {tuple(p.shape)}; call it 'scalar'")
        grouped[roles[name]].append(p)
    return grouped


def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    lr: float | None = None,
    weight_decay: float = 0.0,
    momentum: float = 0.95,
    adamw_lr: float = 3e-3,
    scalar_lr: float | None = None,
    compile: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer for `model`, its groups chosen from `model.param_roles()`. `lr` (default DEFAULT_LR[name]) is
    every parameter's for "adamw", the matrices' for "muon" and "aurora", whose embeddings and scalars take AdamW at
    `adamw_lr` (scalars at `scalar_lr` if given). Decoupled weight decay applies to all but scalars. `compile`
    compiles the orthogonalizations and, on CUDA, replays them from CUDA graphs."""
    if name not in OPTIMIZERS:
        raise PPTError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    lr = DEFAULT_LR[name] if lr is None else lr
    groups = []
    for role, params in parameters_by_role(model).items():
        if not params:
            continue
        group = dict(params=params, role=role, weight_decay=0.0 if role == "scalar" else weight_decay)
        if name == "adamw":
            group |= dict(algorithm="adamw", lr=lr, betas=BETAS, eps=EPS)
        elif role == "matrix":
            group |= dict(algorithm=name, lr=lr, momentum=momentum, nesterov=True)
        else:
            rate = scalar_lr if role == "scalar" and scalar_lr is not None else adamw_lr
            group |= dict(algorithm="adamw", lr=rate, betas=BETAS, eps=EPS)
        groups.append(group | dict(initial_lr=group["lr"]))
    if name == "adamw":
        # fused: one kernel per group, and a found_inf flag that skips a step on the device (scripts/base_train.py)
        fused = all(p.device.type in ("cuda", "cpu") for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, fused=fused or None)
    return HybridOptimizer(groups, lr=lr, compile=compile)


# ---------------------------------------------------------------------------------------------------------------------
# Learning-rate schedule

SCHEDULES = ("constant", "cosine", "wsd")


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    cooldown_frac: float = 0.2,
    min_lr_frac: float = 0.0,
) -> float:
    """Multiplier of the base LR at `step` (0-based): linear warmup, then constant, cosine (from 1 to `min_lr_frac`
    at `total_steps`) or wsd (1, then linear to `min_lr_frac` over the last `cooldown_frac` of `total_steps`)."""
    if schedule not in SCHEDULES:
        raise PPTError(f"unknown LR schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if total_steps <= 0 or warmup_steps < 0 or not 0.0 <= cooldown_frac <= 1.0:
        raise PPTError(
            f"bad schedule settings: total_steps={total_steps} must be > 0, warmup_steps={warmup_steps} >= 0, "
            f"cooldown_frac={cooldown_frac} in [0, 1]"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    cooldown_steps, remaining = cooldown_frac * total_steps, total_steps - step
    if schedule == "wsd" and remaining < cooldown_steps:
        return min_lr_frac + (1 - min_lr_frac) * max(0.0, remaining) / cooldown_steps
    return 1.0


def set_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """lr = initial_lr * multiplier for every group (each group keeps its own base rate)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * multiplier
