"""The model contract of SPEC.md, for every architecture in ppt/model.py, and the import rule that protects it."""

import ast
import dataclasses
import json
import subprocess
import sys
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
    assert all(isinstance(value, (int, float, str, bool, type(None))) for value in fields.values()), fields
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


def _imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative, inside ppt/: `from . import model`, `from .model import X`
            base = f"ppt.{base}" if base else "ppt"
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def test_fixed_modules_never_import_the_model():
    """Measurement code takes the model object; only a command-line `main()` may build one by name."""
    checked = 0
    for module in FIXED_MODULES:
        path = PACKAGE / f"{module}.py"
        if not path.exists():
            continue
        checked += 1
        tree = ast.parse(path.read_text(), filename=str(path))
        cli_imports = {
            id(node)
            for fn in tree.body
            if isinstance(fn, ast.FunctionDef) and fn.name == "main"
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if id(node) in cli_imports:
                continue
            names = _imported_names(node)
            assert not any(name == "ppt.model" or name.startswith("ppt.model.") for name in names), (
                f"ppt/{module}.py imports ppt.model outside its CLI main(); fixed modules receive the model object"
            )
    assert checked >= 2  # common and optim at least


def test_importing_fixed_modules_loads_no_model():
    code = (
        "import sys, importlib\n"
        f"for m in {FIXED_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module('ppt.' + m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != 'ppt.' + m: raise\n"
        "assert 'ppt.model' not in sys.modules, 'a fixed module imported ppt.model'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
