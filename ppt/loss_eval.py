"""Validation NLL (nats/token) and bits-per-byte, the same code for every architecture (SPEC.md, "Measurement").

bits-per-byte = sum of target-token NLL (nats) / (ln 2 * sum of raw bytes of those targets, `Tokenizer.token_bytes()`)
over ordinary tokens: special tokens (0 bytes, e.g. EOT) are left out of both sums, ignored targets (-1) out of
everything. `nll` is the mean over every non-ignored target, EOT included. Sums are float64 in a fixed order,
all-reduced across ranks, so the same checkpoint and token budget give the same numbers at any batch or world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch._functorch.config
import torch.distributed as dist
from torch import Tensor, nn

from ppt.common import PPTError
from ppt.kernels.attention import scores_with_autograd

# Val tokens scored by default, at the end of training and by base_eval alike: the same budget, the same bpb.
DEFAULT_EVAL_TOKENS = 10 * 2**20


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for matmuls when the compute dtype is lower than fp32; a no-op otherwise."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate_bpb(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor, Tensor]],
    token_bytes: Tensor,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """NLL and bits-per-byte over `batches` of (inputs, targets, doc_pos); the model is left in its prior mode. Returns
    `nll` (nats per target token), `bpb`, `tokens` (targets scored) and `bytes` (of the targets that count towards bpb),
    both counts summed over ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=token_bytes.device)  # nll_all, tokens, nll_bytes, bytes
    rows = None
    compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    try:
        for inputs, targets, doc_pos in batches:
            rows = rows or inputs.shape[0]
            if inputs.shape[0] < rows:  # pad a short last batch with ignored rows: a compiled model sees one shape
                extra = rows - inputs.shape[0]
                inputs = torch.cat([inputs, inputs.new_zeros(extra, inputs.shape[1])])
                targets = torch.cat([targets, targets.new_full((extra, targets.shape[1]), -1)])
                doc_pos = None if doc_pos is None else torch.cat([doc_pos, doc_pos[:1].expand(extra, -1)])
            with_autograd = scores_with_autograd(compiled, inputs.device)  # the graph is freed with each batch
            # the backward compiled with the forward: a compiled graph enters AOTAutograd's cache once its backward
            # is compiled (by default at the first backward, which scoring never runs), so later runs take it from there
            no_lazy_backward = torch._functorch.config.patch(force_non_lazy_backward_lowering=True)
            with autocast(inputs.device, dtype), torch.set_grad_enabled(with_autograd), no_lazy_backward:
                nll = model(inputs, targets, doc_pos, reduction="none").detach()
            nll, targets = nll.to(sums.device, torch.float64), targets.to(sums.device)
            valid = targets >= 0
            nbytes = torch.where(valid, token_bytes[targets.clamp_min(0)], 0).double()
            # masked sums rather than boolean indexing, which would wait for the GPU on every batch
            sums += torch.stack(
                [
                    torch.where(valid, nll, 0).sum(),
                    valid.sum().double(),
                    torch.where(nbytes > 0, nll, 0).sum(),
                    nbytes.sum(),
                ]
            )
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(sums)
    nll_all, tokens, nll_bytes, nbytes = sums.tolist()
    if tokens == 0:
        raise PPTError("evaluate_bpb got no target tokens: the validation split is empty; prepare data first")
    bpb = nll_bytes / (math.log(2) * nbytes) if nbytes else float("nan")
    return {"nll": nll_all / tokens, "bpb": bpb, "tokens": int(tokens), "bytes": int(nbytes)}
