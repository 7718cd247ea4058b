from types import SimpleNamespace

from torch.autograd import DeviceType

from ppt.profiling import kernel_time_by_kind


def event(key: str, us: float, device: DeviceType = DeviceType.CUDA, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(key=key, self_device_time_total=us, device_type=device, is_user_annotation=annotation)


def test_kernel_kinds_count_each_kernel_once_and_skip_annotated_ranges():
    events = [
        event("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 600),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 180),
        event("triton_poi_fused_mul_silu_0", 200),
        event("aten::mm", 600, device=DeviceType.CPU),  # the CPU op that launched the matmul
        # device-side spans of annotated ranges, covering the kernels above
        event("nccl:all_reduce", 180, annotation=True),
        event("DistributedDataParallel.forward", 700, annotation=True),
        event("ProfilerStep#7", 2000, annotation=True),
    ]
    report = kernel_time_by_kind(SimpleNamespace(key_averages=lambda: events), steps=2, wall=0.001)
    lines = report.splitlines()
    assert lines[0] == "kernels 0.5 ms per iteration (49.0% of the wall time)"
    kinds = {line[:34].strip(): float(line[34:].split()[0]) for line in lines[1:]}
    assert kinds == {"matmul": 0.3, "communication": 0.1, "fused elementwise (inductor)": 0.1}
