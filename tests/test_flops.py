"""The analytic cost model: counts against closed forms and FlopCounterMode, formulas of custom ops, roofline math."""

import math
from dataclasses import replace

import pytest
import third_arch
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ppt.common import PPTError
from ppt.devices import DEVICES, find_device, peak_flops
from ppt.flops import Cost, OpFormulas, cost, mfu_flops_per_token
from ppt.formatting import duration, si
from ppt.model import build_model, get_config
from ppt.roofline import utilization
from scripts.flops import main

B16 = torch.bfloat16


def matmul_flops(step: Cost) -> float:
    return sum(sum(step.flops.get((p, "matmul"), {}).values()) for p in ("primal", "adjoint"))


class TiedMLPLM(nn.Module):
    """Embedding, a two-layer MLP and a tied head: every matmul parameter is known by hand."""

    def __init__(self, vocab: int = 64, d: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        x = x + self.down(F.relu(self.up(x)))
        logits = F.linear(x, self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class HandAttentionLM(nn.Module):
    """Attention written as two bmm's (no SDPA), so the attention term must come from the matmuls themselves."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, idx, targets=None):
        q, k, v = self.qkv(self.embed(idx)).chunk(3, dim=-1)
        y = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
        return F.cross_entropy(F.linear(y, self.embed.weight).flatten(0, 1), targets.flatten())


def test_params_and_flops_per_token_of_a_gqa_decoder_match_the_closed_form():
    L, H, KV, Q, T, d, V = 2, 4, 2, 16, 128, 64, 512
    with torch.device("meta"):
        model = third_arch.GPT2(third_arch.GPT2Config(L, H, KV, d, vocab_size=V, max_seq_len=T))
    per_token = mfu_flops_per_token(model, T)
    matmul_params = L * (d * (H + 2 * KV) * Q + d * d + 8 * d * d) + V * d  # qkv, proj, MLP; the tied head once
    assert per_token["params_matmul"] == matmul_params and per_token["6n"] == 6 * matmul_params
    assert per_token["attention"] == 12 * L * H * Q * T  # the convention, exactly: every query head, KV shared or not
    assert per_token["mfu"] == 6 * matmul_params + 12 * L * H * Q * T


def test_matmul_flops_equal_flop_counter_mode_on_a_real_forward_backward():
    model = third_arch.build(n_head=4, n_kv_head=2)
    idx = torch.randint(0, model.config.vocab_size, (2, 64))
    # torch's own SDPA formulas on the CPU flash op, key/value heads broadcast to the query's as the kernel does:
    # torch 2.11's counter has no formula for that op (it counts it as zero) and its formulas reject grouped heads
    widen = lambda q, kv: (*kv[:1], q[1], *kv[2:])

    def forward(q, k, v, *_, **__):
        return flop_counter.sdpa_flop_count(q, widen(q, k), widen(q, v))

    def backward(grad, q, k, v, *_, **__):
        return flop_counter.sdpa_backward_flop_count(grad, q, widen(q, k), widen(q, v))

    aten = torch.ops.aten
    sdpa = {aten._scaled_dot_product_flash_attention_for_cpu: forward}
    sdpa[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
    counter = FlopCounterMode(display=False, custom_mapping=sdpa)
    with counter:
        model(idx, idx).backward()
    model.zero_grad(set_to_none=True)

    step = cost(model, batch_size=2, seq_len=64)
    assert matmul_flops(step) == counter.get_total_flops()
    assert counter.get_flop_counts()["Global"][aten._scaled_dot_product_flash_attention_for_cpu] > 0
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())  # the model is untouched
    assert step.params == step.params_active == sum(p.numel() for p in model.parameters())
    assert step.unclassified == {}


def test_hand_built_model_counts_params_flops_and_operand_bytes_exactly():
    model = TiedMLPLM(vocab=64, d=16, hidden=48)
    step = cost(model, batch_size=2, seq_len=8, dtype=B16)
    tokens, n = 16, 16 * 48 + 48 * 16 + 64 * 16

    assert step.params == 64 * 16 + 2 * 16 * 48 and step.params_matmul == n
    assert step.flops[("primal", "matmul")] == {B16: 2 * n * tokens}
    assert step.flops[("adjoint", "matmul")] == {B16: 4 * n * tokens}  # dX and dW of every weight
    assert step.attention_flops == 0 and step.flops_per_token == 6 * n
    # Each mm reads its operands and writes its result, in bf16: (tokens x in) @ (in x out) -> (tokens x out).
    mm_bytes = sum(2 * (tokens * i + i * o + tokens * o) for i, o in ((16, 48), (48, 16), (16, 64)))
    assert step.bytes[("primal", "matmul")] == {B16: mm_bytes}
    assert step.flops[("primal", "elementwise")] == {B16: tokens * 48, torch.float32: tokens * 16}  # relu, add
    # Autocast: fp32 weights and activations are cast to bf16 once each, the tied embedding included.
    assert step.bytes[("primal", "selection")][torch.float32] >= 4 * (16 * 48 + 48 * 16 + 64 * 16)
    assert step.bytes[("primal", "selection")][torch.int64] == tokens * 8  # the token ids the embedding reads
    assert step.intensity(("primal", "matmul"), B16) == pytest.approx(2 * n * tokens / mm_bytes)
    assert "primal matmul" in str(step) and "total" in str(step)
    fp32 = cost(model, batch_size=2, seq_len=8, dtype=torch.float32)  # no autocast: no casts, nothing in bf16
    assert fp32.flops[("primal", "matmul")] == {torch.float32: 2 * n * tokens}
    assert B16 not in fp32.dtypes("bytes") and not any(op == "_to_copy" for _, _, _, op, _ in fp32.ops)


class PaddedTiedMLPLM(TiedMLPLM):
    """TiedMLPLM with its stream stored `pad` columns wider, every weight padded with `value` at forward."""

    def __init__(self, pad: int, value: float) -> None:
        super().__init__(vocab=64, d=16, hidden=48)
        self.pad, self.value = pad, value

    def forward(self, idx, targets=None):
        embed = F.pad(self.embed.weight, (0, self.pad), value=self.value)
        up = F.pad(self.up.weight, (0, self.pad), value=self.value)
        down = F.pad(self.down.weight, (0, 0, 0, self.pad), value=self.value)
        x = F.embedding(idx, embed)
        x = x + F.linear(F.relu(F.linear(x, up)), down)
        return F.cross_entropy(F.linear(x, embed).flatten(0, 1).float(), targets.flatten())


@pytest.mark.parametrize("dtype", [B16, torch.float32])
def test_zero_padded_weights_count_their_matmuls_at_the_unpadded_size(dtype):
    """Zero columns are a layout (aligned widths), not the architecture: N and MFU stay those of the unpadded model,
    while the matmul FLOPs the step computes include the padding. Padding with anything else is counted in full."""
    tokens, n, padded_n = 16, 16 * 48 + 48 * 16 + 64 * 16, 20 * 48 + 48 * 20 + 64 * 20
    unpadded = cost(TiedMLPLM(), batch_size=2, seq_len=8, dtype=dtype)
    step = cost(PaddedTiedMLPLM(pad=4, value=0.0), batch_size=2, seq_len=8, dtype=dtype)
    assert step.params_matmul == unpadded.params_matmul == n and step.flops_per_token == 6 * n
    assert step.flops[("primal", "matmul")] == {dtype: 2 * padded_n * tokens}
    assert cost(PaddedTiedMLPLM(pad=4, value=1.0), batch_size=2, seq_len=8, dtype=dtype).params_matmul == padded_n


def test_attention_term_comes_from_activation_matmuls_not_from_names():
    model = HandAttentionLM(vocab=64, d=16)
    step = cost(model, batch_size=2, seq_len=8)
    scores_and_mix = 2 * (2 * 8 * 8 * 16)  # q @ k^T and p @ v, per row
    assert step.attention_flops == 2 * scores_and_mix
    assert step.params_matmul == 16 * 48 + 64 * 16
    assert step.flops_per_token == 6 * step.params_matmul + 3 * 2 * scores_and_mix / 16


@torch.library.custom_op("ppt_test::mystery_mix", mutates_args=())
def mystery_mix(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    return x * window.sum()


@mystery_mix.register_fake
def _(x, window):
    return torch.empty_like(x)


def _mystery_backward(ctx, grad):
    return grad * ctx.window_sum, None


def _mystery_setup(ctx, inputs, output):
    ctx.window_sum = inputs[1].sum()


mystery_mix.register_autograd(_mystery_backward, setup_context=_mystery_setup)


class CustomOpLM(nn.Module):
    """Calls a custom op with a learned per-head window, as a screening layer would."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.log_window = nn.Parameter(torch.tensor([math.log(2.0), math.log(3.0)]))

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        x = x + mystery_mix(x.detach(), self.log_window.exp() + 1)  # windows 3 and 4
        return F.cross_entropy(F.linear(x, self.embed.weight).flatten(0, 1), targets.flatten())


def test_custom_op_without_a_cost_formula_fails_with_the_line_to_add():
    line = "add `torch.ops.ppt_test.mystery_mix: its_cost` to the cost formulas of OP_FORMULAS in ppt/model.py"
    with pytest.raises(PPTError, match="ppt_test::mystery_mix has no cost formula") as failed:
        cost(CustomOpLM(), batch_size=1, seq_len=8)
    assert line in str(failed.value)


def test_custom_op_counts_through_the_formula_handed_to_it_with_learned_values():
    def formula(x, window):
        pairs = x.shape[0] * x.shape[1] * (window.sum().item() if window.device.type != "meta" else x.shape[1])
        return {"flops": 100 * pairs, "bytes": 7}

    formulas = OpFormulas(cost={torch.ops.ppt_test.mystery_mix: formula})
    real = cost(CustomOpLM(), batch_size=1, seq_len=8, dtype=torch.float32, formulas=formulas)
    head = 2 * 8 * 16 * 64
    assert real.flops[("primal", "matmul")][torch.float32] == head + 100 * 8 * 7  # windows 3 + 4, read for real
    assert real.attention_flops == 100 * 8 * 7
    assert real.flops_per_token == 6 * 16 * 64 + 3 * 100 * 7
    with torch.device("meta"):
        unknown_windows = CustomOpLM()
    assert cost(unknown_windows, 1, 8, formulas=formulas).attention_flops == 100 * 8 * 8  # no values: upper bound


def test_biases_count_as_active_parameters_under_autocast_too():
    """A bf16 trace casts a matmul's operands, a Linear's bias among them: the bias is still a parameter it reads."""

    class BiasedLM(TiedMLPLM):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(16, 48)

        def forward(self, idx, targets=None):
            x = self.embed(idx)
            x = x + self.down(F.logsigmoid(self.up(x)))
            return F.cross_entropy(F.linear(x, self.embed.weight).flatten(0, 1).float(), targets.flatten())

    model = BiasedLM()
    for dtype in (torch.float32, B16):
        step = cost(model, batch_size=1, seq_len=8, dtype=dtype)
        assert step.params_active == step.params == sum(p.numel() for p in model.parameters()), dtype
        assert step.unclassified == {}, dtype  # log_sigmoid's forward and backward are elementwise


def test_ops_without_a_class_are_counted_and_listed(capsys):
    class SpectralLM(TiedMLPLM):
        def forward(self, idx, targets=None):
            x = self.embed(idx)
            x = x + torch.fft.fft(x).real
            return F.cross_entropy(F.linear(x, self.embed.weight).flatten(0, 1), targets.flatten())

    step = cost(SpectralLM(), batch_size=1, seq_len=8)
    assert "aten._fft_r2c" in step.unclassified
    assert "aten._fft_r2c" in capsys.readouterr().err
    assert "WARNING" in str(step) and "_fft_r2c" in str(step)


def hand_made_cost() -> Cost:
    """Seed 000's transformer intensities (matmul 272, elementwise 0.3551 FLOPs/byte) and a compute-bound cell."""
    flops = {("primal", "matmul"): {B16: 272e9}, ("primal", "elementwise"): {B16: 0.3551e9}}
    nbytes = {("primal", "matmul"): {B16: 1e9}, ("primal", "elementwise"): {B16: 1e9, torch.int64: 5e6}}
    flops[("adjoint", "matmul")], nbytes[("adjoint", "matmul")] = {B16: 400e9}, {B16: 1e9}
    return Cost(1, 1, 1, 1, 1, flops, nbytes, attention_flops=0.0)


def test_utilization_without_duration_is_intensity_over_the_knee():
    result = utilization(hand_made_cost(), "h100")
    knee_matmul, knee_vector = 989e12 / 3.35e12, 67e12 / 3.35e12
    assert result.ratios[("primal", "matmul")][B16] == pytest.approx(0.9214, abs=1e-4)  # seed 000's number
    assert result.ratios[("primal", "elementwise")][B16] == pytest.approx(0.3551 / knee_vector)
    assert result.ratios[("adjoint", "matmul")][B16] == pytest.approx(400 / knee_matmul)
    assert result.total[B16] == pytest.approx((272 + 400) / knee_matmul + 0.3551 / knee_vector)  # a sum of cells
    assert torch.int64 not in result.total and "total" in str(result)


def test_utilization_with_duration_is_achieved_over_the_attainable_peak():
    result = utilization(hand_made_cost(), DEVICES["h100"], duration_sec=0.5)
    assert result.ratios[("adjoint", "matmul")][B16] == pytest.approx(400e9 / 0.5 / 989e12)  # compute-bound: MFU
    assert result.ratios[("primal", "matmul")][B16] == pytest.approx(272e9 / 0.5 / (272 * 3.35e12))  # below knee
    attainable = min(67e12, 0.3551 * 3.35e12)  # memory-bound: the bandwidth roof
    assert result.ratios[("primal", "elementwise")][B16] == pytest.approx(0.3551e9 / 0.5 / attainable)
    with pytest.raises(PPTError, match="no peak rates"):
        utilization(hand_made_cost(), "cpu")


def test_peak_flops_maps_device_names_and_knows_what_it_does_not_know():
    assert peak_flops("NVIDIA H100 80GB HBM3", B16) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", B16) == 756e12
    assert peak_flops("NVIDIA H200", B16) == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12  # TF32
    assert peak_flops("NVIDIA GeForce RTX 4090") == 165.2e12
    assert peak_flops("AMD Instinct MI300X") == 1307.4e12
    assert peak_flops(torch.device("cpu")) is None and peak_flops("Tesla T4") is None
    assert find_device("h100").knee("matmul", B16) == pytest.approx(295.2, abs=0.05)  # seed 000's knee
    assert {"h100", "h200", "a100", "b200", "rtx4090", "rtx5090", "mi300x"} <= set(DEVICES)


def test_cli_prints_tables_and_rejects_bad_input(capsys):
    main(["--config", "gpt2-tiny", "--batch-size", "2", "--seq-len", "32", "--device", "h200"])
    out = capsys.readouterr().out
    for expected in ("adjoint matmul", "FLOPs/token, MFU convention", "roofline knee", "blocks.fc_proj", "MFU <="):
        assert expected in out
    assert "over the pairs they need" in out and "NOT all" not in out and "warning" not in out
    main(["--config", "gpt2-tiny", "--batch-size", "1", "--seq-len", "16", "--device", "cpu", "--vocab-size", "300"])
    out = capsys.readouterr().out
    assert "peak rates unknown" in out
    with torch.device("meta"):  # the model traced is the config's at the tokenizer's vocabulary
        model = build_model(replace(get_config("gpt2-tiny"), vocab_size=300))
    assert f"params={sum(p.numel() for p in model.parameters())}," in out
    with pytest.raises(PPTError, match="unknown config 'no-such-config'"):
        main(["--config", "no-such-config"])


def test_cli_says_when_a_mixer_is_not_counted_by_its_pairs(capsys, monkeypatch):
    """Attention through SDPA with a mask tensor (a sliding window, say), which the trace cannot read."""
    masked = lambda q, k, v, mask: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2], device=q.device).tril().bool(), enable_gqa=True
    )
    monkeypatch.setattr(third_arch, "attention", masked)
    main(["--config", "gpt2-tiny", "--batch-size", "1", "--seq-len", "32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "NOT all over the pairs they need" in out
    assert "in blocks: ppt.flops.declare_token_mixer([(128, reach)] * 2)" in out  # 2 (d_qk + d_v), gpt2-tiny's heads


def test_manifest_summary_adds_up_to_the_table():
    model = third_arch.build()
    step = cost(model, batch_size=2, seq_len=32)
    summary = step.summary()
    assert set(summary) == {" ".join(row) for row in step.rows()}
    total_flops = sum(step.total("flops", d) for d in step.dtypes("flops"))
    assert sum(r["flops"] for r in summary.values()) * step.tokens == pytest.approx(total_flops)
    assert mfu_flops_per_token(model, 32)["per_token"].keys() == summary.keys()


def test_numbers_print_with_si_suffixes_and_durations_in_two_units():
    assert [si(x) for x in (0, 999, 532.4e6, -1.5e12, 2e18)] == ["-", "999", "532.4M", "-1.5T", "2E"]
    assert [duration(s) for s in (42, 308, 28_680, 183_600)] == ["42s", "5m08s", "7h58m", "2d03h"]
