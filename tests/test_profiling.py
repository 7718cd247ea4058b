from types import SimpleNamespace

from torch.autograd import DeviceType

from ppt.profiling import gpu_idle_by_host_activity, kernel_time_by_kind


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
        op("aten::copy_", screening, [("_screening_forward_kernel", 400)]),  # launched by an op inside the custom op
        op("ppt::screening_backward", step, [("_screening_dkdv_kernel", 300), ("_screening_dq_kernel", 100)]),
        op("nccl:all_reduce", step, [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200)]),
        op("aten::add", ddp, [("triton_poi_fused_mul_silu_0", 200)]),
        op("aten::add", ddp, [("triton_poi_fused_mul_silu_0", 600)]),  # the same kernel again: one line, two launches
        # named after the ops fused into it, one of them a batched matmul whose output it reads: elementwise work
        op("aten::mul", ddp, [("triton_per_fused__to_copy__unsafe_view_add_bmm_clamp_min_div_eq_ge_3", 200)]),
        op("aten::mm", ddp, [("triton_tem_fused_mm_0", 200)]),  # an inductor matmul template (max-autotune)
        op("aten::cat", ddp, [("triton_poi_fused__scaled_dot_product_flash_attention_cat_mul_2", 200)]),  # rope
        optimizer,
        op("aten::_foreach_mul_", optimizer, [("multi_tensor_apply_kernel", 120)]),
        op("aten::mm", optimizer, [("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 80)]),  # Newton-Schulz: the optimizer's
        op("a device kernel itself", kernels=[("counted through its launch only", 999)], device=DeviceType.CUDA),
    ]
    report = kernel_time_by_kind(SimpleNamespace(events=lambda: events), steps=2, wall=0.002, largest=3)
    lines = report.splitlines()
    assert lines[0] == "kernels 1.6 ms per iteration (80.0% of the wall time), 6 launches"
    header = lines.index("the 3 largest kernels (ms and launches per iteration, kind, name):")
    kinds = {
        kind.strip(): (float(ms), float(launches))
        for kind, ms, _, _, launches, _ in (line.rsplit(None, 5) for line in lines[1:header])
    }
    assert kinds == {  # (ms, launches) per iteration of the two recorded
        "matmul": (0.4, 1.0),
        "ppt::screening (custom op)": (0.2, 0.5),
        "ppt::screening_backward (custom op)": (0.2, 1.0),
        "communication": (0.1, 0.5),
        "fused elementwise (inductor)": (0.6, 2.0),
        "optimizer": (0.1, 1.0),
    }
    assert lines[header + 1 :] == [
        "      0.40 ms    1.0x  fused elementwise (inductor): triton_poi_fused_mul_silu_0",
        "      0.30 ms    0.5x  matmul: nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT",
        "      0.20 ms    0.5x  ppt::screening (custom op): _screening_forward_kernel",
    ]


def kernel(name: str, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    """A device event: a kernel's interval in microseconds (or, `annotation`, the GPU-side range of a CPU annotation
    such as ProfilerStep#N)."""
    interval = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=interval, is_user_annotation=annotation)


def host(name: str, start: float, end: float, thread: int, parent=None) -> SimpleNamespace:
    """A CPU op or range on a host thread, in microseconds."""
    event = op(name, parent)
    event.thread, event.time_range = thread, SimpleNamespace(start=start, end=end)
    return event


def test_gpu_idle_is_split_by_what_the_host_did_meanwhile():
    step = host("ProfilerStep#3", 0, 4000, thread=1)
    optimizer = host("Optimizer.step#AdamW.step", 900, 1500, thread=1, parent=step)
    events = [
        step,
        optimizer,
        host("aten::_fused_adamw_", 950, 1400, thread=1, parent=optimizer),  # inside the step's range: not outermost
        host("Torch-Compiled Region: 0/0", 1500, 2100, thread=1, parent=step),
        host("autograd::engine::evaluate_function: CompiledFunctionBackward", 2500, 2800, thread=2),  # its own thread
        host("aten::_local_scalar_dense", 3000, 3100, thread=1, parent=step),
        host("aten::copy_", 0, 4000, thread=3),  # a loader thread: ahead of the step, not in its way
        kernel("f", 0, 800),
        kernel("f", 1600, 2400),  # 800 us idle: 100 in no op, 600 in the optimizer, 100 in the compiled region
        kernel("b", 2402, 2450),  # 2 us apart: back-to-back launches, not idle
        kernel("b", 2420, 2440),  # overlapping kernels (two streams): no gap
        kernel("o", 2900, 3000),  # 450 us idle: 300 while the backward ran, 150 in no op
        kernel("o", 3050, 3200),  # 50 us idle in the host's copy of a value
        kernel("ProfilerStep#3", 0, 3200, annotation=True),  # its GPU-side range, no kernel
    ]
    report = gpu_idle_by_host_activity(SimpleNamespace(events=lambda: events), steps=1, largest=2).splitlines()
    assert report[0] == (
        "GPU idle 1.3 ms per iteration of 3.2 ms from first to last kernel (3 gaps of 5 us or more an iteration); "
        "the host meanwhile, in its outermost ops:"
    )
    idle = {line[:50].strip(): float(line.split()[-2]) for line in report[1:]}
    assert idle == {"no op (the loop's own Python)": 0.25, "optimizer step": 0.6, "backward (autograd engine)": 0.3,
                    "other ops": 0.15}  # fmt: skip
    assert gpu_idle_by_host_activity(SimpleNamespace(events=lambda: [step]), steps=1) == "no kernels recorded"
