"""Importing Hugging Face Llama folders: a random LlamaForCausalLM saved by transformers loads into ppt's model with
transformers' logits in fp32, folders ppt cannot represent get one clear error, and base_eval and the lm-eval
adapter score an imported folder with the code that scores ppt runs."""

import dataclasses
import json
import re
import shutil

import pytest
import torch

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import ppt.model  # noqa: E402
from ppt.common import PPTError  # noqa: E402
from ppt.model import LlamaConfig  # noqa: E402
from ppt.model_io import ModelFile, context_prefix, load_run, load_tokenizer_for  # noqa: E402
from ppt.shards import load_data_tokenizer  # noqa: E402

MODEL_FILE = ModelFile.of(ppt.model)
# a tokenizer_config.json of SmolLM2's kind: a GPT-2 tokenizer whose BOS and EOS are <|endoftext|>, adding neither
GPT2_KIND = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
SMOLLM2_TOKENIZER_CONFIG = GPT2_KIND | {key: "<|endoftext|>" for key in ("bos_token", "eos_token", "unk_token")}


@pytest.fixture(scope="module")
def hf_folder(demo_data_dir, tmp_path_factory):
    """A random LlamaForCausalLM (GQA, rope theta 500, 48 positions, eps 1e-6) over the demo data's vocabulary,
    saved by transformers with that tokenizer; read-only."""
    tokenizer = load_data_tokenizer(demo_data_dir)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for param in model.parameters():  # transformers inits norm gains at 1: random gains test their mapping too
        torch.nn.init.normal_(param, std=0.3 if param.ndim == 1 else 0.05)
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(directory)
    tokenizer.save(directory)  # SmolLM2's kind of tokenizer: it puts no BOS before a text
    (directory / "tokenizer_config.json").write_text(json.dumps(SMOLLM2_TOKENIZER_CONFIG))
    return directory, model


def edited(hf_folder, tmp_path, config_edits=None, weights=None):
    """A copy of the folder with config.json fields changed (None deletes) and/or other weights."""
    source, _ = hf_folder
    directory = tmp_path / "edited"
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    for key, value in (config_edits or {}).items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (directory / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_a_transformers_llama_loads_with_its_config_and_logits(hf_folder):
    directory, reference = hf_folder
    run = load_run(hf_dir=directory, model_file=MODEL_FILE)
    vocab_size = reference.config.vocab_size
    expected = LlamaConfig(2, 4, 2, 64, 96, vocab_size=vocab_size, max_seq_len=48, rope_theta=500.0, rms_eps=1e-6)
    assert run.config == {"class": "LlamaConfig", **dataclasses.asdict(expected)}
    model = MODEL_FILE.build_from_checkpoint(run)
    idx = torch.randint(0, expected.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx).logits, atol=1e-5, rtol=1e-5)
    tokenizer, source = load_tokenizer_for(run)  # no data dir: the folder's own tokenizer
    assert source == directory and tokenizer.vocab_size == expected.vocab_size
    assert re.fullmatch("hf-tiny-llama-[0-9a-f]{8}", run.tag) and len(run.manifest_paths) == 1, "reports dir only"


def test_two_folders_of_one_name_keep_their_results_apart(hf_folder, tmp_path):
    directory, _ = hf_folder
    other = tmp_path / directory.name
    shutil.copytree(directory, other)
    paths = {load_run(hf_dir=d, model_file=MODEL_FILE).manifest_paths[0] for d in (directory, other)}
    assert len(paths) == 2


@pytest.mark.parametrize(
    "edits, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'.*only Hugging Face Llama"),
        ({"attention_bias": True}, "attention biases"),
        ({"mlp_bias": True}, "MLP biases"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"tie_word_embeddings": None}, "untied output head"),  # transformers' default is untied
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}}, "rope scaling 'llama3'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
        ({"head_dim": 32}, "head_dim 32 .*= 16"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"intermediate_size": 128}, "mlp.gate_proj.weight has shape \\(96, 64\\).*makes it \\(128, 64\\)"),
    ],
)
def test_configs_ppt_cannot_represent_are_refused(hf_folder, tmp_path, edits, message):
    with pytest.raises(PPTError, match=message):
        load_run(hf_dir=edited(hf_folder, tmp_path, config_edits=edits), model_file=MODEL_FILE)


def test_missing_unexpected_and_unreadable_weights_are_refused(hf_folder, tmp_path):
    directory, _ = hf_folder
    weights = load_file(directory / "model.safetensors")
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(PPTError, match="it lacks model.layers.1.mlp.up_proj.weight"):
        load_run(hf_dir=edited(hf_folder, tmp_path / "missing", weights=missing), model_file=MODEL_FILE)
    # a tied head the file also stores, as transformers loads it: accepted when it equals the embedding
    tied_copy = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    run = load_run(hf_dir=edited(hf_folder, tmp_path / "tied", weights=tied_copy), model_file=MODEL_FILE)
    assert torch.equal(run.state["model"]["embed.weight"], weights["model.embed_tokens.weight"])
    untied = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"] + 1}
    with pytest.raises(PPTError, match="lm_head.weight fit nowhere in it, and equal no weight that does"):
        load_run(hf_dir=edited(hf_folder, tmp_path / "untied", weights=untied), model_file=MODEL_FILE)
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
        load_run(model_tag="tiny", hf_dir=directory, model_file=MODEL_FILE)


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
    assert adapter.loglikelihood(requests) == PPTLM(model, tokenizer, prefix=[]).loglikelihood(requests)


def test_an_imported_folder_is_scored_with_its_own_tokenizers_convention_as_hflm_scores_it(hf_folder):
    """The folder's tokenizer (SmolLM2's kind) puts no BOS before a text: the adapter adds no EOT, and gives lm-eval's
    own HFLM's loglikelihoods on the folder; an empty context is conditioned on the BOS, as HFLM's is."""
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
