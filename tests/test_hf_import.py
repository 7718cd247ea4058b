"""Importing Hugging Face folders (ppt/model_io.py), on a folder exported from each architecture of ppt/model.py that
has hf_mapping() and config_from_hf() (found, not named; skipped where none has): it loads with the exported logits,
a folder with missing, unexpected, misshapen or unreadable weights gets one clear error, and base_eval and the lm-eval
adapter score it with the code that scores ppt runs. (Folders saved by transformers itself, and the configs
config_from_hf refuses, are the shipped Llama's: tests/test_model.py.)"""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from architectures import with_hf_mapping

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import ppt.model  # noqa: E402
from ppt.common import PPTError  # noqa: E402
from ppt.model_io import ModelFile, context_prefix, load_run, load_tokenizer_for  # noqa: E402
from ppt.shards import load_data_tokenizer  # noqa: E402
from scripts.export_hf import export_model  # noqa: E402

MODEL_FILE = ModelFile.of(ppt.model)
IMPORTABLE = with_hf_mapping() if MODEL_FILE.config_from_hf else []
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason="no architecture of ppt/model.py imports Hugging Face folders")


@pytest.fixture(scope="module", params=IMPORTABLE)
def hf_folder(request, demo_data_dir, tmp_path_factory):
    """A random model of the architecture (48 positions, random norm gains too) over the demo data's vocabulary,
    exported with that tokenizer; read-only."""
    tokenizer = load_data_tokenizer(demo_data_dir)
    config = dataclasses.replace(ppt.model.get_config(request.param), vocab_size=tokenizer.vocab_size, max_seq_len=48)
    model = ppt.model.build_model(config)
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():  # gains start at 1: random ones test their mapping too
            torch.nn.init.normal_(param, std=0.3 if param.ndim == 1 else 0.05)
    saved = {"class": type(config).__name__, **dataclasses.asdict(config)}
    directory = export_model(model.state_dict(), saved, tokenizer, tmp_path_factory.mktemp("hf") / request.param)
    return directory, model.eval()


def edited(hf_folder, tmp_path, weights=None):
    """A copy of the folder, with other weights if given."""
    directory = shutil.copytree(hf_folder[0], tmp_path / "edited")
    if weights is not None:
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_a_folder_loads_with_its_logits_and_tokenizer_and_reports_elsewhere(hf_folder):
    directory, reference = hf_folder
    run = load_run(hf_dir=directory, model_file=MODEL_FILE)
    model = MODEL_FILE.build_from_checkpoint(run)
    idx = torch.randint(0, reference.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx), atol=1e-5, rtol=1e-5)
    tokenizer, source = load_tokenizer_for(run)  # no data dir: the folder's own tokenizer
    assert source == directory and tokenizer.vocab_size == reference.config.vocab_size
    assert run.tag.startswith(f"hf-{directory.name}-") and len(run.manifest_paths) == 1, "results: reports dir only"


def test_two_folders_of_one_name_keep_their_results_apart(hf_folder, tmp_path):
    other = shutil.copytree(hf_folder[0], tmp_path / hf_folder[0].name)
    paths = {load_run(hf_dir=d, model_file=MODEL_FILE).manifest_paths[0] for d in (hf_folder[0], other)}
    assert len(paths) == 2


def test_missing_unexpected_misshapen_and_unreadable_weights_are_refused(hf_folder, tmp_path):
    directory, _ = hf_folder
    weights = load_file(directory / "model.safetensors")
    name = sorted(weights)[0]
    missing = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(PPTError, match=f"it lacks {re.escape(name)}"):
        load_run(hf_dir=edited(hf_folder, tmp_path / "missing", weights=missing), model_file=MODEL_FILE)
    extra = {**weights, "lm_head.extra": torch.zeros(2)}
    with pytest.raises(PPTError, match="lm_head.extra fit nowhere"):
        load_run(hf_dir=edited(hf_folder, tmp_path / "extra", weights=extra), model_file=MODEL_FILE)
    shorter = {**weights, name: weights[name][:-1].clone()}
    with pytest.raises(PPTError, match=re.escape(f"{name} has shape {tuple(shorter[name].shape)}, but its config")):
        load_run(hf_dir=edited(hf_folder, tmp_path / "shorter", weights=shorter), model_file=MODEL_FILE)
    no_weights = edited(hf_folder, tmp_path / "bin")
    (no_weights / "model.safetensors").rename(no_weights / "pytorch_model.bin")
    with pytest.raises(PPTError, match="no model.safetensors.*safetensors only"):
        load_run(hf_dir=no_weights, model_file=MODEL_FILE)
    truncated = edited(hf_folder, tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(PPTError, match="cannot read .*incomplete or corrupt"):
        load_run(hf_dir=truncated, model_file=MODEL_FILE)
    with pytest.raises(PPTError, match="holds no config.json"):
        load_run(hf_dir=tmp_path, model_file=MODEL_FILE)
    with pytest.raises(PPTError, match="absent does not exist; pass a Hugging Face model folder"):
        load_run(hf_dir=tmp_path / "absent", model_file=MODEL_FILE)
    with pytest.raises(PPTError, match="names the model on its own"):
        load_run(model_tag="a-run", hf_dir=directory, model_file=MODEL_FILE)


def test_base_eval_and_the_lm_eval_adapter_score_an_imported_folder(hf_folder, demo_data_dir, capsys):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from ppt.data import DataLoader
    from ppt.evals import PPTLM
    from ppt.loss_eval import evaluate_bpb
    from scripts import base_eval
    from scripts.lm_eval import CheckpointLM

    directory, _ = hf_folder
    before = sorted(p.name for p in directory.iterdir())
    base_eval.main(
        ["--hf-dir", str(directory), "--data-dir", str(demo_data_dir), "--eval-tokens", "500", "--skip-tasks"]
    )
    shown = capsys.readouterr().out
    assert "Hugging Face folder" in shown and "up to 500 val tokens (--eval-tokens)" in shown
    run = load_run(hf_dir=directory, model_file=MODEL_FILE)
    model, tokenizer = MODEL_FILE.build_from_checkpoint(run), load_data_tokenizer(demo_data_dir)
    expected = evaluate_bpb(model, DataLoader(demo_data_dir, "val", 8, 48).val_batches(500), tokenizer.token_bytes())
    assert expected["tokens"] == 480  # 10 rows of the model's 48 positions
    assert f"| val bits per byte ↓ (480 tokens) | {expected['bpb']:.4f} |" in shown
    report = json.loads(run.manifest_paths[0].read_text())
    assert report["eval"]["val"] == expected and report["eval"]["checkpoint"] == str(directory)
    assert sorted(p.name for p in directory.iterdir()) == before, "nothing is written into the folder"

    requests = [Instance("loglikelihood", {}, ("The module", " is imported once"), 0)]
    adapter = CheckpointLM(hf_dir=str(directory), dtype="fp32", device="cpu")  # `--model ppt --model_args hf_dir=`
    expected = PPTLM(model, tokenizer, prefix=context_prefix(run, tokenizer)).loglikelihood(requests)
    assert adapter.loglikelihood(requests) == expected


def test_an_imported_folder_is_scored_with_its_own_tokenizers_convention_as_hflm_scores_it(hf_folder):
    """The adapter scores a folder with the BOS its tokenizer adds (an export's: EOT), giving lm-eval's own HFLM's
    loglikelihoods on it; an empty context is conditioned on the BOS, as HFLM's is. (A tokenizer that adds no BOS,
    SmolLM2's kind: tests/test_model.py.)"""
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from scripts.lm_eval import CheckpointLM

    directory, _ = hf_folder
    pairs = [("The module", " is imported once"), ("", "Once upon a time"), ("A generator yields; " * 9, " values")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = CheckpointLM(hf_dir=str(directory), dtype="fp32", device="cpu").loglikelihood(requests)
    theirs = HFLM(pretrained=str(directory), device="cpu", dtype="float32", batch_size=2).loglikelihood(requests)
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
    assert [g for _, g in ours] == [g for _, g in theirs]


def test_a_folder_without_its_tokenizer_has_no_convention_to_score_benchmarks_by(hf_folder, demo_data_dir, tmp_path):
    bare = edited(hf_folder, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    run = load_run(hf_dir=bare, model_file=MODEL_FILE)
    tokenizer, _ = load_tokenizer_for(run, demo_data_dir)  # bits per byte: the data's tokenizer
    with pytest.raises(PPTError, match="holds no tokenizer transformers can load .*add its tokenizer files"):
        context_prefix(run, tokenizer)


def test_a_folder_needs_data_made_by_its_tokenizer(hf_folder, demo_data_dir, tmp_path):
    from ppt.tokenizer import train_demo_tokenizer
    from scripts import base_eval

    directory, _ = hf_folder
    with pytest.raises(PPTError, match="--hf-dir needs --data-dir"):
        base_eval.main(["--hf-dir", str(directory)])
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    train_demo_tokenizer(["another corpus, another tokenizer"] * 20, vocab_size=300).save(other)
    with pytest.raises(PPTError, match="comes with tokenizer .*data prepared by the model's tokenizer"):
        load_tokenizer_for(load_run(hf_dir=other, model_file=MODEL_FILE), demo_data_dir)
    # that tokenizer on its own: another vocabulary than the model's, refused rather than scored
    with pytest.raises(PPTError, match=r"other's tokenizer has \d+ tokens, the model 512 \(vocab_size\): they are not"):
        load_tokenizer_for(load_run(hf_dir=other, model_file=MODEL_FILE))


def test_check_hf_import_compares_logits_and_scores_the_help_topics(hf_folder, run_tool):
    directory, _ = hf_folder
    argv = ["--hf-dir", str(directory), "--seq-len", "48", "--eval-tokens", "480"]
    code, shown, err = run_tool("bench.check_hf_import", *argv, "--max-bpb", "100")  # a random model: logits agree
    assert code == 0, err
    assert "logits of 2 rows x 48 tokens: max |ppt - transformers| =" in shown and "over 480 tokens" in shown
    assert "check passed" in shown
    code, _, err = run_tool("bench.check_hf_import", *argv, "--max-bpb", "0.5")
    assert code == 2 and re.fullmatch(r"error: check failed: bpb .* is not below --max-bpb 0.5", err.splitlines()[-1])
