from types import SimpleNamespace

from torch.autograd import DeviceType

from ppt.profiling import kernel_time_by_kind


def op(name: str, parent=None, kernels=(), device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
    """A profiler event: a CPU op (or annotated range) and the kernels it launched, as (name, microseconds)."""
    launched = [SimpleNamespace(name=kernel, duration=us) for kernel, us in kernels]
    return SimpleNamespace(name=name, cpu_parent=parent, kernels=launched, device_type=device)


def test_kernels_count_once_under_the_op_that_launched_them():
    step = op("ProfilerStep#7")
    ddp = op("DistributedDataParallel.forward", step)
    screening = op("ppt::screening", ddp)  # a custom op: its Triton kernels have names no table knows
    optimizer = op("Optimizer.step#HybridOptimizer.step", step)
    events = [
        step,
        ddp,
        screening,
        op("aten::mm", ddp, [("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 600)]),
        op("aten::copy_", screening, [("_forward_kernel", 400)]),  # launched by an op inside the custom op
        op("ppt::screening_backward", step, [("_dkdv_kernel", 300), ("_dq_kernel", 100)]),
        op("nccl:all_reduce", step, [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200)]),
        op("aten::add", ddp, [("triton_poi_fused_mul_silu_0", 200)]),
        # named after the ops fused into it, one of them a batched matmul whose output it reads: elementwise work
        op("aten::mul", ddp, [("triton_per_fused__to_copy__unsafe_view_add_bmm_clamp_min_div_eq_ge_3", 200)]),
        op("aten::mm", ddp, [("triton_tem_fused_mm_0", 200)]),  # an inductor matmul template (max-autotune)
        op("aten::cat", ddp, [("triton_poi_fused__scaled_dot_product_flash_attention_cat_mul_2", 200)]),  # rope
        optimizer,
        op("aten::_foreach_mul_", optimizer, [("multi_tensor_apply_kernel", 120)]),
        op("aten::mm", optimizer, [("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 80)]),  # Newton-Schulz: the optimizer's
        op("a device kernel itself", kernels=[("counted through its launch only", 999)], device=DeviceType.CUDA),
    ]
    report = kernel_time_by_kind(SimpleNamespace(events=lambda: events), steps=2, wall=0.002)
    lines = report.splitlines()
    assert lines[0] == "kernels 1.3 ms per iteration (65.0% of the wall time)"
    kinds = {kind.strip(): float(ms) for kind, ms, _, _ in (line.rsplit(None, 3) for line in lines[1:])}
    assert kinds == {
        "matmul": 0.4,
        "ppt::screening (custom op)": 0.2,
        "ppt::screening_backward (custom op)": 0.2,
        "communication": 0.1,
        "fused elementwise (inductor)": 0.3,
        "optimizer": 0.1,
    }
