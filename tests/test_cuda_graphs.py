"""Training steps replayed from CUDA graphs (--compile-mode reduce-overhead, what auto picks on one GPU) accumulate the
eager gradients."""

import pytest
import torch
from architectures import fresh, smallest_config_per_class
from torch._dynamo.utils import counters

from ppt.common import Runtime
from scripts.base_train import allocate_grads
from scripts.train_settings import compile_mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", smallest_config_per_class())  # each architecture of ppt/model.py
def test_cuda_graph_steps_accumulate_the_eager_gradients_on_gpu(name):
    model = fresh(name).cuda()
    micro_batches = [torch.randint(1, model.config.vocab_size, (2, 129), device="cuda") for _ in range(6)]

    def steps(train_model: torch.nn.Module) -> list[torch.Tensor]:
        """Three steps of two micro-batches each; the summed gradient of every step as one vector."""
        allocate_grads(model)
        grads = []
        for step in range(3):
            for idx in micro_batches[2 * step : 2 * step + 2]:
                (train_model(idx[:, :-1], idx[:, 1:]) / 2).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
            model.zero_grad(set_to_none=False)
        return grads

    eager = steps(model)
    counters.clear()
    graphed = steps(torch.compile(model, mode="reduce-overhead"))
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled step did not replay from CUDA graphs"
    for step, (ours, ref) in enumerate(zip(graphed, eager)):
        assert ((ours - ref).norm() / ref.norm()).item() <= 1e-4, f"step {step + 1}"


def test_auto_compile_mode_replays_cuda_graphs_on_one_gpu_only():
    def on(device: str, world_size: int) -> Runtime:
        return Runtime(0, 0, world_size, torch.device(device), torch.bfloat16)

    assert compile_mode("auto", on("cuda", 1)) == "reduce-overhead"
    assert compile_mode("auto", on("cuda", 8)) == "default"  # DDP
    assert compile_mode("auto", on("cpu", 1)) == compile_mode("auto", on("mps", 1)) == "default"
    assert compile_mode("default", on("cuda", 1)) == "default"  # a mode given is kept
    assert compile_mode("max-autotune", on("cpu", 1)) == "max-autotune"
