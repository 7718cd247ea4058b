"""The model contract of SPEC.md, for every architecture in ppt/model.py, and the import rule that protects it."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ppt.model import CONFIGS, build_model, get_config

FAMILIES = ["tiny", "multiscreen-tiny"]  # one small config per architecture class
FIXED_MODULES = ["common", "tokenizer", "data", "optim", "flops", "loss_eval", "evals", "checkpoint", "report"]
PACKAGE = Path(__file__).resolve().parents[1] / "ppt"


def cpu_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(get_config(name))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_is_a_flat_json_dataclass_that_builds_on_meta(name):
    config = get_config(name)
    assert dataclasses.is_dataclass(config)
    fields = dataclasses.asdict(config)
    assert {"vocab_size", "max_seq_len"} <= fields.keys()
    assert all(isinstance(value, (int, float, str, bool)) for value in fields.values()), fields
    assert type(config)(**json.loads(json.dumps(fields))) == config
    with torch.device("meta"):
        model = build_model(config)
    assert model.config == config
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_outputs(name):
    model = cpu_model(name)
    V = model.config.vocab_size
    B, T = 2, 12
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    targets[0, :5] = -1
    doc_pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12))], dtype=torch.int32)

    logits = model(idx, doc_pos=doc_pos)
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32

    mean = model(idx, targets, doc_pos=doc_pos)
    assert mean.shape == () and mean.dtype == torch.float32

    per_token = model(idx, targets, doc_pos=doc_pos, reduction="none")
    assert per_token.shape == (B, T) and per_token.dtype == torch.float32
    assert torch.all(per_token[0, :5] == 0), "ignored targets must contribute 0"
    kept = targets != -1
    torch.testing.assert_close(mean, per_token[kept].mean())
    expected = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    torch.testing.assert_close(mean, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_param_roles_cover_every_trainable_parameter_once(name):
    model = cpu_model(name)
    roles = model.param_roles()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(roles) == sorted(trainable)
    assert set(roles.values()) <= {"matrix", "embedding", "scalar"}
    assert "embedding" in roles.values() and "matrix" in roles.values()
    params = dict(model.named_parameters())
    assert all(params[n].ndim >= 2 for n, role in roles.items() if role == "matrix")


@pytest.mark.parametrize("name", FAMILIES)
def test_init_is_deterministic_under_the_seed(name):
    a, b = cpu_model(name), cpu_model(name)
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key


def test_fixed_modules_never_import_the_model():
    checked = 0
    for module in FIXED_MODULES:
        path = PACKAGE / f"{module}.py"
        if not path.exists():
            continue
        checked += 1
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative, inside ppt/: `from . import model`, `from .model import X`
                    base = f"ppt.{base}" if base else "ppt"
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            assert not any(name == "ppt.model" or name.startswith("ppt.model.") for name in names), (
                f"ppt/{module}.py imports ppt.model; fixed modules receive the model object instead"
            )
    assert checked >= 2  # common and optim at least
