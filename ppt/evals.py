"""Benchmarks through the LM Evaluation Harness: an lm-eval `LM` over the model contract, and the task presets.

The adapter scores token sequences with the model's logits; nothing is converted to Hugging Face. Every context of a
ppt-trained model starts with EOT, as every training document does (SPEC.md, "Documents and packing"); the Hugging
Face export's tokenizer adds the same EOT as BOS, so lm-eval's `HFLM` on the export scores the same tokens. A model
imported from a Hugging Face folder starts with what that folder's tokenizer puts before a text
(`ppt.model_io.context_prefix`), as `HFLM` scores it. Requests longer than `max_seq_len` keep their continuation and
lose the oldest context tokens (training rows also begin mid-document); rolling loglikelihoods use lm-eval's disjoint
windows. Generation is not supported: every preset task is scored by loglikelihood.

Presets (a row of the report averages its tasks' metric, in percent): `ppt`: LAMBADA, HellaSwag, PIQA 0-shot;
WinoGrande 5-shot; ARC-Easy and ARC-Challenge 25-shot (ARC = their mean); MMLU 5-shot. `mor` (the Mixture-of-Recursions
paper): the same tasks, all 0-shot except MMLU 5-shot.
"""

from __future__ import annotations

import difflib
import json
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ppt.common import PPTError
from ppt.loss_eval import autocast
from ppt.tokenizer import Tokenizer

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:
    raise PPTError("lm-eval is not installed: uv sync --extra eval") from exc

HUB_HINT = "check the network, or pass --include-path DIR with task YAMLs over local files (--demo-task is offline)"


@contextmanager
def hub_errors(what: str, hint: str = HUB_HINT) -> Iterator[None]:
    """Data that could not be fetched (datasets and huggingface_hub raise ConnectionError) as one PPTError line."""
    try:
        yield
    except ConnectionError as exc:
        raise PPTError(f"could not get {what} from the Hugging Face hub ({exc}); {hint}") from exc


# ---------------------------------------------------------------------------------------------------------------------
# Presets


@dataclass(frozen=True)
class Benchmark:
    """One row of the report: the mean of `metric` over `tasks` (lm-eval task or group names) at `num_fewshot`."""

    label: str
    tasks: tuple[str, ...]
    num_fewshot: int
    metric: str = "acc"


def _preset(winogrande_shots: int, arc_shots: int) -> tuple[Benchmark, ...]:
    return (
        Benchmark("LAMBADA", ("lambada_openai",), 0, "acc"),
        Benchmark("HellaSwag", ("hellaswag",), 0, "acc_norm"),
        Benchmark("PIQA", ("piqa",), 0, "acc_norm"),
        Benchmark("WinoGrande", ("winogrande",), winogrande_shots, "acc"),
        Benchmark("ARC", ("arc_easy", "arc_challenge"), arc_shots, "acc_norm"),
        Benchmark("MMLU", ("mmlu",), 5, "acc"),
    )


PROTOCOLS: dict[str, tuple[Benchmark, ...]] = {"ppt": _preset(5, 25), "mor": _preset(0, 0)}


def protocol(name: str) -> tuple[Benchmark, ...]:
    if name not in PROTOCOLS:
        raise PPTError(f"unknown protocol {name!r}; use one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def parse_tasks(spec: str, num_fewshot: int = 0) -> tuple[Benchmark, ...]:
    """`--tasks a,b:5`: one row per task, each at its `:shots` suffix or `num_fewshot`; acc_norm where it exists."""
    rows = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, shots = item.partition(":")
        if shots and not shots.isdigit():
            raise PPTError(f"--tasks entry {item!r}: the shot count after ':' must be a number, e.g. arc_easy:25")
        rows.append(Benchmark(name, (name,), int(shots) if shots else num_fewshot, metric=""))
    if not rows:
        raise PPTError("--tasks is empty; name lm-eval tasks separated by commas, e.g. --tasks hellaswag,piqa:5")
    return tuple(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Checking and running tasks


def task_manager(include_paths: Sequence[str | Path] = (), include_defaults: bool = True) -> TaskManager:
    """lm-eval's task index over its built-in tasks (unless `include_defaults=False`) and local task folders."""
    for path in include_paths:
        if not Path(path).is_dir():
            raise PPTError(f"--include-path {path} is not a directory; pass a folder holding task YAML files")
    return TaskManager(include_path=[str(p) for p in include_paths] or None, include_defaults=include_defaults)


def _output_types(manager: TaskManager, name: str, seen: set[str]) -> set[str]:
    """Output types of every leaf task under a task, group or tag name, read from the YAML index (no downloads)."""
    entry = manager.task_index[name]
    if name in seen or entry.kind.name == "PY_TASK":  # a Python class: its type is known only once built
        return set()
    seen.add(name)
    cfg = entry.cfg or {}
    if entry.kind.name == "TAG":
        return set().union(*(_output_types(manager, task, seen) for task in entry.tags))
    if entry.kind.name == "GROUP":
        found: set[str] = set()
        for child in cfg.get("task", []):
            if isinstance(child, str) and child in manager.task_index:
                found |= _output_types(manager, child, seen)
            elif isinstance(child, dict):
                found.add(child.get("output_type", "generate_until"))
        return found
    return {cfg.get("output_type", "generate_until")}


def check_tasks(manager: TaskManager, benchmarks: tuple[Benchmark, ...]) -> None:
    """Unknown names (with close valid ones) and tasks that need generation fail here, before any model work."""
    for name in [task for bench in benchmarks for task in bench.tasks]:
        if name not in manager.task_index:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise PPTError(
                f"unknown lm-eval task {name!r}{hint} (`python -m scripts.lm_eval ls tasks` lists them all; "
                "local tasks need --include-path DIR)"
            )
        generative = sorted(
            _output_types(manager, name, set()) - {"loglikelihood", "multiple_choice", "loglikelihood_rolling"}
        )
        if generative:
            raise PPTError(
                f"task {name!r} needs {', '.join(generative)}, which ppt's adapter does not support "
                "(it scores loglikelihoods only); choose multiple-choice or loglikelihood tasks"
            )


def _headline(metrics: dict[str, float], wanted: str) -> str:
    """The metric a row reports: `wanted`, else acc_norm, acc, then the first one lm-eval gave."""
    names = [name for name in metrics if not name.endswith("_stderr")]
    for name in (wanted, "acc_norm", "acc"):
        if name and name in names:
            return name
    if not names:
        raise PPTError(f"lm-eval returned no numeric metric for a task ({sorted(metrics)})")
    return names[0]


def run_benchmarks(
    lm: PPTLM,
    benchmarks: tuple[Benchmark, ...],
    manager: TaskManager,
    limit: int | float | None = None,
    bootstrap_iters: int = 1000,
) -> dict[str, Any] | None:
    """Run the benchmarks, one lm-eval call per shot count: `rows` ({label: percent}), `avg`, `metrics` (each row's
    metric) and `tasks` ({task: {"num_fewshot", "samples", "metrics"}}); None on ranks other than 0."""
    by_shots: dict[int, list[str]] = defaultdict(list)
    for bench in benchmarks:
        by_shots[bench.num_fewshot] += [t for t in bench.tasks if t not in by_shots[bench.num_fewshot]]
    per_task: dict[str, dict[str, Any]] = {}
    for shots, names in sorted(by_shots.items()):
        with hub_errors(f"the data of {', '.join(names)}"):
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=names,
                num_fewshot=shots,
                task_manager=manager,
                limit=limit,
                log_samples=False,
                bootstrap_iters=bootstrap_iters,
            )
        if out is None:  # not rank 0: rank 0 holds the results
            continue
        for name in names:
            numbers = {
                key.removesuffix(",none"): value
                for key, value in out["results"][name].items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)
            }
            per_task[name] = {"num_fewshot": shots, "samples": numbers.pop("sample_len", None), "metrics": numbers}
    if lm.rank != 0:
        return None
    rows, headline = {}, {}
    for bench in benchmarks:
        headline[bench.label] = _headline(per_task[bench.tasks[0]]["metrics"], bench.metric)
        scores = [per_task[t]["metrics"][headline[bench.label]] for t in bench.tasks]
        rows[bench.label] = 100 * sum(scores) / len(scores)
    return {"rows": rows, "avg": sum(rows.values()) / len(rows), "metrics": headline, "tasks": per_task, "limit": limit}


# ---------------------------------------------------------------------------------------------------------------------
# Local tasks: a multiple-choice task over a JSONL file, and the offline demo built from passages of text


def write_choice_task(examples: list[dict[str, Any]], directory: str | Path, name: str) -> None:
    """Write `<directory>/<name>.jsonl` and `<name>.yaml`, an offline multiple-choice task (`task_manager([directory])`)
    over examples {"context": str, "choices": [str, ...], "label": int}."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in examples))
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(directory / "hf_cache")},
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [
            {"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in ("acc", "acc_norm")
        ],
        "metadata": {"version": 1.0},
    }
    (directory / f"{name}.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML


DEMO_TASK = "ppt_demo_continuation"


def demo_examples(
    documents: list[str],
    n: int = 200,
    n_choices: int = 4,
    seed: int = 0,
    fits: Callable[[str], bool] = lambda choice: True,
) -> list[dict[str, Any]]:
    """Passages cut from `documents`: 40 words of context, the true next 10 words, and 10-word distractors taken
    from other passages. Passages whose 10 words do not `fit` (a model's context: a choice is never truncated) are
    left out. Deterministic for the same documents and seed."""
    passages = []
    for doc in documents:
        words = doc.split()
        for i in range(0, len(words) - 49, 50):
            if fits(" ".join(words[i + 40 : i + 50])):
                passages.append(words[i : i + 50])
    if len(passages) < n_choices:
        raise PPTError(
            f"the demo task needs at least {n_choices} passages of 50 words whose last 10 fit the model's context, "
            f"the documents hold {len(passages)}; use more text (prepare more val data)"
        )
    rng = random.Random(seed)
    examples = []
    for index in rng.sample(range(len(passages)), min(n, len(passages))):
        others = rng.sample([k for k in range(len(passages)) if k != index], n_choices - 1)
        choices = [" ".join(passages[k][40:]) for k in (index, *others)]  # lm-eval puts " " before a choice
        order = list(range(n_choices))
        rng.shuffle(order)
        examples.append(
            {"context": " ".join(passages[index][:40]), "choices": [choices[k] for k in order], "label": order.index(0)}
        )
    return examples


# ---------------------------------------------------------------------------------------------------------------------
# The adapter


class PPTLM(TemplateLM):
    """lm-eval's LM over any model that honours ppt's contract: `model(idx)` returns logits (B, T, vocab)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
        max_length: int | None = None,
        prefix: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise PPTError(f"batch size must be positive, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.prefix = [tokenizer.eot_id] if prefix is None else list(prefix)  # what every context starts with
        self._device = torch.device(device) if device else next(model.parameters()).device
        self.dtype = dtype
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_seq_len
        if dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on."""
        return self.prefix[0] if self.prefix else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids after the prefix, unless `add_special_tokens=False` (or, by default, it is already there)."""
        ids = self.tokenizer.backend.encode(string, add_special_tokens=False).ids
        if add_special_tokens is False or (add_special_tokens is None and ids[: len(self.prefix)] == self.prefix):
            return ids
        return [*self.prefix, *ids]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool | None = False) -> list[tuple[float, bool]]:
        # tqdm's None: bars only on a terminal (redrawn into a log, each is one endless line), lm-eval's tokenizing too
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or None)

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool | None = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        windows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise PPTError(
                    f"a continuation of {len(continuation)} tokens exceeds the model's max length "
                    f"{self.max_length}; this task cannot be scored by this model"
                )
            windows.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
        results = self._score(windows, "loglikelihood", disable_tqdm)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        owners, windows = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string, add_special_tokens=False)
            rolling = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
            for context, predicted in map(make_disjoint_window, rolling):
                owners.append(index)
                windows.append((context + predicted, len(predicted)))
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._score(windows, "loglikelihood_rolling", disable_tqdm)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        raise PPTError(
            "generation is not supported by ppt's lm-eval adapter (it scores loglikelihoods only); "
            "choose multiple-choice or loglikelihood tasks"
        )

    @torch.no_grad()
    def _score(
        self, windows: list[tuple[list[int], int]], desc: str, disable_tqdm: bool | None
    ) -> list[tuple[float, bool]]:
        """(log P(last n tokens | those before), whether each is the argmax) per (tokens, n) window. Longest first:
        batches pad little (EOT after the tokens, unseen by causal attention) and run out of memory at once, if ever."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
        bar = tqdm(total=len(windows), desc=desc, disable=True if disable_tqdm or self.rank != 0 else None)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            chunk = [i for i in batch if windows[i][1] > 0]  # an empty continuation keeps its (0.0, True)
            if chunk:
                width = len(windows[chunk[0]][0]) - 1
                inputs = torch.full((len(chunk), width), self.eot_token_id, dtype=torch.long)
                for row, i in enumerate(chunk):
                    tokens = windows[i][0]
                    inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
                with autocast(self.device, self.dtype):
                    logits = self.model(inputs.to(self.device))
                logprobs, greedy = [], []
                for row, i in enumerate(chunk):
                    tokens, n = windows[i]
                    scored = F.log_softmax(logits[row, len(tokens) - 1 - n : len(tokens) - 1].float(), dim=-1)
                    target = torch.tensor(tokens[-n:], device=scored.device)
                    logprobs.append(scored.gather(-1, target[:, None]).sum())
                    greedy.append((scored.argmax(-1) == target).all())
                for i, logprob, is_greedy in zip(chunk, torch.stack(logprobs).tolist(), torch.stack(greedy).tolist()):
                    results[i] = (logprob, is_greedy)
            bar.update(len(batch))
        bar.close()
        return results

    # Data parallelism under torchrun: lm-eval splits the requests by rank and gathers results with these.

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        gathered = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered) if tensor.dim() == 0 else torch.cat(gathered)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def get_model_info(self) -> dict[str, Any]:
        return {"model_class": type(self.model).__name__, "tokenizer": self.tokenizer.name, "dtype": str(self.dtype)}
