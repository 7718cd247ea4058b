"""What each shipped architecture of ppt/model.py computes: parity with Hugging Face Llama, the sizes of the named
configs, Multiscreen against the paper's equations. The contract every architecture meets (causality, document
isolation, roles, init, reductions, ...) is tests/test_contract.py's."""

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from architectures import reach_errors
from test_comparison_flops import brute_force, matmul_params, random_doc_pos, run_argv, step_rows

import ppt.model
from ppt import checkpoint as ckpt
from ppt.common import PPTError
from ppt.comparison_flops import ComparisonFlops, comparison_flops_rule
from ppt.flops import Cost, cost
from ppt.model import CONFIGS, OP_FORMULAS, LlamaConfig, MultiscreenConfig, build_model, get_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def fresh(name: str, seed: int = 0) -> torch.nn.Module:
    model = build_model(get_config(name))
    torch.manual_seed(seed)
    model.init_weights()
    return model


def widely_connected(name: str) -> torch.nn.Module:
    """A fresh Multiscreen model whose every token visibly depends on its past. Screening at init (r = 1/2) trims
    nearly every key of a random 16-dim query; r near 1 accepts about half, so masks, not the trim, shape the output."""
    model = fresh(name)
    with torch.no_grad():
        for block in model.blocks:
            block.s_r.fill_(4.0)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Vanilla Llama


def test_initial_loss_is_near_uniform():
    model = fresh("tiny")
    idx = torch.randint(0, 4096, (4, 64))
    targets = torch.randint(0, 4096, (4, 64))
    assert abs(model(idx, targets).item() - math.log(4096)) < 0.1


@pytest.fixture(scope="module")
def hf_llama(demo_data_dir, tmp_path_factory):
    """A random LlamaForCausalLM (GQA, rope theta 500, 48 positions, eps 1e-6, random norm gains) over the demo data's
    vocabulary, saved by transformers with that tokenizer; read-only."""
    transformers = pytest.importorskip("transformers")
    from ppt.shards import load_data_tokenizer

    tokenizer = load_data_tokenizer(demo_data_dir)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48, rope_theta=500.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for param in model.parameters():  # transformers inits norm gains at 1: random gains test their mapping too
        torch.nn.init.normal_(param, std=0.3 if param.ndim == 1 else 0.05)
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(directory)
    tokenizer.save(directory)
    # SmolLM2's kind of tokenizer_config: a GPT-2 tokenizer whose BOS and EOS are <|endoftext|>, adding neither
    special = {key: "<|endoftext|>" for key in ("bos_token", "eos_token", "unk_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **special}))
    return directory, model


def test_a_transformers_llama_imports_with_its_config_and_logits_and_exports_back(hf_llama, tmp_path):
    """The Llama's hf_mapping() and config_from_hf against transformers itself, both ways."""
    from transformers import AutoModelForCausalLM

    from ppt.model_io import ModelFile, load_run, load_tokenizer_for
    from scripts.export_hf import export_model

    directory, reference = hf_llama
    model_file = ModelFile.of(ppt.model)
    run = load_run(hf_dir=directory, model_file=model_file)
    vocab_size = reference.config.vocab_size
    expected = LlamaConfig(2, 4, 2, 64, 96, vocab_size=vocab_size, max_seq_len=48, rope_theta=500.0, rms_eps=1e-6)
    assert run.config == {"class": "LlamaConfig", **dataclasses.asdict(expected)}
    idx = torch.randint(0, vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            model_file.build_from_checkpoint(run)(idx), reference(idx).logits, atol=1e-5, rtol=1e-5
        )
        exported = export_model(run.state["model"], run.config, load_tokenizer_for(run)[0], tmp_path / "export")
        again = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
        assert type(again).__name__ == "LlamaForCausalLM" and again.config.tie_word_embeddings
        torch.testing.assert_close(again(idx).logits, reference(idx).logits, atol=1e-5, rtol=1e-5)


def test_a_tied_head_the_file_also_stores_is_accepted_as_transformers_loads_it(hf_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from ppt.model_io import ModelFile, load_run

    weights = load_file(hf_llama[0] / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]

    def with_head(name: str, head: torch.Tensor) -> Path:
        folder = shutil.copytree(hf_llama[0], tmp_path / name)
        save_file({**weights, "lm_head.weight": head}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    run = load_run(hf_dir=with_head("tied", embedding.clone()), model_file=ModelFile.of(ppt.model))
    assert torch.equal(run.state["model"]["embed.weight"], embedding)
    with pytest.raises(PPTError, match="lm_head.weight fit nowhere in it, and equal no weight that does"):
        load_run(hf_dir=with_head("untied", embedding + 1), model_file=ModelFile.of(ppt.model))


def test_a_folder_whose_tokenizer_adds_no_bos_is_scored_as_hflm_scores_it(hf_llama):
    """SmolLM2's tokenizer puts nothing before a text: the adapter adds no EOT and gives HFLM's loglikelihoods; an empty
    context is conditioned on the BOS, as HFLM's is."""
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from scripts.lm_eval import CheckpointLM

    pairs = [("The module", " is imported once"), ("", "Once upon a time"), ("A generator yields; " * 9, " values")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    ours = CheckpointLM(hf_dir=str(hf_llama[0]), dtype="fp32", device="cpu").loglikelihood(requests)
    theirs = HFLM(pretrained=str(hf_llama[0]), device="cpu", dtype="float32", batch_size=2).loglikelihood(requests)
    assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
    assert [g for _, g in ours] == [g for _, g in theirs]


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
    ],
)
def test_configs_the_llama_cannot_compute_are_refused_by_config_from_hf(hf_llama, edits, message):
    config = {**json.loads((hf_llama[0] / "config.json").read_text()), **edits}
    with pytest.raises(PPTError, match=message):
        ppt.model.config_from_hf({key: value for key, value in config.items() if value is not None})


def test_smollm_sizes():
    with torch.device("meta"):
        model = build_model(get_config("smollm-360m"))
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    assert abs(non_embedding - 314.6e6) < 0.1e6
    with torch.device("meta"):
        model = build_model(get_config("smollm-135m"))
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6


def test_depth_dial():
    config = get_config(depth=12)
    assert (config.d_model, config.n_layer, config.n_head, config.head_dim) == (768, 12, 12, 64)
    assert config.d_ff % 64 == 0 and abs(config.d_ff - 8 * 768 / 3) < 64
    assert get_config("d12") == config  # the dial by name, as base_train names --depth 12's runs
    with pytest.raises(PPTError):
        get_config("tiny", depth=4)
    with pytest.raises(PPTError):
        get_config(depth=0)


@pytest.mark.parametrize("name", ["smollm-7b", "d0", "multiscreen-d0", "multiscreen-12", "d12x", "vanilla-d12"])
def test_unknown_config_name_lists_the_valid_ones(name):
    with pytest.raises(PPTError) as error:
        get_config(name)
    assert all(name in str(error.value) for name in [*CONFIGS, "d<N>", "multiscreen-d<N>"])


@pytest.mark.parametrize("name", ["d1", "multiscreen-d2"])
def test_a_dial_name_trains(name, demo_data_dir, tmp_path):
    """A size dial by name goes through base_train as a named config does: built on meta, one step on the CPU."""
    from ppt.model_io import load_run
    from scripts import base_train

    sizes = "--seq-len 64 --device-batch-size 2 --total-batch-tokens 128 --max-steps 1 --eval-tokens 128"
    base_train.main(["--config", name, *sizes.split(), "--device", "cpu", "--compile", "off",
                     "--data-dir", str(demo_data_dir), "--out-dir", str(tmp_path)])  # fmt: skip
    assert load_run(checkpoint=tmp_path).state["step"] == 1
    assert json.loads((tmp_path / f"{name}.json").read_text())["config_name"] == name  # named, and tagged, by it


def test_get_config_returns_a_copy():
    get_config("tiny").n_layer = 99
    assert CONFIGS["tiny"].n_layer == 4


# ---------------------------------------------------------------------------------------------------------------------
# Multiscreen


def dense_screening_block(block, x, doc_pos):
    """One Multiscreen layer written straight from the paper's equations, dense over all (query, key) pairs."""
    cfg = block.config
    T = x.shape[1]
    w = block.window()
    r = torch.sigmoid(block.s_r)
    q, k, v, g = (torch.einsum("btd,hkd->bthk", x, W) for W in (block.w_q, block.w_k, block.w_v, block.w_g))
    q, k, v = (z / z.norm(dim=-1, keepdim=True) for z in (q, k, v))
    gamma = torch.where(w < cfg.window_threshold, 0.5 * (torch.cos(math.pi * w / cfg.window_threshold) + 1), 0.0)
    phi = math.pi * doc_pos.unsqueeze(-1) * gamma / w  # (B, T, H)
    rotation = torch.polar(torch.ones_like(phi), phi)
    q, k = (
        torch.cat((torch.view_as_real(torch.complex(z[..., 0], z[..., 1]) * rotation), z[..., 2:]), -1) for z in (q, k)
    )
    s = torch.einsum("bihk,bjhk->bhij", q, k)
    alpha = torch.clamp(1 - (1 - s) / r.view(1, -1, 1, 1), min=0) ** 2
    i = torch.arange(T).view(T, 1)
    lag = (i - torch.arange(T).view(1, T)).view(1, 1, T, T).float()
    doc_start = (torch.arange(T) - doc_pos).view(-1, 1, T, 1)
    visible = (lag >= 0) & (lag < w.view(1, -1, 1, 1)) & (torch.arange(T).view(1, 1, 1, T) >= doc_start)
    softmask = torch.where(visible, 0.5 * (torch.cos(math.pi * lag / w.view(1, -1, 1, 1)) + 1), 0.0)
    h = torch.einsum("bhij,bjhv->bihv", alpha * softmask, v)
    norm = h.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # a head that retrieved nothing gives u = 0
    u = h * torch.tanh(norm) / norm
    gated = u * torch.tanh(torch.nn.functional.silu(g)) * block.s_o.exp().view(1, 1, -1, 1)
    return torch.einsum("bthv,hdv->btd", gated, block.w_o)


@pytest.mark.parametrize("training", [True, False])
def test_multiscreen_layer_matches_the_paper_equations(training):
    from ppt.kernels.screening import screening_metadata

    model = fresh("multiscreen-tiny").train(training)
    block = model.blocks[1]
    with torch.no_grad():  # spread acceptance widths across trimming and accepting regimes
        block.s_r.copy_(torch.linspace(-2, 3, block.s_r.numel()))
    doc_pos = torch.cat([torch.arange(9), torch.arange(21)]).int().unsqueeze(0).repeat(2, 1)
    x = torch.randn(2, 30, model.config.d_model)
    with torch.no_grad():
        ours = block(x, doc_pos, screening_metadata(doc_pos)) - x  # the block returns the updated residual
        reference = dense_screening_block(block, x, doc_pos)
    assert reference.abs().max() > 1e-3  # the comparison is not between two zeros
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


def test_long_windows_become_full_prefix_at_eval():
    model = fresh("multiscreen-tiny")
    block = model.blocks[0]
    trained_windows = block.window()
    assert torch.isfinite(trained_windows).all() and trained_windows.max() > model.config.max_seq_len
    eval_windows = block.eval().window()
    long = trained_windows > model.config.max_seq_len
    assert torch.isinf(eval_windows[long]).all()
    assert torch.equal(eval_windows[~long], trained_windows[~long])


def test_heads_longer_than_the_training_length_see_the_whole_prefix_after_reload(demo_data_dir, tmp_path):
    """Trained on 64-token rows of a model whose max_seq_len is 256: at eval, reloaded from the checkpoint the way
    evaluation loads it, exactly the heads whose window exceeds 64 become full-prefix; resuming sees no mismatch."""
    import ppt.model
    from ppt.model_io import ModelFile, load_run
    from scripts import base_train

    def train(*extra: str) -> None:
        sizes = "--seq-len 64 --device-batch-size 2 --total-batch-tokens 128 --target-tokens 1e6 --eval-tokens 256"
        sizes += " --device cpu --compile off"  # on a GPU machine too: a compile would take minutes
        base_train.main(["--config", "multiscreen-tiny", "--optimizer", "aurora", *sizes.split(),
                         "--data-dir", str(demo_data_dir), "--out-dir", str(tmp_path), *extra])  # fmt: skip

    train("--max-steps", "2")
    run = load_run(checkpoint=tmp_path)
    assert run.config["train_seq_len"] == 64 and run.config["max_seq_len"] == 256
    model = ModelFile.of(ppt.model).build_from_checkpoint(run)
    for block in model.blocks:
        trained = block.s_w.detach().exp() + 1
        assert ((trained > 64) & (trained <= 256)).any()  # heads that only the training length makes full-prefix
        eval_windows = block.window()
        assert torch.equal(torch.isinf(eval_windows), trained > 64)
        torch.testing.assert_close(eval_windows[trained <= 64], trained[trained <= 64])

    train("--max-steps", "3", "--resume", "auto")
    assert load_run(checkpoint=tmp_path).state["step"] == 3


def test_multiscreen_embedding_rows_start_near_unit_norm():
    model = fresh("multiscreen-tiny")
    row_norms = model.embed.norm(dim=-1)
    # 1 / sqrt(d) per entry: the H200 A/B's choice, not the paper's 0.1
    assert abs(row_norms.mean().item() - 1.0) < 0.05


@pytest.mark.parametrize("psi", [7, 24])
def test_multiscreen_sizes(psi):
    config = get_config(f"multiscreen-d{psi}")  # the dial: any Psi by name
    d = psi**2
    assert (config.n_layer, config.n_head, config.d_model, config.d_key, config.d_value) == (psi, psi, d, 16, 64)
    with torch.device("meta"):
        model = build_model(config)
    per_layer = psi * (2 * 16 * d + 3 * 64 * d) + 3 * psi
    assert sum(p.numel() for p in model.parameters()) == 49152 * d + psi * per_layer + 2


def test_multiscreen_stream_padding_changes_no_number(monkeypatch):
    """The stream's zero columns (d_model 36 stored 64 wide) give the loss and gradients of the unpadded model, and
    the same N, MFU and comparison rule: only the matmuls' layout changes."""
    model = fresh("multiscreen-tiny")
    assert (model.config.d_model, model.config.d_stream) == (36, 64)
    idx = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def computed() -> tuple:
        model.zero_grad()
        loss = model(idx, targets=idx.roll(-1, 1))
        loss.backward()
        step = cost(model, batch_size=2, seq_len=32, formulas=OP_FORMULAS)
        rule = comparison_flops_rule(model, 32, OP_FORMULAS).state_dict()
        grads = [p.grad.clone() for p in model.parameters()]
        return loss.detach(), grads, (step.params_matmul, step.flops_per_token, step.attention_flops, rule)

    padded = computed()
    monkeypatch.setattr(MultiscreenConfig, "d_stream", property(lambda config: config.d_model))
    unpadded = computed()
    torch.testing.assert_close(padded[:2], unpadded[:2], rtol=1e-6, atol=1e-7)
    assert padded[2] == unpadded[2]


# ---------------------------------------------------------------------------------------------------------------------
# Multiscreen's FLOPs as the fixed trace and comparison rule count them (tests/test_comparison_flops.py's brute force)


def test_multiscreen_counts_the_same_flops_through_the_gated_output_op_as_through_its_reference(monkeypatch):
    """On meta the trace runs gated_output's reference; one that met the op instead (its cost formula, then the torch
    ops of its backward) would count the same N, MFU, matmul FLOPs of both passes and comparison rule."""
    model = fresh("multiscreen-tiny")

    def counted() -> tuple[Cost, tuple]:
        step = cost(model, batch_size=2, seq_len=32, formulas=OP_FORMULAS)
        matmuls = {row: step.flops[row] for row in (("primal", "matmul"), ("adjoint", "matmul"))}
        rule = comparison_flops_rule(model, 32, OP_FORMULAS).state_dict()
        return step, (step.params_matmul, step.flops_per_token, step.attention_flops, matmuls, rule)

    reference, expected = counted()
    monkeypatch.setattr(ppt.model, "gated_output", lambda h, g, w: torch.ops.ppt.gated_output(h, g, w.to(h.dtype)))
    through_op, got = counted()
    assert got == expected
    booked = lambda step: {op for (_, _, _, op, _) in step.ops}
    assert "gated_output" in booked(through_op) and "gated_output" not in booked(reference)


def test_multiscreen_counts_in_window_in_document_pairs_at_the_windows_current_values():
    model = fresh("multiscreen-tiny")
    cfg = model.config
    doc_pos = random_doc_pos(2, 48, seed=2)
    counts = np.bincount(doc_pos.ravel(), minlength=48)
    windows = lambda: [w for block in model.blocks for w in block.window().tolist()]  # noqa: E731
    heads = lambda: [(2 * (cfg.d_key + cfg.d_value), w) for w in windows()]  # noqa: E731
    assert len(set(windows())) > 1 and min(windows()) < 48 < max(windows())  # windows inside and beyond the row
    rule = comparison_flops_rule(model, 48, OP_FORMULAS)
    assert rule.params_matmul == matmul_params(model)
    assert rule.step_flops(counts) == brute_force(doc_pos, matmul_params(model), heads())

    with torch.no_grad():  # training moves the windows: a new trace counts them where they are now
        for block in model.blocks:
            block.s_w.add_(torch.linspace(-0.5, 1.5, cfg.n_head))
    moved = comparison_flops_rule(model, 48, OP_FORMULAS)
    assert moved.step_flops(counts) == brute_force(doc_pos, matmul_params(model), heads())
    assert moved.step_flops(counts) != rule.step_flops(counts)
    assert rule.refreshed(model, OP_FORMULAS) == moved  # the training loop's refresh: the first trace replayed
    loaded = ComparisonFlops.from_state_dict(json.loads(json.dumps(moved.state_dict())))  # checkpoints
    assert loaded == moved and loaded.refreshed(model, OP_FORMULAS) == moved  # no trace to replay: a new one


@pytest.mark.usefixtures("one_thread")
def test_screening_declares_the_keys_its_forward_uses_at_learned_windows():
    """The pair formula's reach, ceil(w) per head, against the positions a forward uses (tests/architectures.py), at
    windows learned below the measured row of 32: it holds, and one key fewer fails in every layer."""
    model = widely_connected("multiscreen-tiny")
    with torch.no_grad():
        for block in model.blocks:
            block.s_w.copy_(torch.linspace(0.0, math.log(12), model.config.n_head))  # windows 2 to 13
    assert reach_errors(model, OP_FORMULAS.pairs) == []
    one_short = {
        op: lambda *args, f=f: [(c, reach - 1) for c, reach in f(*args)] for op, f in OP_FORMULAS.pairs.items()
    }
    errors = reach_errors(model, one_short)
    assert len(errors) == len(model.blocks) and all("declare a reach of at least 13" in e for e in errors), errors


@pytest.mark.usefixtures("one_thread")
def test_an_interrupted_multiscreen_run_counts_exactly_what_the_whole_run_counts(short_docs, tmp_path, monkeypatch):
    """The windows are learned, so the rule is refreshed on a fixed schedule (every 2 steps here): a run stopped
    between two refreshes resumes with the rule its checkpoint holds."""
    from scripts import base_train

    monkeypatch.setattr(base_train, "RULE_REFRESH_STEPS", 2)
    fast = ("--lr", "0.05")  # windows move within these few steps
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    base_train.main(run_argv(short_docs, whole, "multiscreen-tiny", *fast))
    base_train.main(run_argv(short_docs, parts, "multiscreen-tiny", *fast, "--max-steps", "3"))
    base_train.main(run_argv(short_docs, parts, "multiscreen-tiny", *fast, "--resume", "auto"))
    assert step_rows(parts) == step_rows(whole)
    increments = np.diff([0] + [flops for _, flops, _ in step_rows(whole)])
    first = json.loads((whole / "whole.json").read_text())["comparison_flops_rule"]
    assert first["traced_at_step"] == 0 and first["mixers"][0]["op"] == "screening"
    final = ckpt.load_checkpoint(ckpt.latest_checkpoint(whole))["comparison"]
    assert final["rule_step"] == 4 and final["rule"] != {k: first[k] for k in ("seq_len", "params_matmul", "mixers")}
    assert len(set(increments.tolist())) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_multiscreen_triton_path_gives_the_reference_loss_on_gpu(monkeypatch, dtype, tol):
    """The whole model, once through the Triton screening op and once through the plain-PyTorch reference."""
    import ppt.model
    from ppt.kernels.screening import screening_reference

    model = widely_connected("multiscreen-tiny").cuda()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh inputs on every run
    idx = torch.randint(1, model.config.vocab_size, (2, 257), generator=g).cuda()
    doc_pos = torch.cat([torch.arange(n) for n in (40, 150, 66)]).int().expand(2, -1).contiguous().cuda()

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(idx[:, :-1], idx[:, 1:], doc_pos)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    triton_loss, triton_grads = loss_and_grads()
    monkeypatch.setattr(ppt.model, "screening", screening_reference)
    reference_loss, reference_grads = loss_and_grads()
    torch.testing.assert_close(triton_loss, reference_loss, rtol=tol, atol=0)
    # gradients as one vector: a parameter with few elements sums many bf16 products and can cancel to near zero
    ours, ref = torch.cat([g.flatten() for g in triton_grads]), torch.cat([g.flatten() for g in reference_grads])
    assert ((ours - ref).norm() / ref.norm()).item() <= tol
