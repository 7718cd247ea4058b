"""The model contract of SPEC.md as code: what fixed code calls on an architecture, and how ppt/model.py builds one.

model.py holds a table, `MODELS = {ConfigClass: ModelClass, ...}`, and builds through `build(MODELS, config)`: a new
architecture is one entry there. The behaviour behind these names (causality, document isolation, the fp32 loss, the
token mixers' declared reach) is what tests/test_contract.py checks on every architecture in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ppt.common import PPTError


class ModelConfig(Protocol):
    """A flat dataclass of JSON-serializable fields (checkpoints store them), these two among them."""

    vocab_size: int
    max_seq_len: int


@runtime_checkable
class LanguageModel(Protocol):
    """An nn.Module with these besides (SPEC.md, the model contract)."""

    config: ModelConfig

    def init_weights(self) -> None:
        """Deterministic under torch.manual_seed; runs after to_empty, so it recomputes non-persistent buffers."""

    def param_roles(self) -> dict[str, str]:
        """Every trainable parameter's name -> "matrix", "embedding" or "scalar" (the optimizer's groups)."""

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_pos: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Logits (B, T, vocab) without targets; with them the fp32 NLL, "mean" or "none" (per token)."""


def build(models: Mapping[type, Callable[[Any], nn.Module]], config: ModelConfig) -> nn.Module:
    """The model `models` names for the config's class, checked to have the contract's members. Under
    `with torch.device("meta")` nothing is allocated (then to_empty + init_weights)."""
    name = type(config).__name__
    if type(config) not in models:
        raise PPTError(f"no model class for config class {name}: add `MODELS[{name}] = <its model>` to ppt/model.py")
    model = models[type(config)](config)
    if not isinstance(model, LanguageModel):
        missing = [member for member in ("config", "init_weights", "param_roles") if not hasattr(model, member)]
        raise PPTError(
            f"{type(model).__name__} has no {', '.join(missing)}, which the model contract asks for (SPEC.md)"
        )
    return model
