"""torch.profiler over a few iterations of the real training loop, and where their time went: the top kernels (CUDA)
or ops (CPU) and, on CUDA, device time per kind of kernel against wall time, and where in the step the GPU sat idle."""

from __future__ import annotations

import re
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

# Kernels by name, for those launched outside a custom op or the optimizer's step (first match wins). Inductor's
# pointwise, persistent and looped reductions come first: their names list the ops fused into them, and one that
# reads a batched matmul's output ("..._add_bmm_clamp_min_...") or prepares attention's inputs is elementwise work.
KERNEL_KINDS = [
    ("fused elementwise (inductor)", r"^triton_(poi|per|red)_"),
    ("attention", r"flex|attn|attention|fmha|flash"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|mm_|^triton_tem_"),
    ("communication", r"nccl"),
    ("fused elementwise (inductor)", r"^triton_"),
    ("copies and fills", r"memcpy|memset|copy|fill"),
]
CUSTOM_OP = re.compile(r"^ppt::")  # the custom ops of ppt/kernels/ (and any a model registers under ppt::)
OPTIMIZER_STEP = "Optimizer.step"  # the range torch.optim records around every optimizer's step()
AUTOGRAD_ENGINE = "autograd::engine::evaluate_function"  # the autograd engine's range around each backward node
STEP_RANGE = "ProfilerStep"  # the range the profiler records around each iteration (ProfilerStep#N, or *)
NO_OP = "no op (the loop's own Python)"
# what an outermost host op is, by the range around it (torch.compile records "Torch-Compiled Region" around a
# compiled call: the compiled forward, or its CUDA-graph replay); any other op goes by its own name
HOST_ACTIVITIES = {OPTIMIZER_STEP: "optimizer step", AUTOGRAD_ENGINE: "backward (autograd engine)",
                   "Torch-Compiled Region": "compiled region (forward, graph replay)"}  # fmt: skip


class StepProfiler:
    """Records `steps` loop iterations after `first` others and one warm-up, and prints its report when they are done.
    Call `step()` at the start of every iteration and `stop()` after the loop."""

    def __init__(self, device: torch.device, first: int, steps: int) -> None:
        self.cuda = device.type == "cuda"
        self.steps = steps
        self.recording_since: float | None = None
        self.reported = False
        self.profiler = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []),
            schedule=schedule(skip_first=first, wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._report,
        )
        self.profiler.start()

    def step(self) -> bool:
        """Call at the start of every loop iteration. Returns whether the profiler slows this iteration down: it
        warms up or records during it, or prints the report of the recorded ones at its start."""
        reported = self.reported
        self.profiler.step()
        action = self.profiler.current_action
        recording = action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
        if recording and self.recording_since is None:
            self._synchronize()
            self.recording_since = time.perf_counter()
        return action != ProfilerAction.NONE or self.reported != reported

    def stop(self) -> None:
        self.profiler.stop()

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _report(self, prof: profile) -> None:
        self.reported = True
        self._synchronize()
        wall = (time.perf_counter() - self.recording_since) / self.steps
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70), flush=True)
        print(f"wall time per iteration: {1000 * wall:.1f} ms over {self.steps} recorded", flush=True)
        if self.cuda:
            print(kernel_time_by_kind(prof, self.steps, wall), flush=True)
            print(gpu_idle_by_host_activity(prof, self.steps), flush=True)


def kernel_kind(op: object) -> str | None:
    """The kind every kernel launched inside this CPU op (or an op around it) has: the op's own name for a `ppt::`
    custom op, "optimizer" inside an optimizer's step; None where the kernel's own name decides."""
    while op is not None:  # the op, then the ops around it, innermost first
        if CUSTOM_OP.match(op.name):
            return f"{op.name} (custom op)"
        if op.name.startswith(OPTIMIZER_STEP):
            return "optimizer"
        op = op.cpu_parent
    return None


def kernel_time_by_kind(prof: profile, steps: int, wall: float, largest: int = 12) -> str:
    """Device time and launches per iteration by kind of kernel (`kernel_kind`, else KERNEL_KINDS by its name), and the
    time's share of the wall time; then the `largest` kernels with their launches per iteration and full names (the
    table above cuts names short, and inductor's differ only at the end)."""
    seconds: Counter = Counter()  # per iteration, by (kind, name)
    launches: Counter = Counter()  # in the default compile mode each launch is host work a step waits on
    for event in prof.events():
        if event.device_type != DeviceType.CPU or not event.kernels:
            continue
        context = kernel_kind(event)
        for kernel in event.kernels:
            kind = context or next((k for k, pattern in KERNEL_KINDS if re.search(pattern, kernel.name, re.I)), "other")
            seconds[kind, kernel.name] += kernel.duration / 1e6 / steps
            launches[kind, kernel.name] += 1 / steps
    per_kind: Counter = Counter()
    launches_per_kind: Counter = Counter()
    for kind, name in seconds:
        per_kind[kind] += seconds[kind, name]
        launches_per_kind[kind] += launches[kind, name]
    busy = per_kind.total()
    lines = [
        f"kernels {1000 * busy:.1f} ms per iteration ({100 * busy / wall:.1f}% of the wall time), "
        f"{launches_per_kind.total():.0f} launches"
    ]
    for kind, kind_seconds in per_kind.most_common():
        share, kind_launches = 100 * kind_seconds / wall, launches_per_kind[kind]
        lines.append(f"  {kind:40s} {1000 * kind_seconds:8.1f} ms  {share:5.1f}%  {kind_launches:6.1f} launches")
    lines.append(f"the {min(largest, len(seconds))} largest kernels (ms and launches per iteration, kind, name):")
    for (kind, name), kernel_seconds in seconds.most_common(largest):
        lines.append(f"  {1000 * kernel_seconds:8.2f} ms {launches[kind, name]:6.1f}x  {kind}: {name}")
    return "\n".join(lines)


def gpu_idle_by_host_activity(prof: profile, steps: int, min_gap_us: float = 5.0, largest: int = 6) -> str:
    """Time per iteration in which no kernel ran (gaps from min_gap_us, the spacing of back-to-back launches), split by
    what the host was doing meanwhile: the outermost op on the loop's thread or the backward's, or none (the loop's
    own Python). Matched by time alone: kernels replayed from a CUDA graph name no launching op, and torch 2.11's
    profiler linked no kernel to its op. Upper bounds: the profiler slows the host."""
    events = prof.events()
    # not the GPU-side ranges of annotations (ProfilerStep#N, Optimizer.step...): each spans its whole region and
    # would hide every gap inside it
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    kernels = sorted((e for e in kernels if e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    if not kernels:
        return "no kernels recorded"
    host = [e for e in events if e.device_type == DeviceType.CPU]
    # the loop's thread (the one stepping the profiler) and the autograd engine's (a device thread on CUDA); the
    # loader's threads work ahead of the step, not in its way
    threads = {e.thread for e in host if e.name.startswith((STEP_RANGE, AUTOGRAD_ENGINE))}
    outermost = sorted(
        (e for e in host if e.thread in threads and not e.name.startswith(STEP_RANGE)
         and (e.cpu_parent is None or e.cpu_parent.name.startswith(STEP_RANGE))),
        key=lambda e: e.time_range.start,
    )  # fmt: skip
    idle: Counter = Counter()  # microseconds over the recorded iterations
    gaps = first_open = 0  # the ops before first_open ended before the gaps still to come
    busy_until = kernels[0].time_range.end
    for kernel in kernels[1:]:
        start, end = busy_until, kernel.time_range.start
        if end - start >= min_gap_us:
            gaps += 1
            while first_open < len(outermost) and outermost[first_open].time_range.end <= start:
                first_open += 1
            covered, in_ops = start, 0.0  # each microsecond counts once, for the op that began first
            for op in outermost[first_open:]:
                if op.time_range.start >= end:
                    break
                overlap = min(end, op.time_range.end) - max(covered, op.time_range.start)
                if overlap > 0:
                    activity = next((a for prefix, a in HOST_ACTIVITIES.items() if op.name.startswith(prefix)), op.name)
                    idle[activity] += overlap
                    in_ops += overlap
                    covered = min(end, op.time_range.end)
            idle[NO_OP] += end - start - in_ops
        busy_until = max(busy_until, kernel.time_range.end)
    span = (busy_until - kernels[0].time_range.start) / 1e3 / steps
    total = sum(idle.values()) / 1e3 / steps
    lines = [
        f"GPU idle {total:.1f} ms per iteration of {span:.1f} ms from first to last kernel ({gaps / steps:.0f} gaps "
        f"of {min_gap_us:g} us or more an iteration); the host meanwhile, in its outermost ops:"
    ]
    by_op = sorted(((name, us) for name, us in idle.items() if name != NO_OP), key=lambda kv: -kv[1])
    rows = [(NO_OP, idle[NO_OP]), *by_op[:largest], ("other ops", sum(us for _, us in by_op[largest:]))]
    lines += [f"  {name[:48]:48s} {us / 1e3 / steps:8.2f} ms" for name, us in rows]
    return "\n".join(lines)
