import pytest
import third_arch
import torch

from ppt.kernels.attention import attention, document_mask


def test_dense_document_mask_semantics():
    doc_pos = torch.tensor([[0, 1, 2, 0, 1]], dtype=torch.int32)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(document_mask(doc_pos, flex=False)[0, 0], expected)
    assert document_mask(None) is None


def random_doc_pos(B: int, T: int, generator: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(B):
        starts = torch.zeros(T, dtype=torch.bool)
        starts[0] = True
        starts[torch.randint(1, T, (3,), generator=generator)] = True
        seg = torch.cumsum(starts, 0)
        first = torch.nonzero(starts).flatten()
        rows.append(torch.arange(T) - first[seg - 1])
    return torch.stack(rows).to(torch.int32)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose: CPU oracle
def test_flex_path_matches_dense_reference_with_gqa():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 160, 16  # T not a multiple of the 128-token block
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hkv, Hkv))
    doc_pos = random_doc_pos(B, T, g)
    dense = attention(q, k, v, document_mask(doc_pos, flex=False))
    flex = attention(q, k, v, document_mask(doc_pos, flex=True))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    # one document per row is plain causal attention
    single = torch.arange(T, dtype=torch.int32).expand(B, T)
    torch.testing.assert_close(attention(q, k, v, document_mask(single, flex=False)), attention(q, k, v, None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_attention_matches_dense_reference_gradients_on_gpu():
    """The compiled FlexAttention training kernels: output and q/k/v gradients equal the dense path's at the 360M
    head layout (15 query heads on 5 KV heads of 64), documents starting inside 128-token blocks."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 15, 5, 640, 64
    q, k, v = (torch.randn(B, h, T, D, generator=g).cuda().requires_grad_() for h in (H, Hkv, Hkv))
    doc_pos = random_doc_pos(B, T, g).cuda()
    out_grad = torch.randn(B, H, T, D, generator=g).cuda()
    flex_out = torch.compile(attention)(q, k, v, document_mask(doc_pos, flex=True))
    flex_grads = torch.autograd.grad(flex_out, (q, k, v), out_grad)
    dense_out = attention(q, k, v, document_mask(doc_pos, flex=False))
    dense_grads = torch.autograd.grad(dense_out, (q, k, v), out_grad)
    torch.testing.assert_close(flex_out, dense_out, atol=2e-4, rtol=2e-4)
    for flex_grad, dense_grad in zip(flex_grads, dense_grads):
        torch.testing.assert_close(flex_grad, dense_grad, atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_model_gives_the_eager_loss_with_and_without_grad_on_gpu():
    """Compiled on CUDA, training forwards mask with FlexAttention and no-grad forwards with the dense mask (the
    tests' grouped-query decoder, which attends through ppt.kernels.attention)."""
    model = third_arch.build(n_head=4, n_kv_head=2).cuda()
    idx = torch.randint(1, model.config.vocab_size, (2, 129), device="cuda")
    doc_pos = random_doc_pos(2, 128, torch.Generator().manual_seed(1)).cuda()
    inputs, targets = idx[:, :-1], idx[:, 1:]
    eager = model(inputs, targets, doc_pos).detach()
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(inputs, targets, doc_pos).detach(), eager, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(inputs, targets, doc_pos), eager, rtol=1e-4, atol=1e-4)
