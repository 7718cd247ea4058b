"""The model: the one file a researcher edits.

Two architectures live here, each a config dataclass plus an nn.Module that honours the contract in SPEC.md:
- `Llama`: the vanilla SmolLM decoder (pre-norm, GQA attention with RoPE, SwiGLU MLP, RMSNorm, tied embedding).
- `MultiscreenLM`: screening attention with learned windows, no FFN, a normalized tied embedding.
`MODELS` maps each config class to its model class (a new architecture adds one entry) and `build_model(config)` builds
from it; `get_config(name, depth)` resolves a name, a size dial (`d12`, `multiscreen-d12`) or a depth.
`Llama.hf_mapping()` and `config_from_hf(config_json)` say how the vanilla model corresponds to transformers'
LlamaForCausalLM, for export to and import from Hugging Face folders (optional: Multiscreen has neither).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ppt.common import PPTError
from ppt.contract import build
from ppt.flops import OpFormulas
from ppt.kernels import cross_entropy as cross_entropy_op
from ppt.kernels import gated_output as gated_output_op
from ppt.kernels import screening as screening_op
from ppt.kernels.attention import attention, document_mask
from ppt.kernels.cross_entropy import linear_cross_entropy
from ppt.kernels.gated_output import gated_output
from ppt.kernels.screening import KERNEL_HEAD_DIMS, screening, screening_metadata

# ---------------------------------------------------------------------------------------------------------------------
# Vanilla Llama / SmolLM decoder


@dataclass
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    vocab_size: int = 49152
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def roles_by_shape(model: nn.Module, embedding: str) -> dict[str, str]:
    """Optimizer roles (SPEC.md): the named token embedding, matrices (2-D or stacks of them), and scalars."""
    return {
        name: "embedding" if name == embedding else "matrix" if param.ndim >= 2 else "scalar"
        for name, param in model.named_parameters()
    }


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 whatever the input's dtype: the residual stream is bf16 under autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D). Non-interleaved halves, as Hugging Face Llama does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # stay in the matmul dtype under autocast
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head or config.n_head % config.n_kv_head:
            raise PPTError(
                f"d_model {config.d_model}, n_head {config.n_head}, n_kv_head {config.n_kv_head} do not divide; "
                "choose n_head dividing d_model and n_kv_head dividing n_head"
            )
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention(q, k, v, mask)  # causal flash, FlexAttention (CUDA, compiled) or dense-mask SDPA
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.rms_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.rms_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: object) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, mask)
        # The residual stream takes the branches' dtype: under autocast bf16, half the bytes of fp32 in the step's
        # largest elementwise traffic (adds and norms over every layer); without autocast fp32, as before.
        x = x.to(h.dtype) + h
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, eps=config.rms_eps)
        # Non-persistent: recomputed from the config, so checkpoints hold weights only and meta builds stay cheap.
        cos, sin = self._rope_tables(self.embed.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
        angles = torch.outer(torch.arange(self.config.max_seq_len, device=device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, dim): each frequency for both halves
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) matrices and embedding; residual-branch outputs shrunk by depth; unit norm gains."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        nn.init.normal_(self.embed.weight, std=0.02)
        for block in self.blocks:
            for linear in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.mlp.gate_proj):
                nn.init.normal_(linear.weight, std=0.02)
            nn.init.normal_(block.mlp.up_proj.weight, std=0.02)
            nn.init.normal_(block.attn.o_proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.down_proj.weight, std=residual_std)
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        self.rope_cos, self.rope_sin = self._rope_tables(self.embed.weight.device)

    def param_roles(self) -> dict[str, str]:
        return roles_by_shape(self, embedding="embed.weight")

    def hf_mapping(self) -> tuple[dict[str, Any], dict[str, str]]:
        """This model as transformers' LlamaForCausalLM: (its config.json's architecture fields, {ppt weight name:
        Hugging Face weight name}). Both rotate the two halves of each head (not interleaved pairs), so q and k need
        no permutation; the head is tied to the embedding, so Hugging Face stores no lm_head. `config_from_hf` is
        the inverse of the config part."""
        c = self.config
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": c.vocab_size,
            "hidden_size": c.d_model,
            "intermediate_size": c.d_ff,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv_head,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.max_seq_len,
            "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope_theta,  # how transformers 4.x reads it, and 5.x:
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": True,
        }
        names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        for i in range(c.n_layer):
            ours, theirs = f"blocks.{i}", f"model.layers.{i}"
            names[f"{ours}.attn_norm.weight"] = f"{theirs}.input_layernorm.weight"
            names[f"{ours}.mlp_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names[f"{ours}.attn.{proj}.weight"] = f"{theirs}.self_attn.{proj}.weight"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[f"{ours}.mlp.{proj}.weight"] = f"{theirs}.mlp.{proj}.weight"
        return config, names

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_pos: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        T = check_sequence_length(idx, self.config.max_seq_len)
        mask = document_mask(doc_pos)  # built once per batch, shared by every layer
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return head_logits_or_loss(self.norm(x), self.embed.weight, targets, reduction)  # tied head


def check_sequence_length(idx: torch.Tensor, max_seq_len: int) -> int:
    T = idx.shape[1]
    if T > max_seq_len:
        raise PPTError(f"sequence length {T} exceeds the model's max_seq_len {max_seq_len}; feed shorter sequences")
    return T


def head_logits_or_loss(
    x: torch.Tensor, head: torch.Tensor, targets: torch.Tensor | None, reduction: str
) -> torch.Tensor:
    """The logits F.linear(x, head) without targets, else their loss as language_model_loss defines it. A training
    loss (mean, gradients on) takes its gradient in the forward (ppt/kernels/cross_entropy.py): the backward then
    makes no pass over the (B, T, V) logits."""
    if targets is None:
        return F.linear(x, head)
    if reduction == "mean" and torch.is_grad_enabled():
        return linear_cross_entropy(x, head, targets)
    return language_model_loss(F.linear(x, head), targets, reduction)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Next-token NLL in fp32; target -1 is ignored. "mean" over kept targets, or "none" per token (0 where ignored)."""
    if reduction not in ("mean", "none"):
        raise PPTError(f"reduction {reduction!r} is not supported; use 'mean' or 'none'")
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
    return nll.view(targets.shape) if reduction == "none" else nll


# ---------------------------------------------------------------------------------------------------------------------
# Multiscreen LM: screening instead of softmax attention. Each head accepts a key only when its similarity clears a
# learned threshold (trim-and-square), weights it by a learned causal window (softmask), and sums without
# normalizing, so a head can also retrieve nothing. Layers = heads = psi, width psi^2 (stored padded to
# a multiple of 32); no FFN.


@dataclass
class MultiscreenConfig:
    psi: int
    vocab_size: int = 49152
    max_seq_len: int = 4096  # the longest row the model accepts
    d_key: int = 16
    d_value: int = 64
    window_threshold: float = 256.0  # MiPE rotates only heads with windows below it
    # The training row length, filled in by the training loop (SPEC.md): at eval a head whose window exceeds it sees
    # the whole prefix. None (configs built outside training, checkpoints from before the field): max_seq_len.
    train_seq_len: int | None = None

    @property
    def n_layer(self) -> int:
        return self.psi

    @property
    def n_head(self) -> int:
        return self.psi

    @property
    def d_model(self) -> int:
        return self.psi**2

    @property
    def d_stream(self) -> int:
        """The residual stream's stored width: d_model and zero columns up to a multiple of 32. cuBLAS runs a matmul
        whose width is no multiple of 8 bf16 elements in slow unaligned kernels (every odd psi), and one with a ragged
        edge on its 32/64-wide tiles in slower ones: on one H100, Psi 6 to 22 trained 1.01-1.42x as fast at a multiple
        of 32 as at a multiple of 8, itself 1.4-1.9x unpadded (docs/benchmarks.md). The zero columns meet
        zero-padded weights, so they stay zero and the model computes what it would at d_model."""
        return -(-self.d_model // 32) * 32


def mipe(z: torch.Tensor, window: torch.Tensor, positions: torch.Tensor, window_threshold: float) -> torch.Tensor:
    """Minimal positional encoding: rotate coordinates (0, 1) of each head by phi = pi * pos * gamma(w) / w.

    z (B, T, H, d), window (H,), positions (B, T). gamma(w) = (cos(pi w / w_th) + 1) / 2 fades the rotation out as
    the window grows, reaching 0 at w_th (clamping w there keeps it 0 beyond, and finite for w = inf).
    """
    w = window.float()
    gamma = 0.5 * (torch.cos(math.pi * w.clamp(max=window_threshold) / window_threshold) + 1)
    phi = math.pi * positions.float().unsqueeze(-1) * (gamma / w)  # (B, T, H)
    cos, sin = phi.cos(), phi.sin()
    z0, z1 = z[..., 0].float(), z[..., 1].float()
    rotated = torch.stack((z0 * cos - z1 * sin, z0 * sin + z1 * cos), dim=-1).to(z.dtype)
    return torch.cat((rotated, z[..., 2:]), dim=-1)


def unit_rows(z: torch.Tensor) -> torch.Tensor:
    """Normalize the last dim in fp32 but keep z's dtype: autocast would otherwise hand the kernel fp32 operands."""
    return F.normalize(z.float(), dim=-1).to(z.dtype)


def pad_to(weight: torch.Tensor, width: int, dim: int = -1) -> torch.Tensor:
    """`weight` with zeros appended along `dim` up to `width` (ppt.flops counts its matmuls at the unpadded size)."""
    dim %= weight.dim()
    if weight.shape[dim] == width:  # an aligned psi: no copy
        return weight
    return F.pad(weight, (0, 0) * (weight.dim() - 1 - dim) + (0, width - weight.shape[dim]))


def project_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (B, T, d_stream) through per-head weights (H, out, d_model) -> (B, T, H, out), as one matmul."""
    H, out, _ = weight.shape
    return F.linear(x, pad_to(weight, x.shape[-1]).reshape(H * out, x.shape[-1])).unflatten(-1, (H, out))


class MultiscreenBlock(nn.Module):
    def __init__(self, config: MultiscreenConfig) -> None:
        super().__init__()
        self.config = config
        H, d, dK, dV = config.n_head, config.d_model, config.d_key, config.d_value
        # Per-head weight stacks: Muon/Aurora orthogonalize each head's matrix on its own.
        self.w_q = nn.Parameter(torch.empty(H, dK, d))
        self.w_k = nn.Parameter(torch.empty(H, dK, d))
        self.w_v = nn.Parameter(torch.empty(H, dV, d))
        self.w_g = nn.Parameter(torch.empty(H, dV, d))
        self.w_o = nn.Parameter(torch.empty(H, d, dV))
        self.s_w = nn.Parameter(torch.empty(H))  # window w = e^{s_w} + 1
        self.s_r = nn.Parameter(torch.empty(H))  # acceptance width r = sigmoid(s_r)
        self.s_o = nn.Parameter(torch.empty(H))  # output scale e^{s_o}

    @torch.no_grad()
    def init_weights(self) -> None:
        cfg = self.config
        # q, k and v are normalized after projection, so these scales only set how far an optimizer step turns them.
        nn.init.normal_(self.w_q, std=0.1 / math.sqrt(cfg.d_key))
        nn.init.normal_(self.w_k, std=0.1 / math.sqrt(cfg.d_key))
        nn.init.normal_(self.w_v, std=0.1 / math.sqrt(cfg.d_value))
        nn.init.normal_(self.w_g, std=0.1)
        nn.init.normal_(self.w_o, std=0.1 / math.sqrt(cfg.d_model))
        self.s_w.copy_(torch.linspace(0, math.log(cfg.window_threshold), cfg.n_head))  # windows from 2 to w_th + 1
        self.s_r.zero_()
        self.s_o.fill_(-0.5 * math.log(cfg.n_head * cfg.n_layer))  # the sum over heads and layers starts at unit scale

    def window(self) -> torch.Tensor:
        """Per-head window, fp32 (H,). At eval a window longer than the training length becomes the full prefix."""
        w = self.s_w.float().exp() + 1
        if self.training:
            return w
        trained_on = self.config.train_seq_len or self.config.max_seq_len
        return torch.where(w > trained_on, torch.full_like(w, math.inf), w)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        window = self.window()
        rho = 1 + torch.exp(-self.s_r.float())  # 1 / r with r = sigmoid(s_r): the trim multiplier
        q, k, v = (unit_rows(project_heads(x, w)) for w in (self.w_q, self.w_k, self.w_v))
        q, k = (mipe(z, window, positions, self.config.window_threshold) for z in (q, k))
        h = screening(q, k, v, window, rho, meta)  # (B, T, H, dV): sum of alpha * m * v
        # the per-head output scale e^{s_o} multiplies the small per-head w_o rather than the (B, T, H, dV)
        # activations: the same product, and its gradient is a reduction over w_o, not over every token
        w_o = pad_to(self.w_o * self.s_o.exp()[:, None, None], x.shape[-1], dim=1)
        # y = sum over heads of (tanh_norm(h) * tanh(silu(x W_g))) @ w_o^T; compiled on CUDA, one op whose forward
        # never writes the gated product (ppt/kernels/gated_output.py)
        y = gated_output(h, project_heads(x, self.w_g), w_o)
        # The residual stream takes the branch's dtype, as in the vanilla decoder: bf16 under autocast (the public
        # script's bf16 weights keep it in bf16 too), half the bytes of fp32 in its adds and gradient sums.
        return x.to(y.dtype) + y


class MultiscreenLM(nn.Module):
    def __init__(self, config: MultiscreenConfig) -> None:
        super().__init__()
        if {config.d_key, config.d_value} - set(KERNEL_HEAD_DIMS):
            raise PPTError(
                f"d_key {config.d_key} / d_value {config.d_value}: the screening kernel tiles head dims of "
                f"{', '.join(map(str, KERNEL_HEAD_DIMS))}; pick those"
            )
        self.config = config
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.blocks = nn.ModuleList(MultiscreenBlock(config) for _ in range(config.n_layer))
        self.s_e = nn.Parameter(torch.empty(()))  # embedding scale e^{s_e}
        self.s_f = nn.Parameter(torch.empty(()))  # logit scale e^{s_f}

    @torch.no_grad()
    def init_weights(self) -> None:
        # Rows of norm about 1, not the paper's 0.1: the forward normalizes rows, so only the optimizer sees the scale
        # (a row of norm 0.1 turns ~10x further per Adam step). On one H200, multiscreen-d16 ended 0.018 bpb lower
        # with norm 1 (3 seeds, 95% interval [0.004, 0.032]; docs/benchmarks.md, "the embedding's initial scale").
        nn.init.normal_(self.embed, std=1 / math.sqrt(self.config.d_model))
        for block in self.blocks:
            block.init_weights()
        self.s_e.zero_()
        self.s_f.fill_(0.5 * math.log(self.config.d_model))

    def param_roles(self) -> dict[str, str]:
        return roles_by_shape(self, embedding="embed")

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_pos: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        B, T = idx.shape
        check_sequence_length(idx, self.config.max_seq_len)
        if doc_pos is None:
            doc_pos = torch.arange(T, device=idx.device, dtype=torch.int32).expand(B, T)
        meta = screening_metadata(doc_pos)  # built once, shared by every layer
        embed = pad_to(F.normalize(self.embed, dim=-1), self.config.d_stream)
        x = F.embedding(idx, embed) * self.s_e.exp()
        for block in self.blocks:
            x = block(x, doc_pos, meta)  # MiPE positions count from each document's start
        # the logit scale e^{s_f} multiplies x (B, T, d), not the logits (B, T, V): the same product, and neither the
        # forward nor the backward spends a pass over the logits on it
        return head_logits_or_loss(x.float() * self.s_f.exp(), embed, targets, reduction)  # fp32, as the decoder's


# ---------------------------------------------------------------------------------------------------------------------
# Configs and the builder


CONFIGS: dict[str, LlamaConfig | MultiscreenConfig] = {
    "smollm-135m": LlamaConfig(n_layer=30, n_head=9, n_kv_head=3, d_model=576, d_ff=1536),
    "smollm-360m": LlamaConfig(n_layer=32, n_head=15, n_kv_head=5, d_model=960, d_ff=2560),
    "tiny": LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, d_model=128, d_ff=384, vocab_size=4096, max_seq_len=256),
    "multiscreen-tiny": MultiscreenConfig(psi=6, vocab_size=4096, max_seq_len=256),
}
DEFAULT_CONFIG = "smollm-360m"
# The model class of each config class (ppt/contract.py): a new architecture adds its entry here.
MODELS = {LlamaConfig: Llama, MultiscreenConfig: MultiscreenLM}
# The formulas of the custom ops this file calls, handed to the FLOPs trace: cost for MFU and the cost table, pairs for
# the comparison rule (docs/flops.md). A custom op missing from cost stops the trace with the line to add here.
OP_FORMULAS = OpFormulas(
    cost=cross_entropy_op.COST_FORMULAS | gated_output_op.COST_FORMULAS | screening_op.COST_FORMULAS,
    pairs=screening_op.PAIR_FORMULAS,
)


def depth_config(depth: int) -> LlamaConfig:
    """The vanilla size dial: width 64*depth, 64-dim heads, full multi-head attention (n_kv_head = n_head)."""
    if not 1 <= depth <= 64:  # d64: 13.1B parameters, 210 GB of fp32 weights and AdamW state, more than a GPU holds
        raise PPTError(f"depth {depth} is outside the dial's 1 to 64; choose a depth in it")
    d_model = 64 * depth
    d_ff = 64 * math.ceil(8 * d_model / 3 / 64)  # SwiGLU's 8/3 expansion, rounded up to a multiple of 64
    return LlamaConfig(n_layer=depth, n_head=depth, n_kv_head=depth, d_model=d_model, d_ff=d_ff)


def get_config(name: str | None = None, depth: int | None = None) -> LlamaConfig | MultiscreenConfig:
    """A named config from CONFIGS, a size dial by name, or the depth dial; neither gives DEFAULT_CONFIG.

    The dials by name: `d<N>` is the vanilla decoder at depth N (what `depth=N` gives, and how base_train names those
    runs), `multiscreen-d<N>` Multiscreen at Psi = N (N layers of N heads, width N^2, as the paper sizes it)."""
    if name is not None and depth is not None:
        raise PPTError("give either a config name or a depth, not both")
    if depth is not None:
        return depth_config(depth)
    name = name or DEFAULT_CONFIG
    if name in CONFIGS:
        return replace(CONFIGS[name])  # a copy: callers may edit it without touching CONFIGS
    dial = re.fullmatch(r"(multiscreen-)?d([1-9][0-9]*)", name)
    if dial is None:
        raise PPTError(
            f"unknown config {name!r}; valid names: {', '.join(CONFIGS)}, d<N> (the vanilla decoder at depth N) "
            "or multiscreen-d<N> (Multiscreen at Psi = N), N >= 1"
        )
    return MultiscreenConfig(psi=int(dial[2])) if dial[1] else depth_config(int(dial[2]))


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face LlamaForCausalLM config.json (missing fields take transformers' defaults).

    Refuses, by name, whatever this file's Llama would compute differently: biases, another activation, rope scaling,
    an untied head, a head size other than hidden_size / num_attention_heads.
    """
    if hf.get("model_type") != "llama":
        raise PPTError(
            f"config.json has model_type {hf.get('model_type')!r}; ppt/model.py imports only Hugging Face Llama models "
            "(model_type 'llama', e.g. SmolLM/SmolLM2): add a config_from_hf branch for another architecture"
        )
    try:
        d_model, n_head, n_layer = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
        d_ff, vocab_size = hf["intermediate_size"], hf["vocab_size"]
    except KeyError as exc:
        raise PPTError(f"config.json lacks {exc.args[0]!r}, which every LlamaForCausalLM config has") from exc
    rope = hf.get("rope_parameters") or {}  # transformers 5.x; 4.x has rope_theta and rope_scaling at the top
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    head_dim, their_head_dim = d_model // n_head, hf.get("head_dim") or d_model // n_head
    unsupported = {
        "attention biases (attention_bias)": hf.get("attention_bias", False),
        "MLP biases (mlp_bias)": hf.get("mlp_bias", False),
        f"activation {hf.get('hidden_act')!r} (ppt's SwiGLU uses silu)": hf.get("hidden_act", "silu") != "silu",
        "an untied output head (tie_word_embeddings false)": not hf.get("tie_word_embeddings", False),
        f"rope scaling {rope_type!r} (ppt's rope is the default one)": rope_type != "default",
        f"head_dim {their_head_dim} (ppt's is hidden_size / num_attention_heads = {head_dim})": their_head_dim
        != head_dim,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise PPTError(
            f"this Llama has {'; '.join(found)}, which ppt/model.py's Llama does not compute; "
            "import a model without it, or extend Llama and config_from_hf"
        )
    return LlamaConfig(
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        d_model=d_model,
        d_ff=d_ff,
        vocab_size=vocab_size,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def build_model(config: LlamaConfig | MultiscreenConfig) -> nn.Module:
    """The module MODELS names for a config; under `with torch.device("meta")` nothing is allocated."""
    return build(MODELS, config)
