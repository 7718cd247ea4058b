"""Document-masked causal attention for the vanilla decoder: token t of a packed row sees key s iff
t - doc_pos[t] <= s <= t (its own document, causally). Plain causal rows (doc_pos None) take SDPA's causal flash
kernel; document masks take FlexAttention's block-sparse mask on CUDA inside torch.compile (tiles outside a document
skipped, tiles inside one unmasked), elsewhere SDPA with a dense boolean (B, 1, T, T) mask, which runs anywhere and
is the correctness oracle. Call `document_mask(doc_pos)` once per forward and pass its result to `attention` in every
layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

# FlexAttention is imported where a forward first takes it: its module pulls in sympy, about 3 s at the start of
# every process that never uses it (CPU runs, evaluation, --help). torch.compile traces the import statements.
if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def document_mask(doc_pos: Tensor | None, flex: bool | None = None) -> Tensor | BlockMask | None:
    """The per-batch mask: None (plain causal), a FlexAttention BlockMask, or a boolean (B, 1, T, T) tensor.

    `flex=None` picks FlexAttention for forwards with autograd on CUDA under torch.compile (eager FlexAttention is
    slow) and the dense mask elsewhere. Forwards without autograd take the dense mask too: FlexAttention's
    inference-only kernels, compiled inside the whole model, hit an illegal memory access on an H200 under torch
    2.11 (SmolLM-360M, 16 x 2048 rows). Scoring forwards therefore run with autograd on (`scores_with_autograd`)."""
    if doc_pos is None:
        return None
    if flex is None:
        flex = doc_pos.is_cuda and torch.compiler.is_compiling() and torch.is_grad_enabled()
    B, T = doc_pos.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return (kv <= q) & (q - kv <= doc_pos[b, q])

        return create_block_mask(same_document_causal, B, None, T, T, device=doc_pos.device)
    keys = torch.arange(T, device=doc_pos.device)
    doc_start = keys - doc_pos.long()
    mask = (keys.view(1, 1, T) <= keys.view(1, T, 1)) & (keys.view(1, 1, T) >= doc_start.unsqueeze(-1))
    return mask.unsqueeze(1)


def scores_with_autograd(compiled: bool, device: torch.device) -> bool:
    """Whether a forward that only scores (evaluation: the result is detached) should run with autograd on: for a
    compiled model on CUDA, whose document masks then take FlexAttention's training kernels, 1.3x faster than the
    dense mask a no-grad forward takes (`document_mask`), and clear of the inference kernels' crash. Elsewhere no."""
    return compiled and device.type == "cuda"


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None) -> Tensor:
    """q (B, H, T, D); k, v (B, Hkv, T, D) with H a multiple of Hkv (GQA). Returns (B, H, T, D)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, Tensor):
        if gqa:  # the dense mask's memory-efficient kernel wants as many KV heads as query heads
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention.flex_attention import flex_attention  # a BlockMask: document_mask imported the module

    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
