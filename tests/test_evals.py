"""The lm-eval adapter against hand-computed loglikelihoods (a bigram toy and the tests' GPT-2), through lm-eval's own
simple_evaluate on local tasks (no hub access), plus presets, task checks and the import contract."""

import ast
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import third_arch
import torch
from records import write_manifest
from torch import nn

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from ppt.common import PPTError  # noqa: E402
from ppt.evals import (  # noqa: E402
    PPTLM,
    PROTOCOLS,
    Benchmark,
    check_tasks,
    demo_examples,
    parse_tasks,
    protocol,
    run_benchmarks,
    task_manager,
    write_choice_task,
)
from ppt.tokenizer import train_demo_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEXTS = [
    f"Section {i}. The interpreter reads a line, compiles it and runs the code object; errors print a traceback "
    f"that names file {i % 7} and line {i * 3}. Modules are cached after the first import."
    for i in range(60)
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer(TEXTS, vocab_size=320)


class Bigram(nn.Module):
    """logits at t depend on idx[t] only, so any loglikelihood is a sum of table lookups, whatever the windows."""

    def __init__(self, vocab_size: int, max_seq_len: int = 24) -> None:
        super().__init__()
        self.config = third_arch.GPT2Config(vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.table = nn.Parameter(torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(0)))

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        assert idx.shape[1] <= self.config.max_seq_len
        return self.table[idx]

    def logprob(self, previous: int, token: int) -> float:
        return torch.log_softmax(self.table[previous].double(), -1)[token].item()


def requests(kind, pairs):
    return [Instance(kind, {}, args, i) for i, args in enumerate(pairs)]


# ---------------------------------------------------------------------------------------------------------------------
# The adapter on hand-made requests


def test_loglikelihood_is_the_sum_over_the_continuation_after_an_eot_prefix(tokenizer):
    model = Bigram(tokenizer.vocab_size)
    lm = PPTLM(model, tokenizer, batch_size=3)
    pairs = [("Modules are", " cached"), ("The interpreter reads", " a line, compiles"), ("", "Section 3.")]
    out = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, out):
        tokens = [tokenizer.eot_id, *tokenizer.backend.encode(context + continuation).ids]
        n_context = 1 + len(tokenizer.backend.encode(context).ids)
        expected = sum(model.logprob(tokens[i - 1], tokens[i]) for i in range(n_context, len(tokens)))
        assert logprob == pytest.approx(expected, abs=1e-5)
        argmax = [int(model.table[tokens[i - 1]].argmax()) == tokens[i] for i in range(n_context, len(tokens))]
        assert greedy == all(argmax)


def test_batching_and_padding_do_not_change_scores(tokenizer):
    model = third_arch.build(vocab_size=tokenizer.vocab_size).eval()
    pairs = [(text[:40], text[40:70]) for text in TEXTS[:7]] + [("A", " b"), ("Section", " 1")]
    one = PPTLM(model, tokenizer, batch_size=1).loglikelihood(requests("loglikelihood", pairs))
    many = PPTLM(model, tokenizer, batch_size=4).loglikelihood(requests("loglikelihood", pairs))
    assert [g for _, g in one] == [g for _, g in many]
    assert [lp for lp, _ in one] == pytest.approx([lp for lp, _ in many], abs=1e-5)


def test_long_context_is_left_truncated_and_the_continuation_kept(tokenizer):
    L = 32
    model = third_arch.build(vocab_size=tokenizer.vocab_size, max_seq_len=L).eval()
    context, continuation = " ".join(TEXTS[:3]), " Modules are cached"
    lm = PPTLM(model, tokenizer)
    ((logprob, _),) = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    tokens = [tokenizer.eot_id, *tokenizer.backend.encode(context + continuation).ids]
    n_cont = len(tokens) - 1 - len(tokenizer.backend.encode(context).ids)
    assert len(tokens) > L + 1
    window = torch.tensor([tokens[-(L + 1) :]])
    logp = torch.log_softmax(model(window[:, :-1])[0, -n_cont:].double(), -1)
    expected = logp.gather(-1, window[0, -n_cont:, None]).sum().item()
    assert logprob == pytest.approx(expected, abs=1e-4)
    with pytest.raises(PPTError, match="continuation of"):
        lm.loglikelihood(requests("loglikelihood", [("x", " ".join(TEXTS[:3]))]))


def test_rolling_loglikelihood_predicts_every_token_once_over_sliding_windows(tokenizer):
    model = Bigram(tokenizer.vocab_size, max_seq_len=16)
    texts = [" ".join(TEXTS[:4]), "Section 1."]
    lm = PPTLM(model, tokenizer, batch_size=5)
    out = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    for text, total in zip(texts, out):
        tokens = [tokenizer.eot_id, *tokenizer.backend.encode(text).ids]
        assert total == pytest.approx(sum(model.logprob(a, b) for a, b in zip(tokens, tokens[1:])), abs=1e-4)
    assert len(tokenizer.backend.encode(texts[0]).ids) > 3 * 16, "the first text must span several windows"


def test_generation_is_refused(tokenizer):
    lm = PPTLM(Bigram(tokenizer.vocab_size), tokenizer)
    with pytest.raises(PPTError, match="generation is not supported"):
        lm.generate_until(requests("generate_until", [("Hi", {"until": ["\n"]})]))


# ---------------------------------------------------------------------------------------------------------------------
# Through lm-eval on local tasks


def write_rolling_task(directory: Path, name: str, texts: list[str]) -> None:
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    config = {
        "task": name,
        "dataset_path": "json",
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(directory / "hf_cache")},
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    }
    (directory / f"{name}.yaml").write_text(json.dumps(config))


def test_demo_examples_leave_out_passages_whose_choice_does_not_fit():
    documents = [" ".join(TEXTS)]
    fits = lambda choice: "traceback" not in choice  # stands for a model's context, in tokens
    every, kept = demo_examples(documents, n=1000), demo_examples(documents, n=1000, fits=fits)
    assert 4 <= len(kept) < len(every)
    assert all(fits(choice) for example in kept for choice in example["choices"])
    with pytest.raises(PPTError, match=r"passages of 50 words whose last 10 fit the model's context, .* hold 0"):
        demo_examples(documents, fits=lambda choice: False)


def test_simple_evaluate_on_local_multiple_choice_and_rolling_tasks(tokenizer, tmp_path):
    examples = demo_examples([" ".join(TEXTS)], n=12, seed=1)
    assert {len(e["choices"]) for e in examples} == {4} and all(0 <= e["label"] < 4 for e in examples)
    write_choice_task(examples, tmp_path, "mc_local")
    write_rolling_task(tmp_path, "rolling_local", TEXTS[:3])
    manager = task_manager([tmp_path], include_defaults=False)
    model = Bigram(tokenizer.vocab_size, max_seq_len=32)  # contexts are longer: truncated, which a bigram ignores
    lm = PPTLM(model, tokenizer, batch_size=8)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["mc_local", "rolling_local"], task_manager=manager, bootstrap_iters=0, log_samples=True
    )

    def score(context, continuation):
        tokens = [tokenizer.eot_id, *tokenizer.backend.encode(context + continuation).ids]
        start = 1 + len(tokenizer.backend.encode(context).ids)
        return sum(model.logprob(tokens[i - 1], tokens[i]) for i in range(start, len(tokens)))

    correct = 0
    for sample in out["samples"]["mc_local"]:
        doc = sample["doc"]
        got = [lp for lp, _ in sample["filtered_resps"]]
        expected = [score(doc["context"], " " + choice) for choice in doc["choices"]]  # lm-eval's " " delimiter
        assert got == pytest.approx(expected, abs=1e-4)
        correct += max(range(4), key=lambda k: got[k]) == doc["label"]
    assert out["results"]["mc_local"]["acc,none"] == pytest.approx(correct / len(examples))

    total_words = sum(len(t.split()) for t in TEXTS[:3])
    total_ll = sum(sample["filtered_resps"][0] for sample in out["samples"]["rolling_local"])
    for sample in out["samples"]["rolling_local"]:
        tokens = [tokenizer.eot_id, *tokenizer.backend.encode(sample["doc"]["text"]).ids]
        expected = sum(model.logprob(a, b) for a, b in zip(tokens, tokens[1:]))
        assert sample["filtered_resps"][0] == pytest.approx(expected, abs=1e-4)
    assert out["results"]["rolling_local"]["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words))


def test_run_benchmarks_reports_rows_in_percent(tokenizer, tmp_path):
    write_choice_task(demo_examples([" ".join(TEXTS)], n=8), tmp_path, "mc_a")
    write_choice_task(demo_examples([" ".join(TEXTS)], n=8, seed=3), tmp_path, "mc_b")
    group = {"group": "mc_group", "task": ["mc_a", "mc_b"], "aggregate_metric_list": [{"metric": "acc"}]}
    (tmp_path / "mc_group.yaml").write_text(json.dumps(group))
    manager = task_manager([tmp_path], include_defaults=False)
    benchmarks = (
        Benchmark("Both", ("mc_a", "mc_b"), 0, "acc"),
        Benchmark("B few-shot", ("mc_b",), 2, "acc_norm"),
        Benchmark("Group", ("mc_group",), 1, "acc"),
    )
    check_tasks(manager, benchmarks)
    result = run_benchmarks(PPTLM(Bigram(tokenizer.vocab_size, 64), tokenizer), benchmarks, manager, bootstrap_iters=0)
    a, b = (result["tasks"][t]["metrics"]["acc"] for t in ("mc_a", "mc_b"))
    assert result["rows"]["Both"] == pytest.approx(100 * (a + b) / 2)
    assert result["tasks"]["mc_b"]["num_fewshot"] == 2 and result["tasks"]["mc_a"]["num_fewshot"] == 0
    assert result["metrics"] == {"Both": "acc", "B few-shot": "acc_norm", "Group": "acc"}
    assert 0 <= result["rows"]["Group"] <= 100 and result["tasks"]["mc_group"]["num_fewshot"] == 1
    assert result["avg"] == pytest.approx(sum(result["rows"].values()) / 3)


# ---------------------------------------------------------------------------------------------------------------------
# Presets and task checks


def test_presets_resolve_to_the_protocol_tasks_and_shots():
    def shots(name):
        return {task: b.num_fewshot for b in protocol(name) for task in b.tasks}

    assert shots("ppt") == {
        "lambada_openai": 0,
        "hellaswag": 0,
        "piqa": 0,
        "winogrande": 5,
        "arc_easy": 25,
        "arc_challenge": 25,
        "mmlu": 5,
    }
    assert shots("mor") == {**{t: 0 for t in shots("ppt")}, "mmlu": 5}
    assert [b.label for b in PROTOCOLS["ppt"]] == ["LAMBADA", "HellaSwag", "PIQA", "WinoGrande", "ARC", "MMLU"]
    assert next(b for b in PROTOCOLS["ppt"] if b.label == "ARC").tasks == ("arc_easy", "arc_challenge")
    with pytest.raises(PPTError, match="unknown protocol"):
        protocol("helm")
    # the names exist in lm-eval's own task folders and are scored by loglikelihood (index only these folders: fast)
    root = Path(lm_eval.__file__).parent / "tasks"
    folders = [root / f for f in ("lambada", "hellaswag", "piqa", "winogrande", "arc", "mmlu/default")]
    check_tasks(task_manager(folders, include_defaults=False), PROTOCOLS["ppt"])


def test_parse_tasks_and_task_errors(tmp_path):
    assert parse_tasks("hellaswag, arc_easy:25", num_fewshot=3) == (
        Benchmark("hellaswag", ("hellaswag",), 3, ""),
        Benchmark("arc_easy", ("arc_easy",), 25, ""),
    )
    with pytest.raises(PPTError, match="shot count"):
        parse_tasks("arc_easy:many")
    with pytest.raises(PPTError, match="empty"):
        parse_tasks(" , ")
    write_choice_task(demo_examples([" ".join(TEXTS)], n=4), tmp_path, "local_choice")
    config = {
        "task": "local_generate",
        "dataset_path": "json",
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{answer}}",
    }
    (tmp_path / "local_generate.yaml").write_text(json.dumps(config))
    manager = task_manager([tmp_path], include_defaults=False)
    with pytest.raises(PPTError, match="did you mean local_choice"):
        check_tasks(manager, parse_tasks("local_choise"))
    with pytest.raises(PPTError, match="generate_until"):
        check_tasks(manager, parse_tasks("local_generate"))
    with pytest.raises(PPTError, match="not a directory"):
        task_manager([tmp_path / "missing"])


# ---------------------------------------------------------------------------------------------------------------------
# Contract


def ppt_imports(module: str, seen: set[str]) -> set[str]:
    """Every ppt.* module `module` imports, transitively (read from the source, nothing executed)."""
    if module in seen:
        return seen
    seen.add(module)
    path = REPO / (module.replace(".", "/") + ".py")
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name.startswith("ppt.") and (REPO / (name.replace(".", "/") + ".py")).is_file():
                ppt_imports(name, seen)
    return seen


@pytest.mark.parametrize("module", ["ppt.evals", "ppt.loss_eval"])
def test_measurement_never_imports_the_model(module):
    assert "ppt.model" not in ppt_imports(module, set())


def test_missing_lm_eval_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` raise ImportError
    spec = importlib.util.spec_from_file_location("ppt_evals_without_lm_eval", REPO / "ppt" / "evals.py")
    with pytest.raises(PPTError, match="uv sync --extra eval"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ---------------------------------------------------------------------------------------------------------------------
# scripts: base_eval end to end, and the checkpoint model registered with lm-eval


@pytest.fixture
def trained_run(demo_data_dir, offline_private_cache):
    """A small model saved as run "tiny-run" (the way base_train saves it), with a manifest, over the demo data."""
    import dataclasses

    from ppt import checkpoint as ckpt
    from ppt.shards import load_data_tokenizer

    tokenizer = load_data_tokenizer(demo_data_dir)
    model = third_arch.build(n_layer=1, d_model=32, vocab_size=tokenizer.vocab_size, max_seq_len=64)
    directory = offline_private_cache / "checkpoints" / "tiny-run"
    payload = {
        "model": model.state_dict(),
        "config": {"class": "GPT2Config", **dataclasses.asdict(model.config)},
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "tokens": 4096,
    }
    path = ckpt.save_checkpoint(directory, 7, payload)
    for target in (offline_private_cache / "reports", directory):
        target.mkdir(parents=True, exist_ok=True)
        fields = {"data.dir": str(demo_data_dir), "train.seq_len": 32, "out_dir": str(directory)}
        write_manifest(target, "tiny-run", 5.0, **fields)
    return path, payload, model.eval(), tokenizer


def test_base_eval_demo_task_prints_the_table_and_updates_both_manifests(trained_run, offline_private_cache, capsys):
    from ppt.data import DataLoader
    from ppt.loss_eval import evaluate_bpb
    from scripts import base_eval

    path, _, model, tokenizer = trained_run
    base_eval.main(
        ["--model-tag", "tiny-run", "--eval-tokens", "1024", "--batch-size", "4", "--demo-task", "--device", "cpu"]
    )
    shown, bars = capsys.readouterr()
    assert "| val bits per byte ↓ (1,024 tokens) |" in shown and "demo continuation" in shown
    assert not any(bar in bars for bar in ("val bpb", "Tokenizing", "loglikelihood")), "no progress bars in a log"
    data_dir = json.loads((path.parent / "tiny-run.json").read_text())["data"]["dir"]
    expected = evaluate_bpb(model, DataLoader(data_dir, "val", 4, 32).val_batches(1024), tokenizer.token_bytes())
    for manifest in (offline_private_cache / "reports" / "tiny-run.json", path.parent / "tiny-run.json"):
        data = json.loads(manifest.read_text())
        assert data["train"]["seq_len"] == 32 and data["final_val"]["val_bpb"] == 5.0, "the record is kept"
        evaluation = data["eval"]
        assert evaluation["checkpoint"] == str(path) and evaluation["step"] == 7 and evaluation["seq_len"] == 32
        assert evaluation["val"] == expected  # deterministic: the same numbers as a direct call
        assert evaluation["benchmarks"]["protocol"] == "demo"
        assert 0 <= evaluation["benchmarks"]["rows"]["demo continuation (4-way)"] <= 100
        assert f"{expected['bpb']:.4f}" in shown


def test_base_eval_scores_as_many_tokens_as_the_training_run_and_says_so(trained_run, offline_private_cache, capsys):
    from scripts import base_eval

    path, _, _, _ = trained_run
    manifest = json.loads((path.parent / "tiny-run.json").read_text())
    manifest["train"]["eval_tokens"] = 320  # what base_train records: its --eval-tokens
    for target in (offline_private_cache / "reports" / "tiny-run.json", path.parent / "tiny-run.json"):
        target.write_text(json.dumps(manifest))
    base_eval.main(["--model-tag", "tiny-run", "--skip-tasks", "--batch-size", "4", "--device", "cpu"])
    shown = capsys.readouterr().out
    assert "up to 320 val tokens (the training run's --eval-tokens, from its record)" in shown
    evaluation = json.loads((path.parent / "tiny-run.json").read_text())["eval"]
    assert evaluation["eval_tokens"] == 320 and evaluation["val"]["tokens"] == 320
    assert f"| val bits per byte ↓ (320 tokens) | {evaluation['val']['bpb']:.4f} |" in shown


def test_base_eval_says_when_the_val_split_is_smaller_than_the_budget(trained_run, capsys):
    from scripts import base_eval

    path, _, _, _ = trained_run
    base_eval.main(["--model-tag", "tiny-run", "--skip-tasks", "--eval-tokens", "1e9", "--device", "cpu"])
    captured = capsys.readouterr()
    evaluation = json.loads((path.parent / "tiny-run.json").read_text())["eval"]
    scored = evaluation["val"]["tokens"]
    assert 0 < scored < 10**9 and evaluation["eval_tokens"] == 10**9
    assert "warning: a val budget of 1,000,000,000 tokens is more than the val split of" in captured.err
    assert f"in rows of 32 ({scored:,} tokens); all of them are scored" in captured.err


def test_base_eval_checks_its_tasks_before_the_bits_per_byte_pass(trained_run, tmp_path, monkeypatch):
    from ppt import evals
    from scripts import base_eval

    write_choice_task(demo_examples([" ".join(TEXTS)], n=4), tmp_path, "local_choice")
    local_only = lambda include, include_defaults=True: task_manager(include, include_defaults=False)  # no index
    monkeypatch.setattr(evals, "task_manager", local_only)
    monkeypatch.setattr(base_eval, "evaluate_bpb", lambda *a, **k: pytest.fail("bpb ran before the task check"))
    argv = ["--model-tag", "tiny-run", "--tasks", "local_choise", "--include-path", str(tmp_path), "--device", "cpu"]
    with pytest.raises(PPTError, match="unknown lm-eval task 'local_choise'; did you mean local_choice"):
        base_eval.main(argv)


def test_base_eval_rejects_bad_checkpoints_and_tokenizers(trained_run, tmp_path, demo_data_dir):
    from ppt import checkpoint as ckpt
    from scripts import base_eval

    path, payload, _, _ = trained_run
    with pytest.raises(PPTError, match="no checkpoint for tag 'missing'.*tiny-run"):
        base_eval.main(["--model-tag", "missing"])
    with pytest.raises(PPTError, match="does not exist"):
        base_eval.main(["--checkpoint", str(tmp_path / "step_00000001.pt")])
    other = ckpt.save_checkpoint(tmp_path / "other", 1, {**payload, "config": {**payload["config"], "class": "Mamba"}})
    with pytest.raises(PPTError, match="'Mamba' is not in ppt/model.py"):
        base_eval.main(["--checkpoint", str(other), "--skip-tasks"])
    wider = {**payload["config"], "d_model": 64}
    other = ckpt.save_checkpoint(tmp_path / "wider", 1, {**payload, "config": wider})
    with pytest.raises(PPTError, match="another architecture"):
        base_eval.main(["--checkpoint", str(other), "--skip-tasks"])
    other = ckpt.save_checkpoint(tmp_path / "retok", 1, {**payload, "tokenizer_fingerprint": "cd" * 32})
    with pytest.raises(PPTError, match="was trained with tokenizer cdcdcdcd"):
        base_eval.main(["--checkpoint", str(other), "--skip-tasks", "--data-dir", str(demo_data_dir)])


def test_a_run_tag_finds_the_checkpoints_where_its_record_says_they_are(trained_run, offline_private_cache, tmp_path):
    """A run trained with --out-dir elsewhere: --model-tag reads its record, not <cache>/checkpoints/<tag>."""
    from scripts import base_eval

    path, *_ = trained_run
    elsewhere = tmp_path / "mine"
    path.parent.rename(elsewhere)
    record = offline_private_cache / "reports" / "tiny-run.json"
    record.write_text(json.dumps(json.loads(record.read_text()) | {"out_dir": str(elsewhere)}))
    base_eval.main(["--model-tag", "tiny-run", "--skip-tasks", "--eval-tokens", "64", "--device", "cpu"])
    for manifest in (record, elsewhere / "tiny-run.json"):
        assert json.loads(manifest.read_text())["eval"]["checkpoint"] == str(elsewhere / path.name)
    # a checkpoint of that run named by its path: the record beside it says which run it is
    checkpoint = str(elsewhere / path.name)
    base_eval.main(["--checkpoint", checkpoint, "--skip-tasks", "--eval-tokens", "32", "--device", "cpu"])
    assert json.loads(record.read_text())["eval"]["eval_tokens"] == 32
    with pytest.raises(PPTError, match="--model-tag tiny-run and --checkpoint .* both name a model; pass one of them"):
        base_eval.main(["--model-tag", "tiny-run", "--checkpoint", str(elsewhere), "--skip-tasks"])
    (elsewhere / path.name).unlink()
    with pytest.raises(PPTError, match=r"no checkpoint for tag 'tiny-run' in .*mine, where its record .* says"):
        base_eval.main(["--model-tag", "tiny-run", "--skip-tasks"])


def test_scores_go_to_the_wandb_run_at_the_checkpoints_step(monkeypatch):
    """An offline wandb run resumed by base_eval starts again at step 0: the scores are logged at the run's step."""
    import types

    from scripts import base_eval

    logged = []

    class Run:
        step = 0  # a resumed offline run; an online one stands after the last step it logged

        def log(self, data, step=None):
            logged.append((step, data["eval/val_bpb"]))

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    record = types.SimpleNamespace(wandb={"project": "ppt", "id": "abc"})
    evaluation = {"step": 24, "tokens": 3072, "val": {"nll": 3.0, "bpb": 1.5}}
    assert base_eval.log_to_wandb(record, evaluation) == "abc" and logged == [(24, 1.5)]
    Run.step = 30
    base_eval.log_to_wandb(record, evaluation)
    assert logged[-1] == (30, 1.5), "never behind the step an online run stands at: wandb would drop it"


def test_checkpoint_model_is_registered_with_lm_eval(trained_run, tmp_path):
    from lm_eval.api.registry import get_model

    from scripts.lm_eval import CheckpointLM, parse_batch_size

    path, _, model, tokenizer = trained_run
    assert get_model("ppt") is CheckpointLM
    assert parse_batch_size("auto:4") == 16 and parse_batch_size("8") == 8
    with pytest.raises(PPTError, match="not a number"):
        parse_batch_size("big")
    write_choice_task(demo_examples([" ".join(TEXTS)], n=6), tmp_path, "mc_registered")
    out = lm_eval.simple_evaluate(
        model="ppt",
        model_args=f"checkpoint={path},dtype=fp32",
        tasks=["mc_registered"],
        device="cuda:0",
        batch_size="auto",
        bootstrap_iters=0,
        log_samples=True,
        task_manager=task_manager([tmp_path], include_defaults=False),
    )
    direct = PPTLM(model, tokenizer)
    for sample in out["samples"]["mc_registered"]:
        pairs = [(sample["doc"]["context"], " " + choice) for choice in sample["doc"]["choices"]]
        expected = [lp for lp, _ in direct.loglikelihood(requests("loglikelihood", pairs))]
        assert [lp for lp, _ in sample["filtered_resps"]] == pytest.approx(expected, abs=1e-5)


REMOTE_TASK = {  # a task over a hub data set that is not cached: offline, it cannot load
    "task": "remote_choice",
    "dataset_path": "ppt-tests/not-cached",
    "output_type": "multiple_choice",
    "test_split": "test",
    "doc_to_text": "{{q}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": 0,
}


def test_unreachable_hub_points_to_local_tasks(tokenizer, tmp_path):
    (tmp_path / "remote_choice.yaml").write_text(json.dumps(REMOTE_TASK))
    manager = task_manager([tmp_path], include_defaults=False)
    lm = PPTLM(Bigram(tokenizer.vocab_size), tokenizer)
    with pytest.raises(PPTError, match="Hugging Face hub.*--include-path"):
        run_benchmarks(lm, parse_tasks("remote_choice"), manager, bootstrap_iters=0)


def test_lm_eval_names_its_own_model_args_and_an_unreachable_hub(trained_run, tmp_path, monkeypatch):
    from scripts import lm_eval as script

    with pytest.raises(PPTError, match="no checkpoint for tag 'missing'") as refused:
        script.CheckpointLM(model_tag="missing")
    assert "pass --model_args checkpoint=PATH" in str(refused.value) and "--checkpoint" not in str(refused.value)
    with pytest.raises(PPTError, match="--model_args model_tag=TAG \\(a training run's --tag\\) or --model_args chec"):
        script.CheckpointLM()
    # a task whose data is not cached, offline: one error line pointing at local tasks, not lm-eval's traceback
    (tmp_path / "remote_choice.yaml").write_text(json.dumps(REMOTE_TASK))
    path, *_ = trained_run
    argv = ["--model", "ppt", "--model_args", f"checkpoint={path}", "--tasks", "remote_choice"]
    monkeypatch.setattr(sys, "argv", ["lm_eval", *argv, "--include_path", str(tmp_path), "--device", "cpu"])
    with pytest.raises(PPTError, match="ppt-tests/not-cached.*OfflineModeIsEnabled.*--include_path DIR"):
        script.main()
