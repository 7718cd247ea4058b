"""A third architecture, written as a researcher would add one to ppt/model.py, and not shipped there: a GPT-2-style
decoder (pre-norm LayerNorm with biases, GELU MLP, learned positions indexed by doc_pos, tied head), through the
contract of SPEC.md alone. It imports nothing of model.py, so it stays whatever a fork does there, and the tests of
fixed code take their model from it (`build`): they pass on any model.py that honours the contract.

`register(ppt.model)` adds its configs to CONFIGS and its class to MODELS, the two edits model.py would get.
conftest.py registers it for the whole test run, so every test that discovers the architectures of model.py
runs on it too (test_contract.py counts them); test_ddp.py's workers register it in their own processes.

`spare_calls` gives the model a spare linear layer that only its first `spare_calls` forwards on data use (a router
that stops choosing an expert): 0 leaves it without a gradient from the start, 1 from the second such forward on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

from ppt.common import PPTError
from ppt.kernels.attention import attention, document_mask


@dataclass
class GPT2Config:
    n_layer: int = 2
    n_head: int = 2
    n_kv_head: int | None = None  # fewer key/value heads than query heads (grouped-query attention); None: n_head
    d_model: int = 64
    vocab_size: int = 512
    max_seq_len: int = 128
    spare_calls: int | None = None  # a spare layer used in the first N forwards only; None: no spare layer


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head or config.n_head
        self.head_dim = config.d_model // config.n_head
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc_proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, mask: object) -> torch.Tensor:
        B, T, d = x.shape
        qkv = self.qkv(self.ln_1(x)).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.n_head, self.n_kv_head, self.n_kv_head], dim=1)
        x = x + self.proj(attention(q, k, v, mask).transpose(1, 2).reshape(B, T, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise PPTError(f"n_head {config.n_head} does not divide d_model {config.d_model}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)  # indexed by the position inside the document
        self.blocks = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.spare = nn.Linear(config.d_model, config.d_model) if config.spare_calls is not None else None
        self.calls = 0

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's: Normal(0, 0.02) weights, residual projections shrunk by depth, zero biases, unit LayerNorm gains."""
        for name, param in self.named_parameters():
            if param.ndim == 1:
                nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
            else:
                residual = name.endswith(("proj.weight", "fc_proj.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02)

    def param_roles(self) -> dict[str, str]:
        embeddings = {"wte.weight", "wpe.weight"}
        return {
            name: "embedding" if name in embeddings else "matrix" if param.ndim >= 2 else "scalar"
            for name, param in self.named_parameters()
        }

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):  # the contract's signature
        T = idx.shape[1]
        if T > self.config.max_seq_len:
            raise PPTError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        positions = torch.arange(T, device=idx.device) if doc_pos is None else doc_pos
        x = self.wte(idx) + self.wpe(positions)
        mask = document_mask(doc_pos)
        for block in self.blocks:
            x = block(x, mask)
        self.calls += not idx.is_meta  # forwards on data: the FLOPs traces run on meta
        if self.spare is not None and self.calls <= self.config.spare_calls:
            x = x + self.spare(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        if targets is None:
            return logits
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
        return nll.view(targets.shape) if reduction == "none" else nll


CONFIGS = {
    "gpt2-tiny": GPT2Config(),
    "gpt2-spare": GPT2Config(spare_calls=0),
    "gpt2-spare-late": GPT2Config(spare_calls=1),
}


def build(seed: int = 0, **fields: object) -> GPT2:
    """A GPT2 of GPT2Config(**fields), on the CPU, initialized under `seed`: the model tests of fixed code use."""
    model = GPT2(GPT2Config(**fields))
    torch.manual_seed(seed)
    model.init_weights()
    return model


def register(model_file: ModuleType) -> None:
    """Add this architecture to a model file as a fork adds one: its configs to CONFIGS, its class to MODELS."""
    model_file.CONFIGS.update(CONFIGS)
    model_file.MODELS[GPT2Config] = GPT2
