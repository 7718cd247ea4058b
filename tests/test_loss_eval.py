"""bits-per-byte and NLL against hand-computed values: uniform and fixed-probability toy models, raw-byte counting
with multi-byte and partial-UTF-8 tokens, special tokens excluded, determinism, the real val loader, bench_bpb's
variant lists."""

import math

import numpy as np
import pytest
import third_arch
import torch
import torch.nn.functional as F
from torch import nn

from ppt.common import PPTError
from ppt.data import DataLoader
from ppt.kernels.attention import scores_with_autograd
from ppt.loss_eval import evaluate_bpb
from ppt.tokenizer import train_demo_tokenizer


class FixedDistribution(nn.Module):
    """Predicts the same distribution softmax(`logits`) at every position; obeys the model contract."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())
        self.seen_doc_pos = []

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        self.seen_doc_pos.append(doc_pos)
        logits = self.logits.expand(*idx.shape, -1)
        if targets is None:
            return logits
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
        return nll.view(targets.shape) if reduction == "none" else nll


def batch(targets):
    targets = torch.tensor(targets)
    return targets.clamp_min(0), targets, torch.zeros_like(targets, dtype=torch.int32)


def test_uniform_model_gives_ln_v_per_token_and_bytes_from_the_table():
    V = 8
    token_bytes = torch.tensor([0, 1, 2, 3, 1, 1, 4, 2], dtype=torch.int32)  # id 0 is special (EOT)
    targets = [[3, 0, 6, -1], [1, 2, 0, 7]]  # 7 scored targets, 2 of them EOT, one ignored
    result = evaluate_bpb(FixedDistribution(torch.zeros(V)), [batch(targets)], token_bytes)
    n_bytes = 3 + 4 + 1 + 2 + 2
    assert result["tokens"] == 7 and result["bytes"] == n_bytes
    assert result["nll"] == pytest.approx(math.log(V), rel=1e-6)
    assert result["bpb"] == pytest.approx(5 * math.log(V) / (math.log(2) * n_bytes), rel=1e-6)


def test_fixed_distribution_matches_a_hand_sum_and_excludes_special_tokens():
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5], dtype=torch.float64).float()
    logp = torch.log_softmax(logits.double(), -1)
    token_bytes = torch.tensor([0, 3, 1, 2, 5], dtype=torch.int32)
    rows = [[2, 4, 0, 1, 3], [0, 0, 4, -1, -1]]
    nll_sum = bpb_nll = nbytes = n = 0
    for row in rows:
        for t in row:
            if t < 0:
                continue
            n += 1
            nll_sum += -logp[t].item()
            if token_bytes[t] > 0:
                bpb_nll += -logp[t].item()
                nbytes += int(token_bytes[t])
    batches = [batch([rows[0]]), batch([rows[1]])]
    result = evaluate_bpb(FixedDistribution(logits), batches, token_bytes)
    assert result["tokens"] == n and result["bytes"] == nbytes
    assert result["nll"] == pytest.approx(nll_sum / n, rel=1e-6)
    assert result["bpb"] == pytest.approx(bpb_nll / (math.log(2) * nbytes), rel=1e-6)


def test_only_special_targets_give_nan_bpb_and_no_targets_is_an_error():
    model = FixedDistribution(torch.zeros(4))
    token_bytes = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    result = evaluate_bpb(model, [batch([[0, 0, 0]])], token_bytes)
    assert result["nll"] == pytest.approx(math.log(4)) and math.isnan(result["bpb"])
    with pytest.raises(PPTError, match="no target tokens"):
        evaluate_bpb(model, [batch([[-1, -1]])], token_bytes)


def partial_utf8_tokenizer():
    """A demo BPE trained on multi-byte text: its merges include tokens holding part of a UTF-8 character."""
    text = "naïve café 日本語のテキスト 🙂🙃 Ελληνικά "
    return train_demo_tokenizer([text * 20] * 5, vocab_size=300), text


def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level table, written out independently of ppt: printable Latin-1 bytes stand for themselves,
    the other 68 take code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    for offset, b in enumerate(b for b in range(256) if b not in printable):
        table[chr(256 + offset)] = b
    return table


BYTE_OF_CHAR = byte_level_chars()


def token_raw_bytes(tokenizer, token_id: int) -> bytes:
    return bytes(BYTE_OF_CHAR[ch] for ch in tokenizer.backend.id_to_token(token_id))


def test_bytes_are_raw_utf8_bytes_even_for_partial_characters():
    tokenizer, _ = partial_utf8_tokenizer()
    text = "日本語 🙂 café ünïcode Ελληνικά"
    ids = tokenizer.encode_batch([text])[0]
    partial = []
    for t in ids[:-1]:
        try:
            token_raw_bytes(tokenizer, t).decode("utf-8")
        except UnicodeDecodeError:
            partial.append(t)
    assert partial, "the test text should produce tokens that split a UTF-8 character"
    token_bytes = tokenizer.token_bytes()
    # decoding a partial token gives U+FFFD (3 bytes): counting decoded text would be wrong
    decoded_count = sum(len(tokenizer.decode([t]).encode("utf-8")) for t in ids[:-1])
    assert decoded_count != len(text.encode("utf-8"))

    V = tokenizer.vocab_size
    inputs = torch.tensor([[tokenizer.eot_id, *ids[:-1]]])
    targets = torch.tensor([ids])  # the text's tokens, then its closing EOT (0 bytes: excluded)
    result = evaluate_bpb(FixedDistribution(torch.zeros(V)), [(inputs, targets, None)], token_bytes)
    assert result["bytes"] == len(text.encode("utf-8"))
    assert result["bpb"] == pytest.approx((len(ids) - 1) * math.log(V) / (math.log(2) * len(text.encode())))


def test_deterministic_restores_mode_and_does_not_depend_on_batching():
    model = third_arch.build(vocab_size=64, max_seq_len=32).train()
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 64, (6, 32), generator=gen)
    targets = torch.randint(0, 64, (6, 32), generator=gen)
    doc_pos = torch.cat([torch.arange(16), torch.arange(16)]).int().expand(6, -1)
    token_bytes = torch.arange(64, dtype=torch.int32) % 4
    whole = [(inputs, targets, doc_pos)]
    first = evaluate_bpb(model, whole, token_bytes)
    assert model.training, "evaluate_bpb must leave the model in training mode"
    assert evaluate_bpb(model, whole, token_bytes) == first
    rows = [(inputs[i : i + 1], targets[i : i + 1], doc_pos[i : i + 1]) for i in range(6)]
    one_by_one = evaluate_bpb(model, rows, token_bytes)
    assert one_by_one["tokens"] == first["tokens"] and one_by_one["bytes"] == first["bytes"]
    assert one_by_one["bpb"] == pytest.approx(first["bpb"], rel=1e-6)


def test_val_loader_budget_with_document_boundaries(make_token_dir):
    V = 16
    rng = np.random.default_rng(0)
    stream = rng.integers(1, V, 1001)
    stream[::37] = 0  # EOT begins the stream and every document
    data_dir = make_token_dir({"val": [stream], "train": [stream]}, vocab_size=V)
    loader = DataLoader(data_dir, "val", batch_size=3, seq_len=50, device="cpu")
    model = FixedDistribution(torch.zeros(V))
    token_bytes = torch.tensor([0] + [2] * (V - 1), dtype=torch.int32)
    result = evaluate_bpb(model, loader.val_batches(500), token_bytes)
    targets = stream[1:501]
    assert result["tokens"] == 500
    assert result["bytes"] == 2 * int((targets != 0).sum())
    assert result["bpb"] == pytest.approx(math.log(V) / (2 * math.log(2)))
    assert all(pos is not None and int(pos.min()) == 0 for pos in model.seen_doc_pos), "doc_pos must be passed on"


def test_scoring_off_cuda_runs_without_autograd():
    """Only compiled models on CUDA score with autograd on (FlexAttention's training kernels); elsewhere no graph,
    even for a compiled model."""
    seen = []

    class Recorder(FixedDistribution):
        def forward(self, *args, **kwargs):
            seen.append(torch.is_grad_enabled())
            return super().forward(*args, **kwargs)

    V = 4
    model = Recorder(torch.zeros(V))
    token_bytes = torch.ones(V, dtype=torch.int64)
    evaluate_bpb(model, [batch([[1, 2, 3]])], token_bytes)
    assert seen == [False]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (scores_with_autograd(True, cpu), scores_with_autograd(False, cuda), scores_with_autograd(True, cuda)) == (
        False, False, True,
    )  # fmt: skip


def test_bench_bpb_runs_each_variant_and_refuses_bad_lists(run_tool):
    argv = ["--config", "gpt2-tiny", "--seq-len", "32", "--eval-tokens", "256", "--compile", "off"]
    code, out, _ = run_tool("bench.bench_bpb", *argv, "--batch-size", "2,4")
    assert code == 0 and "| gpt2-tiny | off | 2 | 256 |" in out and "| gpt2-tiny | off | 4 | 256 |" in out
    for flag, value, message in [
        ("--batch-size", "nan", "'nan' is not an integer >= 1"),
        ("--batch-size", "2,0", "'0' (in the list '2,0') is not an integer >= 1"),
        ("--compile", "maybe", "'maybe' is not one of auto, on, off"),
    ]:
        code, _, err = run_tool("bench.bench_bpb", flag, value)
        assert code == 2 and err == f"error: argument {flag}: {message} (see --help)\n"


def test_a_compiled_model_scored_with_autograd_is_taken_from_aotautograds_cache_by_the_next_run(monkeypatch):
    """Scoring with autograd on (compiled, on CUDA) runs no backward, which is when AOTAutograd would otherwise compile
    the graph's backward and save the graph: without evaluate_bpb compiling it with the forward, every run traced and
    partitioned its evaluation graph anew."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    monkeypatch.setattr("ppt.loss_eval.scores_with_autograd", lambda compiled, device: compiled)  # as on CUDA
    V = 8
    token_bytes = torch.ones(V, dtype=torch.int64)
    with fresh_cache():
        for run, cache in (("first", "saved"), ("second", "hit")):
            torch._dynamo.reset()  # what a new process starts from, the on-disk caches aside
            counters.clear()
            model = torch.compile(FixedDistribution(torch.linspace(-1, 1, V)))
            result = evaluate_bpb(model, [batch([[1, 2, 3, 4]])], token_bytes)
            assert counters["aot_autograd"][f"autograd_cache_{cache}"] == 1, (run, dict(counters["aot_autograd"]))
            assert result["tokens"] == 4 and math.isfinite(result["bpb"])
