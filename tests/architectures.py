"""The architectures of ppt/model.py as tests find them: through SPEC.md's contract alone (CONFIGS, get_config,
build_model), so tests that use them run on whatever a fork's model.py holds, tests/third_arch.py's included
(conftest.py adds it to model.py for the test run). And `reach_errors`: a model's token mixers' declared reach against
the positions its forward uses."""

from __future__ import annotations

import third_arch
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

import ppt.model
from ppt.flops import declare_token_mixer


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


class MixerCalls(TorchFunctionMode):
    """What a forward on real data shows of its token mixers: per module, the longest reach that those it calls
    declare (ppt.flops.declare_token_mixer, or a custom op's pair formula), and the arguments of its first call."""

    def __init__(self, model: nn.Module, pairs: dict) -> None:
        super().__init__()
        self.model, self.pairs, self.stack = model, pairs, []
        self.first_call: dict[nn.Module, tuple] = {}
        self.reach: dict[nn.Module, float] = {}

    def enter(self, module, args, kwargs):
        self.stack.append(module)
        self.first_call.setdefault(module, (args, kwargs))

    def leave(self, *_):  # returns None: a forward hook's return value would replace the module's output
        self.stack.pop()

    def __enter__(self):
        self.hooks = [
            hook
            for module in self.model.modules()
            for hook in (module.register_forward_pre_hook(self.enter, with_kwargs=True),
                         module.register_forward_hook(self.leave, always_call=True))
        ]  # fmt: skip
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = self.pairs.get(func) or self.pairs.get(getattr(func, "overloadpacket", None))
        heads = args[0] if func is declare_token_mixer else formula(*args, **kwargs) if formula else []
        if heads:
            module = self.stack[-1]
            self.reach[module] = max(self.reach.get(module, 0), *(float(reach) for _, reach in heads))
        return func(*args, **kwargs)


def changed_at(inputs: object, position: int, rows: tuple[int, int], vocab_size: int, g: torch.Generator) -> object:
    """`inputs` with every (B, T, ...) tensor changed at one position: noise for activations, the next token for token
    ids (int64); anything else (int32 document positions, masks) unchanged."""

    def change(x: object) -> object:
        if not isinstance(x, torch.Tensor) or x.shape[:2] != rows:
            return x
        if x.is_floating_point():
            new = torch.randn(x[:, position].shape, generator=g)
        elif x.dtype == torch.long:
            new = (x[:, position] + 1) % vocab_size
        else:
            return x
        x = x.clone()
        x[:, position] = new
        return x

    return tree_map(change, inputs)


def by_position(module: nn.Module, inputs: tuple, rows: tuple[int, int]) -> torch.Tensor:
    """The module's (B, T, ...) outputs for `inputs` (args, kwargs), as one (B, T, n) tensor."""
    outputs = [t for t in tree_leaves(module(*inputs[0], **inputs[1])) if isinstance(t, torch.Tensor)]
    return torch.cat([t.reshape(*rows, -1).float() for t in outputs if t.shape[:2] == rows], dim=-1)


@torch.no_grad()
def reach_errors(model: nn.Module, pairs: dict, seq_len: int = 32) -> list[str]:
    """For each module whose token mixers declare a reach below `seq_len`, one line if its forward uses more: run again
    on its first call's inputs changed at one position j at a time, the furthest later position i whose output
    changes needs a reach of i - j + 1 (a lower bound: a key the mixer ignores for these values does not show). Reach 1
    over the whole row passes: a recurrence's, whose cost per query does not grow with it (docs/flops.md). The output
    mixes the module's heads, so its longest declared reach is what is checked. In eval mode: dropout would move
    every output."""
    rows, g = (2, seq_len), torch.Generator().manual_seed(5)
    calls = MixerCalls(model.eval(), pairs)
    with calls:
        model(torch.randint(0, model.config.vocab_size, rows, generator=g))
    names = {module: name or "the model" for name, module in model.named_modules()}
    errors = []
    for module, declared in calls.reach.items():
        if declared >= seq_len:
            continue
        inputs = calls.first_call[module]
        base, needed, query, key = by_position(module, inputs, rows), 1, 0, 0
        for j in range(seq_len):
            changed = by_position(module, changed_at(inputs, j, rows, model.config.vocab_size, g), rows) != base
            moved = changed.any(-1).any(0).nonzero()  # positions whose output changed, in any row
            latest = int(moved.max()) if len(moved) else j
            if latest - j + 1 > needed:
                needed, query, key = latest - j + 1, latest, j
        if needed > declared and not (declared == 1 and needed == seq_len):
            errors.append(
                f"{names[module]} declares a reach of {declared:g} but its output at position {query} changes with "
                f"its input at position {key}: declare a reach of at least {needed}"
            )
    return errors
