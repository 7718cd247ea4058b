"""A run's record: the manifest holds what relaunches it, seeds mean one thing each, --recipe and --target-flops
resolve as documented, and wandb continues one run across a resume and base_eval."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from architectures import of_model_py
from records import write_manifest

from ppt import checkpoint as ckpt
from ppt.common import PPTError
from ppt.comparison_flops import ComparisonFlops
from ppt.data import DataLoader
from ppt.run import REPO_ROOT, RunRecord, model_source, plot_losses
from scripts import base_eval, base_train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def run_argv(data: Path, out: Path, *extra: str, config: str = "gpt2-tiny", steps: int = 4) -> list[str]:
    return [
        "--config", config, "--data-dir", str(data), "--out-dir", str(out), "--tag", out.name, "--seq-len", "32",
        "--total-batch-tokens", "128", "--device-batch-size", "2", "--target-tokens", str(steps * 128),
        "--eval-every", "2", "--eval-tokens", "64", "--save-every", "0", "--compile", "off", "--device", "cpu", *extra,
    ]  # fmt: skip


def manifest(out: Path) -> dict:
    return json.loads((out / f"{out.name}.json").read_text())


def trajectory(out: Path) -> list[tuple]:
    return [(h["step"], h["loss"], h["comparison_flops"]) for h in manifest(out)["history"] if "loss" in h]


def test_the_manifest_records_the_run_and_relaunches_it(demo_data_dir, tmp_path, capsys):
    first = tmp_path / "first"
    argv = run_argv(demo_data_dir, first, "--weight-decay", "0.05", "--no-doc-masks")
    base_train.main(argv)
    log = capsys.readouterr().out
    data = manifest(first)
    assert data["argv"] == argv and data["command"].startswith("python -m scripts.base_train --config gpt2-tiny")
    recorded = data["train"]
    assert recorded["weight_decay"] == 0.05 and recorded["grad_clip"] == 1.0 and recorded["decay_frac"] == 0.2
    assert recorded["doc_masks"] is False and recorded["deterministic"] is False
    assert (recorded["seed"], recorded["data_seed"], recorded["model_seed"]) == (0, 0, 0)
    assert (recorded["warmup_steps"], recorded["steps"], recorded["schedule"]) == (0, 4, "wsd")
    assert {tuple(g["betas"]) for g in recorded["optimizer_groups"]} == {(0.9, 0.95)}
    assert len(data["tokenizer"]["fingerprint"]) == len(data["data"]["fingerprint"]) == 64
    assert [e["step"] for e in data["evals"]] == [2, 4] and data["evals"][-1] == data["final_val"]
    for entry in data["evals"]:
        assert {"val_nll", "val_bpb", "tokens", "comparison_flops", "wall_time_s", "eval_tokens"} <= set(entry)
        assert entry["tokens"] == 128 * entry["step"] and entry["eval_tokens"] == 64
    assert 0 < data["evals"][0]["wall_time_s"] < data["final_val"]["wall_time_s"] and "finished" in data
    assert data["model_source"] == model_source()  # with the source itself unless git vouches for it
    steps = [h for h in data["history"] if "loss" in h]
    assert all(h["grad_norm"] > 0 and h["max_rss_gb"] > 0 and "comparison_flops" in h for h in steps)
    assert "step      2/4 (50.0%) | loss " in log and "| grad " in log and "| mem " in log and "elapsed, eta" in log

    again = tmp_path / "again"
    base_train.main(["--from-manifest", str(first / "first.json"), "--tag", "again", "--out-dir", str(again)])
    assert trajectory(again) == trajectory(first)  # CPU: bit for bit
    changed = {k: (v, manifest(again)["args"][k]) for k, v in data["args"].items() if manifest(again)["args"][k] != v}
    assert changed == {"tag": ("first", "again"), "out_dir": (str(first), str(again))}

    overridden = base_train.parse_args(["--from-manifest", str(first / "first.json"), "--lr", "1e-2"])
    assert (overridden.lr, overridden.weight_decay, overridden.no_doc_masks) == (1e-2, 0.05, True)
    with pytest.raises(PPTError, match=r"cannot relaunch from .*nothing\.json"):
        base_train.parse_args(["--from-manifest", str(tmp_path / "nothing.json")])


def test_the_mor_recipe_sets_its_published_configuration_and_flags_override_it():
    args = base_train.parse_args(["--recipe", "mor"])
    assert (args.config, args.seq_len, args.total_batch_tokens) == ("smollm-360m", 2048, 2_097_152)
    assert (args.optimizer, args.lr, args.weight_decay, args.grad_clip) == ("adamw", 3e-3, 0.1, 1.0)
    assert (args.schedule, args.decay_frac, args.no_doc_masks) == ("wsd", 0.2, True)
    assert round(args.warmup_tokens / args.total_batch_tokens) == 57
    assert args.target_tokens == 19.8e9 and int(args.target_tokens) // args.total_batch_tokens == 9441
    args = base_train.parse_args(["--recipe", "mor", "--lr", "1e-3", "--doc-masks", "--config", "smollm-135m"])
    assert (args.lr, args.no_doc_masks, args.config, args.seq_len) == (1e-3, False, "smollm-135m", 2048)
    args = base_train.parse_args(["--recipe", "mor", "--target-flops", "4e19"])
    assert (args.target_flops, args.target_tokens) == (4e19, None)


def recording(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """Record the training batches base_train reads and the weights right after initialization."""
    batches, inits = [], []
    real_next, real_build = DataLoader.__next__, base_train.build_model

    def next_batch(self):
        batch = real_next(self)
        if self.split == "train":
            batches.append(batch[0].clone())
        return batch

    def build(config):
        model = real_build(config)
        init = model.init_weights

        def init_and_record():
            init()
            inits.append([p.detach().clone() for p in model.parameters()])

        model.init_weights = init_and_record
        return model

    monkeypatch.setattr(DataLoader, "__next__", next_batch)
    monkeypatch.setattr(base_train, "build_model", build)
    return batches, inits


def test_one_data_seed_gives_every_architecture_the_same_tokens_and_the_model_seed_only_the_weights(
    demo_data_dir, tmp_path, monkeypatch
):
    batches, inits = recording(monkeypatch)
    runs = {}
    for name, config, seeds in [
        ("gpt2", "gpt2-tiny", ["--data-seed", "7", "--model-seed", "1"]),
        ("other", of_model_py(), ["--data-seed", "7", "--model-seed", "1"]),
        ("gpt2-init2", "gpt2-tiny", ["--seed", "1", "--data-seed", "7", "--model-seed", "2"]),
        ("gpt2-data8", "gpt2-tiny", ["--data-seed", "8", "--model-seed", "1"]),
    ]:
        batches.clear()
        base_train.main(
            run_argv(demo_data_dir, tmp_path / name, *seeds, "--loader-prefetch", "0", config=config, steps=2)
        )
        runs[name] = (torch.cat(batches), inits[-1])
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    assert torch.equal(runs["gpt2"][0], runs["other"][0])  # another architecture, the same token stream
    assert torch.equal(runs["gpt2"][0], runs["gpt2-init2"][0]) and not same(runs["gpt2"][1], runs["gpt2-init2"][1])
    assert not torch.equal(runs["gpt2"][0], runs["gpt2-data8"][0]) and same(runs["gpt2"][1], runs["gpt2-data8"][1])
    seeds = manifest(tmp_path / "gpt2-init2")["train"]
    assert (seeds["seed"], seeds["data_seed"], seeds["model_seed"]) == (1, 7, 2)


def test_a_flops_budget_becomes_a_token_budget_at_the_start(demo_data_dir, tmp_path):
    out = tmp_path / "budget"
    with pytest.raises(PPTError, match="--target-tokens or as --target-flops, not both"):
        base_train.main(run_argv(demo_data_dir, out, "--target-flops", "1e9"))
    argv = [a for a in run_argv(demo_data_dir, out) if a not in ("--target-tokens", str(4 * 128))]
    base_train.main([*argv, "--target-flops", "3.3e9", "--data-seed", "4"])
    data = manifest(out)
    budget = data["train"]["budget"]
    rule = ComparisonFlops.from_state_dict(data["comparison_flops_rule"])
    loader = DataLoader(demo_data_dir, "train", 2, 32, seed=4, prefetch=0)
    doc_pos = torch.cat([next(loader)[2] for _ in range(2)]).numpy()  # the first step: 2 micro-batches
    assert budget["comparison_flops_per_token_estimate"] == rule.per_token(np.bincount(doc_pos.ravel(), minlength=32))
    assert budget["target_tokens"] == int(3.3e9 / budget["comparison_flops_per_token_estimate"])
    assert data["train"]["steps"] == budget["target_tokens"] // 128 == data["steps_done"]
    assert abs(data["comparison_flops"] - 3.3e9) < rule.per_token() * 128 * 1.1  # within about a step of the budget


class FakeWandb(types.ModuleType):
    """Stands in for wandb (no network): hands out run ids and records what each run was given, and at which step; a
    resumed run starts after the last step it holds, as wandb's does."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[str, dict]] = []
        self.steps: dict[str, list[int]] = {}

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run_id = kwargs.get("id") or f"run{len(self.inits)}"
        steps = self.steps.setdefault(run_id, [])

        def log(data: dict, step: int | None = None) -> None:
            self.logged.append((run_id, data))
            steps.extend([] if step is None else [step])

        return types.SimpleNamespace(id=run_id, log=log, finish=lambda: None, step=0,
                                     starting_step=max(steps, default=-1) + 1)  # fmt: skip


def test_wandb_continues_one_run_across_a_resume_and_an_evaluation(demo_data_dir, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "tracked"
    base_train.main([*run_argv(demo_data_dir, out, "--run", "tracked"), "--max-steps", "3", "--save-every", "2"])
    assert fake.inits[0]["id"] is None and fake.inits[0]["resume"] == "allow"
    assert manifest(out)["wandb"] == {"project": "ppt", "name": "tracked", "id": "run1"}
    ckpt.checkpoint_path(out, 3).unlink()  # killed after logging step 3, past its checkpoint at 2
    before_resume = len(fake.steps["run1"])
    base_train.main([*run_argv(demo_data_dir, out, "--run", "tracked"), "--resume", "auto"])
    assert fake.inits[1]["id"] == "run1" and {run_id for run_id, _ in fake.logged} == {"run1"}
    steps = fake.steps["run1"]  # the resumed run trains step 3 again but sends only what wandb lacks: step 4 on
    assert sorted(set(steps)) == [1, 2, 3, 4] and set(steps[before_resume:]) == {4}
    keys = set().union(*(data for _, data in fake.logged))
    assert {"loss", "grad_norm", "max_rss_gb", "tokens", "comparison_flops", "val_nll", "val_bpb"} <= keys

    fake.logged.clear()
    base_eval.main(["--checkpoint", str(ckpt.latest_checkpoint(out)), "--data-dir", str(demo_data_dir), "--skip-tasks",
                    "--device", "cpu", "--eval-tokens", "64", "--compile", "off"])  # fmt: skip
    [(run_id, scores)] = fake.logged
    assert fake.inits[-1]["id"] == run_id == "run1" and scores["eval/step"] == 4 and "eval/val_bpb" in scores
    fake.logged.clear()
    base_eval.main(["--checkpoint", str(ckpt.latest_checkpoint(out)), "--data-dir", str(demo_data_dir), "--skip-tasks",
                    "--device", "cpu", "--eval-tokens", "64", "--compile", "off", "--no-wandb"])  # fmt: skip
    assert not fake.logged


def test_benchmark_scores_go_to_wandb_with_the_val_scores(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    evaluation = {
        "step": 9, "tokens": 900, "val": {"nll": 2.5, "bpb": 1.1},
        "benchmarks": {"rows": {"HellaSwag": 37.8, "PIQA": 65.6}, "avg": 51.7},
    }  # fmt: skip
    record = types.SimpleNamespace(wandb={"id": "abc", "project": "ppt"})
    assert base_eval.log_to_wandb(record, evaluation) == "abc"
    expected = {"eval/val_nll": 2.5, "eval/val_bpb": 1.1, "eval/HellaSwag": 37.8, "eval/PIQA": 65.6, "eval/avg": 51.7}
    assert fake.logged == [("abc", {**expected, "eval/step": 9, "eval/tokens": 900})]
    assert base_eval.log_to_wandb(None, evaluation) is None and len(fake.inits) == 1


def test_the_record_round_trips_and_a_format_1_manifest_converts(tmp_path):
    path = write_manifest(tmp_path, "r", 1.25, data_seed=3, model_seed=4)
    record = RunRecord.load(path)
    assert record.final_val.val_bpb == 1.25 and record.seeds == (3, 4) and record.train.seq_len == 256
    record.write([tmp_path / "a" / "r.json"])
    assert RunRecord.load(tmp_path / "a" / "r.json") == record
    assert plot_losses(record, tmp_path / "curve.png") is None  # no training losses in this record: nothing to draw

    old = {k: v for k, v in record.to_dict().items() if k not in ("format", "out_dir")}  # as written before formats
    old |= {"args": {"out_dir": "/runs/r"}, "relaunch": "python -m ...", "wall_time_includes": "a note"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    converted = RunRecord.load(tmp_path / "old.json")
    assert converted.out_dir == "/runs/r" and converted.evals == record.evals and converted.train == record.train

    (tmp_path / "future.json").write_text(json.dumps({**record.to_dict(), "format": 99}))
    with pytest.raises(PPTError, match=r"future\.json: run record format 99, not 2"):
        RunRecord.load(tmp_path / "future.json")
    (tmp_path / "cut.json").write_text(json.dumps({k: v for k, v in record.to_dict().items() if k != "params"}))
    with pytest.raises(PPTError, match="not a complete format-2 run record"):
        RunRecord.load(tmp_path / "cut.json")


def test_the_record_keeps_the_model_source_git_cannot_vouch_for_and_it_rebuilds_the_same_files(tmp_path):
    """A fork's normal state, an uncommitted model.py: its record holds the text of model.py and the kernels, and
    that text alone, written out, is the same source (sha256). A tree whose model files are the commit's keeps the
    hash alone, whatever else is dirty; one without git keeps the text."""
    tree = tmp_path / "fork"
    shutil.copytree(REPO_ROOT / "ppt", tree / "ppt", ignore=shutil.ignore_patterns("__pycache__"))
    no_git = model_source(tree)
    assert set(no_git["source"]) == set(no_git["files"]) and "ppt/model.py" in no_git["files"]
    git = ["git", "-c", "user.name=ppt", "-c", "user.email=ppt@localhost"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "the template"]):
        subprocess.run(git + command, cwd=tree, check=True, capture_output=True)
    (tree / "ppt" / "optim.py").write_text("# a fixed module edited: not the model's source\n")
    assert model_source(tree) == {k: v for k, v in no_git.items() if k != "source"}

    with (tree / "ppt" / "model.py").open("a") as f:
        f.write("\n# a fork's edit\n")
    (tree / "ppt" / "kernels" / "new_mixer.py").write_text("# a new kernel, untracked\n")
    edited = model_source(tree)
    assert edited["sha256"] != no_git["sha256"] and set(edited["source"]) == set(edited["files"])
    assert edited["source"]["ppt/kernels/new_mixer.py"] == "# a new kernel, untracked\n"

    record = RunRecord.load(write_manifest(tmp_path, "fork-run", 1.0, model_source=edited))  # through JSON
    rebuilt = tmp_path / "rebuilt"
    for name, text in record.model_source["source"].items():
        (rebuilt / name).parent.mkdir(parents=True, exist_ok=True)
        (rebuilt / name).write_bytes(text.encode())
    assert model_source(rebuilt)["sha256"] == edited["sha256"]
