"""The memory a run needs, said before it allocates: what autograd saves of a forward, counted on meta, against a
model whose saved tensors are known; and a run that does not fit refused in one line, having written nothing."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppt import memory
from ppt.common import PPTError, Runtime
from ppt.flops import NO_FORMULAS
from scripts import base_train

VOCAB, WIDTH, SEQ = 64, 16, 8


class EmbedHead(nn.Module):
    """Embedding, head, cross-entropy: autograd keeps the token ids (int64) for the embedding, the embeddings (fp32)
    for the head, the log-softmax (fp32) and the targets (int64) for the loss, and the loss's weight total (4 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets=None, doc_pos=None, reduction="mean"):
        return F.cross_entropy(self.head(self.embed(idx)).flatten(0, 1), targets.flatten())


def test_the_activations_are_what_autograd_saves_and_grow_with_the_rows():
    with torch.device("meta"):
        model = EmbedHead()
    for rows in (1, 3):
        expected = rows * SEQ * (8 + 4 * WIDTH + 4 * VOCAB + 8) + 4
        assert memory.activation_bytes(model, rows, SEQ, torch.float32, NO_FORMULAS) == expected


def test_a_run_that_does_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
    with torch.device("meta"):
        model = EmbedHead()
    rt = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    state = memory.BYTES_PER_PARAMETER * 2 * VOCAB * WIDTH
    monkeypatch.setattr(memory, "available_bytes", lambda device: state + 10**6)
    memory.check_memory(model, 1, SEQ, rt, NO_FORMULAS, eager=True)  # fits
    with pytest.raises(PPTError, match=r"needs at least .* for what autograd keeps of a micro-batch of 1000 x 8 .*"
                       r"is free on cpu; choose a smaller config, or lower --device-batch-size"):  # fmt: skip
        memory.check_memory(model, 1000, SEQ, rt, NO_FORMULAS, eager=True)
    memory.check_memory(model, 1000, SEQ, rt, NO_FORMULAS, eager=False)  # compiled: the weights and state only
    monkeypatch.setattr(memory, "available_bytes", lambda device: state // 2)
    with pytest.raises(PPTError, match=r"needs at least 32\.8 kB of memory \(32\.8 kB for the fp32 weights, "
                       r"gradients and AdamW moments of 2\.048K parameters\), but 16\.4 kB is free on cpu; choose a "
                       r"smaller config$"):  # fmt: skip
        memory.check_memory(model, 1, SEQ, rt, NO_FORMULAS, eager=False)


def test_base_train_says_what_the_run_needs_before_it_builds_anything(demo_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**6)
    argv = ["--config", "tiny", "--data-dir", str(demo_data_dir), "--out-dir", str(tmp_path / "out"),
            "--seq-len", "32", "--total-batch-tokens", "64", "--device-batch-size", "2", "--compile", "off",
            "--device", "cpu"]  # fmt: skip
    with pytest.raises(PPTError, match=r"this run needs at least .* but 1\.0 MB is free on cpu"):
        base_train.main(argv)
    assert not (tmp_path / "out").exists()
