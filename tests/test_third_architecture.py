"""The fork contract end to end: an architecture added to ppt/model.py alone (tests/third_arch.py, a GPT-2-style
decoder that conftest.py registers) trains on CPU through base_train, is scored by base_eval, is compared by
scripts.compare with a run of one of model.py's own architectures, and is refused by export_hf (it has no hf_mapping)
with one clear error. An architecture whose forward cannot run on the meta device trains too: one warning, no MFU,
and comparison FLOPs that say they count 6N alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import third_arch
from architectures import of_model_py

import ppt.model
from ppt.common import PPTError
from scripts import base_eval, base_train, export_hf
from scripts.compare import compare

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
OWN = of_model_py()  # the run it is compared with


def train(data: Path, out: Path, config: str) -> dict:
    """Four steps of 2 x 32 tokens on CPU, evaluated at the end; the manifest."""
    base_train.main([
        "--config", config, "--data-dir", str(data), "--out-dir", str(out), "--tag", out.name,
        "--seq-len", "32", "--total-batch-tokens", "64", "--device-batch-size", "2", "--target-tokens", "256",
        "--eval-every", "0", "--eval-tokens", "256", "--compile", "off", "--device", "cpu",
    ])  # fmt: skip
    return json.loads((out / f"{out.name}.json").read_text())


@pytest.fixture(scope="module")
def runs(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("third")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PPT_CACHE", str(root / "cache"))  # the function-scoped private cache is not set up yet
        for config in (OWN, "gpt2-tiny"):
            train(demo_data_dir, root / config, config)
    return {config: root / config for config in (OWN, "gpt2-tiny")}


def test_the_third_architecture_trains_is_evaluated_and_compared(runs, demo_data_dir, capsys):
    trained = json.loads((runs["gpt2-tiny"] / "gpt2-tiny.json").read_text())
    assert trained["config"]["class"] == "GPT2Config" and trained["steps_done"] == 4
    losses = [h["loss"] for h in trained["history"] if "loss" in h]
    assert losses[-1] < losses[0]
    assert trained["flops_per_token"]["mfu"] > 0 and "untraced" not in trained["comparison_flops_rule"]

    base_eval.main(["--checkpoint", str(runs["gpt2-tiny"]), "--skip-tasks", "--data-dir", str(demo_data_dir)])
    evaluated = json.loads((runs["gpt2-tiny"] / "gpt2-tiny.json").read_text())["eval"]
    assert "GPT2" in capsys.readouterr().out  # base_eval rebuilt the class model.py builds for the checkpoint
    assert evaluated["eval_tokens"] == 256 and evaluated["val"]["tokens"] == trained["final_val"]["eval_tokens"]
    assert evaluated["val"]["bpb"] == pytest.approx(trained["final_val"]["val_bpb"], rel=1e-6)

    table = compare([runs[OWN] / f"{OWN}.json", runs["gpt2-tiny"] / "gpt2-tiny.json"], baseline=OWN)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert set(rows) == {OWN, "gpt2-tiny"}
    assert f"{evaluated['val']['bpb']:.4f}" in rows["gpt2-tiny"] and "n/a (one seed)" in rows["gpt2-tiny"]
    assert " *" not in table  # both traced: their comparison FLOPs are counted by the rule


def test_export_refuses_an_architecture_without_a_hugging_face_mapping(runs, tmp_path):
    with pytest.raises(PPTError, match="no Hugging Face export or import for this architecture.*GPT2 has no hf_map"):
        export_hf.main(["--checkpoint", str(runs["gpt2-tiny"]), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


@dataclass
class ValueDependentConfig(third_arch.GPT2Config):
    pass


class ValueDependentGPT2(third_arch.GPT2):
    """A forward that reads a tensor's value, which a trace on the meta device cannot."""

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        if idx.min().item() < 0:
            raise ValueError("negative token ids")
        return super().forward(idx, targets, doc_pos, reduction)


def test_a_forward_that_cannot_run_on_meta_trains_with_one_warning_and_no_mfu(
    runs, demo_data_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(ppt.model.CONFIGS, "value-dependent", ValueDependentConfig())
    monkeypatch.setitem(ppt.model.MODELS, ValueDependentConfig, ValueDependentGPT2)
    trained = train(demo_data_dir, tmp_path / "value-dependent", "value-dependent")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("warning: comparison FLOPs count 6N alone (N = ")
    assert "tracing ValueDependentGPT2 on the meta device failed" in warnings[0]
    assert warnings[0].endswith("; no MFU either")
    assert trained["flops_per_token"] is None and not any("mfu" in h for h in trained["history"])
    rule = trained["comparison_flops_rule"]
    model = ValueDependentGPT2(ValueDependentConfig(vocab_size=trained["config"]["vocab_size"]))
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    assert rule["untraced"] and rule["params_matmul"] == matrices and rule["mixers"] == []
    assert trained["final_val"]["comparison_flops"] == 6 * matrices * trained["final_val"]["tokens"]

    table = compare([runs[OWN] / f"{OWN}.json", tmp_path / "value-dependent" / "value-dependent.json"])
    assert table.count(" *") == 1 and "* not every token mixer counted by the pairs it needs (value-dependent" in table
    assert "comparison FLOPs count 6N alone" in table and rule["warning"] in table
