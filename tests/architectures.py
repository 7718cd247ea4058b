"""The architectures of ppt/model.py as tests find them: through SPEC.md's contract alone (CONFIGS, get_config,
build_model), so tests that use them run on whatever a fork's model.py holds, tests/third_arch.py's included
(conftest.py adds it to model.py for the test run)."""

from __future__ import annotations

import third_arch
import torch

import ppt.model


def smallest_config_per_class() -> list[str]:
    """The name of the config with the fewest parameters (built on meta) of each config class in CONFIGS."""
    smallest: dict[type, tuple[int, str]] = {}
    for name, config in ppt.model.CONFIGS.items():
        with torch.device("meta"):
            size = sum(p.numel() for p in ppt.model.build_model(config).parameters())
        smallest[type(config)] = min(smallest.get(type(config), (size, name)), (size, name))
    return sorted(name for _, name in smallest.values())


def with_hf_mapping() -> list[str]:
    """Those of smallest_config_per_class() whose model has the optional hf_mapping() (Hugging Face export/import)."""
    found = []
    for name in smallest_config_per_class():
        with torch.device("meta"):
            found += [name] if hasattr(ppt.model.build_model(ppt.model.get_config(name)), "hf_mapping") else []
    return found


def fresh(name: str, seed: int = 0) -> torch.nn.Module:
    """Built on meta, materialized on the CPU and initialized, as base_train builds a model."""
    with torch.device("meta"):
        model = ppt.model.build_model(ppt.model.get_config(name))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def of_model_py() -> str:
    """The first of smallest_config_per_class() that model.py itself defines (not tests/third_arch.py): for runs in
    child processes, which conftest.py's registration does not reach, and for a second architecture beside it."""
    return next(name for name in smallest_config_per_class() if name not in third_arch.CONFIGS)
