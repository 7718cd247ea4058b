"""What the screening kernels compile to, without a GPU: registers, stack, shared memory and SASS instructions.

    python -m bench.kernel_stats                                  # the shipped plans' blocks, sm_90 (H100/H200)
    python -m bench.kernel_stats --blocks 16,16,1,2 32,16,2,3,96  # BLOCK_M,BLOCK_N,warps,stages[,register cap]
    python -m bench.kernel_stats --kernel-file .ref/screening_triton_OLD.py   # a kernel file of another commit

Each kernel is compiled ahead of time for the target with Triton's own compiler and ptxas, with the specialization a
launch at the benchmark shape gets (16-byte aligned pointers, sizes and strides divisible by 16), and disassembled
with the cuobjdump that ships with Triton. "loop" counts the instructions of the kernel's loop over tiles (interior
and boundary paths together); warps/SM is the occupancy the registers and shared memory allow. The kernels are
latency-bound at small tiles, so registers (through warps/SM) and loop instructions are the numbers to read; spills
show as LDL/STL in the loop's mix.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
import types
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.common import CommaList, load_module, python_file
from bench.screening import PLAN_NAMES, parse_blocks
from ppt.common import ArgumentParser, PPTError, positive_int, run_cli

ROOT = Path(__file__).resolve().parents[1]
# each kind's kernel name, then the shorter one of kernel files from before 2026-12-02 (--kernel-file)
KERNELS = {
    "forward": ("_screening_forward_kernel", "_forward_kernel"),
    "dq": ("_screening_dq_kernel", "_dq_kernel"),
    "dkdv": ("_screening_dkdv_kernel", "_dkdv_kernel"),
}
POINTERS = {"Q", "K", "V", "OUT", "DOUT", "DQ", "DK_OUT", "DV_OUT"}
POINTER_TYPES = {"WINDOW": "*fp32", "RHO": "*fp32", "DOC_START": "*i32", "DOC_END": "*i32", "DW_PART": "*fp32",
                 "DRHO_PART": "*fp32", "DW_OUT": "*fp32", "DRHO_OUT": "*fp32"}  # fmt: skip
ALIGNED = {"T", "H", "stride_b", "stride_t", "stride_vb", "stride_vt"}  # multiples of 16 at the benchmark shape
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_kernel(fn: object, blocks: tuple[int, ...], dk: int, dv: int, arch: int) -> object:
    """fn compiled for sm_<arch> with bf16 operands and (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg])."""
    block_m, block_n, warps, stages, *maxnreg = blocks
    names = fn.arg_names
    constants = {"DK": dk, "DV": dv, "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": "tf32", "SUM_BLOCK": 256}
    types_ = {
        n: "constexpr" if n in constants else POINTER_TYPES.get(n, "*bf16" if n in POINTERS else "i32") for n in names
    }
    pointers = POINTERS | set(POINTER_TYPES)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers | ALIGNED}
    source = ASTSource(fn, types_, constexprs={k: v for k, v in constants.items() if k in names}, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True}  # as the launches set it
    options |= {"maxnreg": maxnreg[0]} if maxnreg else {}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def sass_stats(compiled: object) -> dict:
    """Registers, stack, shared memory, total instructions and the loop's instruction mix of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", cubin], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    line = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P[T\d]+\s+)?[A-Z][\w.]*)([^;]*);")
    instructions = [(int(a, 16), opcode.split()[-1], operands) for a, opcode, operands in line.findall(sass)]
    backward_branches = []  # (target, address) of branches back to an earlier instruction
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            backward_branches.append((int(target.group(1), 16), address))
    loop = collections.Counter()
    if backward_branches:  # the widest backward branch spans the loop over tiles
        start, end = max(backward_branches, key=lambda branch: branch[1] - branch[0])
        loop = collections.Counter(op.split(".")[0] for address, op, _ in instructions if start <= address <= end)
    return {"regs": regs, "stack": stack, "smem": compiled.metadata.shared, "instructions": len(instructions),
            "loop": sum(loop.values()), "loop_mix": loop}  # fmt: skip


def warps_per_sm(stats: dict, warps: int) -> int:
    """Resident warps an H100/H200 SM allows: 64K registers (8 per thread granularity), 227 KB shared, 32 blocks."""
    regs = -(-stats["regs"] // 8) * 8
    programs = min(65536 // (regs * 32 * warps), (227 * 1024) // max(stats["smem"], 1), 32, 64 // warps)
    return programs * warps


def kernel_of(module: types.ModuleType, kind: str) -> object:
    """The kind's Triton kernel in a loaded kernel file, under its current name or its earlier one."""
    for name in KERNELS[kind]:
        if hasattr(module, name):
            return getattr(module, name)
    raise PPTError(f"{module.__file__} defines none of {', '.join(KERNELS[kind])}: is it a screening kernel file?")


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel-file", type=python_file, default=ROOT / "ppt" / "kernels" / "screening_triton.py")
    p.add_argument("--blocks", type=parse_blocks, nargs="+", help="blocks to compile (default: each plan's own)")
    p.add_argument("--kernels", type=CommaList(tuple(KERNELS)), default="forward,dq,dkdv", help="comma list of kernels")
    p.add_argument("--dk", type=positive_int, default=16)
    p.add_argument("--dv", type=positive_int, default=64)
    p.add_argument("--arch", type=positive_int, default=90, help="compute capability x 10 (90: H100/H200)")
    args = p.parse_args(argv)
    module = load_module("screening_triton_under_test", args.kernel_file)
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.kernel_file}")
    print(
        f"{'kernel':<8} {'blocks':<16} {'regs':>4} {'stack':>5} {'smem':>6} {'warps/SM':>8} {'instrs':>6} {'loop':>5}"
    )
    for kind in args.kernels:
        if hasattr(module, PLAN_NAMES[kind]):
            own = [blocks for _, blocks in getattr(module, PLAN_NAMES[kind])]
        else:  # kernel files from before the window-class plans
            own = [getattr(module, PLAN_NAMES[kind].replace("PLAN", "BLOCKS"))]
        for blocks in args.blocks or own:
            stats = sass_stats(compile_kernel(kernel_of(module, kind), blocks, args.dk, args.dv, args.arch))
            mix = ", ".join(f"{op} {n}" for op, n in stats["loop_mix"].most_common(6))
            occupancy = warps_per_sm(stats, blocks[2])
            print(f"{kind:<8} {str(blocks):<16} {stats['regs']:4d} {stats['stack']:5d} {stats['smem']:6d} "
                  f"{occupancy:8d} {stats['instructions']:6d} {stats['loop']:5d}  [{mix}]")  # fmt: skip


if __name__ == "__main__":
    run_cli(main)
