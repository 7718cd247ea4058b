"""The model contract of SPEC.md, on every architecture in ppt/model.py, and the import rule that protects it.

The architectures are found, not listed: one config per config class in CONFIGS, the one with the fewest parameters
(tests/architectures.py).
An architecture added to model.py is therefore tested here without an edit to this file; tests/third_arch.py is one
(registered for the whole test run by conftest.py), and the last test checks that it is picked up.
"""

import ast
import dataclasses
import json
import math
import pkgutil
import subprocess
import sys
from inspect import signature
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from architectures import fresh, reach_errors, smallest_config_per_class
from torch import nn

import ppt.model
from ppt.common import PPTError
from ppt.comparison_flops import comparison_flops_rule
from ppt.contract import build
from ppt.flops import cost, declare_token_mixer
from ppt.model_io import LoadedRun, ModelFile
from ppt.optim import build_optimizer

PACKAGE = Path(__file__).resolve().parents[1] / "ppt"


ARCHITECTURES = smallest_config_per_class()


def other_tokens(idx: torch.Tensor, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """idx with every token replaced by a different one."""
    return (idx + torch.randint(1, vocab_size, idx.shape, generator=generator)) % vocab_size


@torch.no_grad()
def changed_by(after: torch.Tensor, before: torch.Tensor) -> str:
    """How far logits moved, for a leak's message: bit-exact isolation is the rule, and a change of ~1e-7 says the
    mixer's arithmetic crosses the boundary (a cumsum over the whole row, say) rather than its math."""
    return f"largest change {float((after - before).abs().max()):.3g}"


def logits(model: torch.nn.Module, idx: torch.Tensor, doc_pos: torch.Tensor | None = None) -> torch.Tensor:
    return model(idx, doc_pos=doc_pos)


# ---- configs ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ppt.model.CONFIGS))
def test_every_config_is_a_flat_json_dataclass_that_builds_on_meta(name):
    config = ppt.model.get_config(name)
    assert dataclasses.is_dataclass(config)
    fields = dataclasses.asdict(config)
    assert {"vocab_size", "max_seq_len"} <= fields.keys()
    assert all(isinstance(value, (int, float, str, bool, type(None))) for value in fields.values()), fields
    assert type(config)(**json.loads(json.dumps(fields))) == config
    with torch.device("meta"):
        model = ppt.model.build_model(config)
    assert model.config == config
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_checkpoint_reloads_through_the_config_class_in_configs(name):
    """What base_eval, lm_eval and export do with a checkpoint: the class named in it is found among CONFIGS'."""
    model = fresh(name)
    saved = {"class": type(model.config).__name__, **json.loads(json.dumps(dataclasses.asdict(model.config)))}
    model_file = ModelFile.of(ppt.model)
    assert model_file.config_from_dict(saved) == model.config
    run = LoadedRun(Path("step_00000001.pt"), "run", {"model": model.state_dict(), "config": saved})
    reloaded = model_file.build_from_checkpoint(run)
    idx = torch.randint(0, model.config.vocab_size, (1, 8))
    torch.testing.assert_close(logits(reloaded, idx), logits(model.eval(), idx), atol=0, rtol=0)


def test_a_config_class_without_a_model_or_a_model_without_the_contracts_methods_is_one_clear_error():
    config = SimpleNamespace(vocab_size=8, max_seq_len=8)
    with pytest.raises(PPTError, match=r"config class SimpleNamespace: add `MODELS\[SimpleNamespace\] = <its model>`"):
        build({}, config)
    with pytest.raises(PPTError, match="^Linear has no config, init_weights, param_roles, which the model contract"):
        build({SimpleNamespace: lambda config: nn.Linear(1, 1)}, config)


# ---- the forward -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_forward_outputs_and_loss_reductions(name):
    model = fresh(name)
    V = model.config.vocab_size
    B, T = 2, 12
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    targets[0, :5] = -1
    doc_pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12))], dtype=torch.int32)

    out = model(idx, doc_pos=doc_pos)
    assert out.shape == (B, T, V) and out.dtype == torch.float32

    mean = model(idx, targets, doc_pos=doc_pos)
    assert mean.shape == () and mean.dtype == torch.float32

    per_token = model(idx, targets, doc_pos=doc_pos, reduction="none")
    assert per_token.shape == (B, T) and per_token.dtype == torch.float32
    assert torch.all(per_token[0, :5] == 0), "ignored targets must contribute 0"
    kept = targets != -1
    torch.testing.assert_close(mean, per_token[kept].mean())
    expected = torch.nn.functional.cross_entropy(out[kept], targets[kept])
    torch.testing.assert_close(mean, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_loss_is_fp32_under_bf16_autocast(name):
    model = fresh(name)
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(idx, idx).dtype == torch.float32
        assert model(idx, idx, reduction="none").dtype == torch.float32


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_too_long_input_is_an_error(name):
    model = fresh(name)
    idx = torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(PPTError, match="max_seq_len"):
        model(idx)


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("training", [True, False])
def test_no_information_from_the_future(name, training):
    """Changing the tokens after t leaves the logits up to t bit for bit; changing those before t changes t's."""
    model = fresh(name).train(training)
    V, T = model.config.vocab_size, 24
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (4, T), generator=g)
    base = logits(model, idx)
    for t in (0, 9, T - 2):
        changed = torch.cat([idx[:, : t + 1], other_tokens(idx[:, t + 1 :], V, g)], dim=1)
        out = logits(model, changed)[:, : t + 1]
        assert torch.equal(out, base[:, : t + 1]), (
            f"position {t} sees later tokens ({changed_by(out, base[:, : t + 1])})"
        )
    changed = torch.cat([other_tokens(idx[:, :-1], V, g), idx[:, -1:]], dim=1)
    assert not torch.equal(logits(model, changed)[:, -1], base[:, -1]), "the last position ignores its past"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_no_information_across_documents(name):
    """Rows of three documents: changing one leaves the other two's logits bit for bit, and changes its own."""
    model = fresh(name)
    V = model.config.vocab_size
    documents = [(0, 7), (7, 15), (15, 20)]
    doc_pos = torch.cat([torch.arange(end - start) for start, end in documents]).int().expand(4, -1)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, doc_pos.shape, generator=g)
    base = logits(model, idx, doc_pos)
    for start, end in documents:
        changed = idx.clone()
        changed[:, start : end - 1] = other_tokens(idx[:, start : end - 1], V, g)  # all but its last token
        out = logits(model, changed, doc_pos)
        outside = torch.ones(idx.shape[1], dtype=torch.bool)
        outside[start:end] = False
        assert torch.equal(out[:, outside], base[:, outside]), (
            f"document [{start}, {end}) leaks into another ({changed_by(out[:, outside], base[:, outside])})"
        )
        assert not torch.equal(out[:, end - 1], base[:, end - 1]), f"document [{start}, {end}) ignores its tokens"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_one_document_doc_pos_matches_plain_causal(name):
    model = fresh(name)
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    doc_pos = torch.arange(16, dtype=torch.int32).expand(2, 16)
    torch.testing.assert_close(logits(model, idx, doc_pos), logits(model, idx), atol=1e-5, rtol=1e-5)


# ---- build, init, roles, training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_meta_build_then_init_matches_a_cpu_build(name):
    with torch.device("meta"):
        meta_model = ppt.model.build_model(ppt.model.get_config(name))
    assert all(p.is_meta for p in meta_model.parameters())
    meta_model.to_empty(device="cpu")
    torch.manual_seed(3)
    meta_model.init_weights()
    reference = ppt.model.build_model(ppt.model.get_config(name))
    torch.manual_seed(3)
    reference.init_weights()
    idx = torch.randint(0, reference.config.vocab_size, (1, 12))
    torch.testing.assert_close(logits(meta_model, idx), logits(reference, idx), atol=0, rtol=0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_init_is_deterministic_under_the_seed(name):
    a, b, c = fresh(name), fresh(name), fresh(name, seed=1)
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values()))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_param_roles_cover_every_trainable_parameter_once(name):
    model = fresh(name)
    roles = model.param_roles()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(roles) == sorted(trainable)
    assert set(roles.values()) <= {"matrix", "embedding", "scalar"}
    assert "embedding" in roles.values() and "matrix" in roles.values()
    params = dict(model.named_parameters())
    assert all(params[n].ndim >= 2 for n, role in roles.items() if role == "matrix")


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("optimizer", ["adamw", "aurora"])
def test_the_fixed_optimizer_lowers_the_loss_of_a_repeated_batch(name, optimizer):
    model = fresh(name)
    step = build_optimizer(model, optimizer, lr=3e-3 if optimizer == "adamw" else 2e-2, weight_decay=0.0)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(5):
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        step.step()
        step.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_forward_runs_on_meta_so_flops_are_traced_and_its_mixers_counted_by_their_pairs(name):
    """Expected (SPEC.md): a forward that cannot be traced, whose token mixer the trace cannot see, or whose mixer the
    rule counts at its dense traced cost (every pair it computes, not the pairs it needs) trains with a warning, but
    its comparison FLOPs are wrong; the failure shows the warning, which names the declaration to add."""
    model, formulas = fresh(name), ModelFile.of(ppt.model).op_formulas
    assert cost(model, batch_size=1, seq_len=16, formulas=formulas).params_matmul > 0
    rule = comparison_flops_rule(model, 16, formulas)
    assert rule.untraced is None and rule.mixers and not rule.dense, rule.warning()


# ---- token mixers: the reach they declare against the positions a forward uses ---------------------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_token_mixers_declare_at_least_the_reach_their_forward_uses(name):
    assert reach_errors(fresh(name), ModelFile.of(ppt.model).op_formulas.pairs) == []


class Mixer(nn.Module):
    """A fork's token mixer: attention over a band of `window` keys (SDPA with a mask, which the trace cannot read,
    so it declares), or with no window a running sum over the prefix (a recurrence)."""

    def __init__(self, reach: float, window: int | None) -> None:
        super().__init__()
        self.reach, self.window = reach, window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        declare_token_mixer([(64, self.reach)])
        if self.window is None:
            return x.cumsum(1)
        lag = torch.arange(x.shape[1])[:, None] - torch.arange(x.shape[1])
        return F.scaled_dot_product_attention(x, x, x, attn_mask=(lag >= 0) & (lag < self.window))


class MixerLM(Mixer):
    """A fork's model: the mixer between a tied embedding and head, as a submodule or in the model's own forward."""

    def __init__(self, reach: float, window: int | None, inline: bool) -> None:
        super().__init__(reach, window)
        self.config = SimpleNamespace(vocab_size=64, max_seq_len=32)
        self.embed, self.mixer = nn.Embedding(64, 16), None if inline else Mixer(reach, window)

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        x = self.embed(idx)
        return F.linear(super().forward(x) if self.mixer is None else self.mixer(x), self.embed.weight)


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize(
    "reach, window, error",
    [(16, 16, None), (math.inf, 16, None), (1, None, None),  # reach 1 over the whole prefix: a recurrence
     (1, 16, "declares a reach of 1 but its output at position 15 changes with its input at position 0: declare a "
             "reach of at least 16"),
     (15, 16, "declares a reach of 15 but its output at position 15 changes with its input at position 0")],
)  # fmt: skip
def test_a_reach_shorter_than_the_forward_uses_fails_naming_the_reach_it_needs(reach, window, error, inline):
    errors = reach_errors(MixerLM(reach, window, inline), {})
    where = "the model " if inline else "mixer "  # token ids changed, or the mixer's input activations
    assert errors == [] if error is None else errors[0].startswith(where + error) and len(errors) == 1, errors


# ---- discovery -------------------------------------------------------------------------------------------------------


def test_an_architecture_added_to_model_py_runs_in_every_contract_test():
    """tests/third_arch.py, added to ppt/model.py for the test run, is found and tested like model.py's own (and so
    is any architecture a fork adds): one config of each config class, and every test that takes one runs on it."""
    classes = {type(config) for config in ppt.model.CONFIGS.values()}
    assert {type(ppt.model.CONFIGS[name]) for name in ARCHITECTURES} == classes and len(ARCHITECTURES) == len(classes)
    takes_a_name = [t for key, t in globals().items() if key.startswith("test_") and "name" in signature(t).parameters]
    assert takes_a_name and all(
        any(mark.args[0] == "name" and "gpt2-tiny" in mark.args[1] for mark in test.pytestmark) for test in takes_a_name
    )


# ---- the import rule -------------------------------------------------------------------------------------------------

FIXED_MODULES = sorted(
    p.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
    for p in PACKAGE.rglob("*.py")
    if p.name not in ("model.py", "__init__.py")
)


def imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: `from . import model`, `from .model import X`
            parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{parent}.{base}" if base else parent
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


@pytest.mark.parametrize("module", FIXED_MODULES)
def test_fixed_modules_never_import_the_model_and_kernels_import_no_ppt_module(module):
    """Not even lazily, inside a function: fixed code receives the model object (or, for loading, the model file
    from the entry point: ppt.model_io.ModelFile)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    package = module.rsplit(".", 1)[0]
    names = [name for node in ast.walk(ast.parse(path.read_text())) for name in imported_names(node, package)]
    assert not [n for n in names if n == "ppt.model" or n.startswith("ppt.model.")], f"{module} imports ppt.model"
    if module.startswith("ppt.kernels."):  # beside each other, and nothing else of ppt
        outside = [n for n in names if (n == "ppt" or n.startswith("ppt.")) and not n.startswith("ppt.kernels.")]
        assert not outside, f"{module} imports {outside}"


def test_importing_every_fixed_module_loads_no_model():
    code = (
        "import sys, importlib\n"
        f"for m in {FIXED_MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "assert 'ppt.model' not in sys.modules, 'a fixed module imported ppt.model'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
    found = {module.name for module in pkgutil.walk_packages(ppt.__path__, "ppt.") if not module.ispkg}
    assert set(FIXED_MODULES) == found - {"ppt.model"}  # every module of the package Python imports, kernels too


@pytest.mark.parametrize(
    "source, package",
    [("import ppt.model", "ppt"), ("from ppt import model", "ppt"), ("from . import model", "ppt"),
     ("def lazily():\n    from .model import Llama", "ppt"), ("from ..model import CONFIGS", "ppt.kernels")],
)  # fmt: skip
def test_the_import_rule_sees_every_form_of_importing_the_model(source, package):
    assert "ppt.model" in [name for node in ast.walk(ast.parse(source)) for name in imported_names(node, package)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_deterministic_runs_on_the_gpu_repeat_bit_for_bit(name, demo_data_dir, tmp_path):
    """--deterministic as a study uses it (compiled, bf16, CUDA): two runs of one setting log identical losses."""
    from scripts import base_train

    losses = []
    for run in ("a", "b"):
        out = tmp_path / run
        base_train.main(["--config", name, "--data-dir", str(demo_data_dir), "--seq-len", "128", "--deterministic",
                         "--total-batch-tokens", "2048", "--device-batch-size", "8", "--target-tokens", "20480",
                         "--eval-tokens", "4096", "--eval-every", "0", "--save-every", "0", "--tag", run,
                         "--out-dir", str(out)])  # fmt: skip
        history = json.loads((out / f"{run}.json").read_text())["history"]
        losses.append([h.get("loss", h.get("val_bpb")) for h in history])
    assert losses[0] == losses[1] and len(losses[0]) == 11  # 10 steps and the final evaluation
