"""A finished run's record as base_train writes it, made by hand: what tests of compare and study read."""

from __future__ import annotations

import json
from pathlib import Path

from ppt.run import Evaluation, RunRecord, TrainSettings


def write_manifest(
    directory: Path,
    tag: str,
    final_bpb: float,
    data_seed: int = 0,
    model_seed: int = 0,
    config: str = "vanilla",
    lr: float = 3e-3,
    flops_per_token: float = 6e6,
    **changes: object,
) -> Path:
    """A finished run's record as base_train writes it: evaluations at steps 10 and 20; `changes` set fields of its
    JSON by dotted path ("train.seq_len"; "final_val.X" sets the last evaluation's X)."""
    evals = [
        Evaluation(step, 1000 * step, int(flops_per_token * 1000 * step), 3.0 * step, 2 * bpb, bpb, 4096)
        for step, bpb in ((10, final_bpb + 0.5), (20, final_bpb))
    ]
    train = TrainSettings(
        seq_len=256, total_batch_tokens=1000, device_batch_size=4, grad_accum=1, world_size=data_seed + 1,
        optimizer="adamw", lr=lr, optimizer_groups=[], weight_decay=0.1, grad_clip=1.0, schedule="wsd",
        warmup_tokens=1000, warmup_steps=1, decay_frac=0.2, steps=20, last_step=20, target_tokens=20_000, budget=None,
        doc_masks=True, deterministic=False, seed=0, data_seed=data_seed, model_seed=model_seed,
        dtype="torch.bfloat16", compile=False, compile_mode=None, loader_prefetch=2, skip_nonfinite=0, eval_every=10,
        eval_tokens=4096, recipe=None,
    )  # fmt: skip
    record = RunRecord(
        run=tag, out_dir=str(directory / tag), argv=[], args={}, config_name=config,
        config={"class": "LlamaConfig" if config == "vanilla" else "MultiscreenConfig", "width": len(config)},
        tokenizer={"fingerprint": "ab" * 32}, data={"fingerprint": "cd" * 32}, train=train,
        params=1_500_000 if config == "vanilla" else 900_000, flops_per_token=None,
        comparison_flops_rule={"seq_len": 256, "params_matmul": 1000, "mixers": [{"op": "sdpa", "heads": [[64, 256, 4]]}]},  # noqa: E501
        git={}, model_source={"sha256": "ee" * 32}, hardware={},
        history=[{"step": s, "tok_per_s": 1000.0 * (s % 3 + 1)} for s in range(1, 21)], evals=evals,
        tokens=20_000, comparison_flops=evals[-1].comparison_flops, wall_time_s=60.0, finished="2026-12-02T00:00:00",
    )  # fmt: skip
    data = record.to_dict()
    for key, value in changes.items():
        *parents, leaf = key.replace("final_val.", "evals.-1.").split(".")
        target = data
        for parent in parents:
            target = target[int(parent)] if parent.lstrip("-").isdigit() else target[parent]
        target[leaf] = value
    path = directory / f"{tag}.json"
    path.write_text(json.dumps(data))
    return path
