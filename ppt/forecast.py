"""Predicted before measured: each architecture's frontier as a saturating power law fit on a study's smaller
budgets, read at the next budget, and the prediction recorded before the runs that measure it start.

1. Frontier points: ppt.frontier's IsoFLOP optima (loss* at the realized comparison FLOPs) at the budgets below.
2. The law L(C) = E + A C^-alpha per architecture, least squares in L with E profiled: for each E in [0, min L) the
   least-squares line ln(L - E) = ln A - alpha ln C; E is the one leaving the smallest squared error in L. Three
   budgets determine the law (nothing is left to test its form); two do not (every E fits), so there E is 0: a pure
   power law, the lowest prediction of the exact fits. A fitted E at its bound 0 means the points fall faster than
   any saturating law allows (flagged).
3. At budget C: each architecture's L(C), and each other architecture's multiplier k as ppt.frontier defines it: the
   compute at which its law reaches the baseline's predicted loss, over C. (Not the trend of the measured k in ln C:
   the measured k's bias on a convex frontier changes with the budget, so that trend drifts off k on a known law.)
4. Intervals: ppt.frontier's leave-one-seed-out jackknife (its step 4), on ln k for multipliers; not the fit's
   covariance, which with 2-3 budgets has no residual degrees of freedom. They hold seed noise only, not the error of
   the law's form, which only the measurement at C shows.
5. Pre-registration: `write` records the forecast as JSON with the time it was written and the sha256 of both, and
   never replaces a file. `why_not_preregistered` names why a file cannot count as written before the top runs
   started: its content changed, or it was written or modified after they started. Keep it beside the runs (a tar
   keeps its modification time, a git checkout does not); against forgery, only the commit adding the file, pushed
   before the runs, is a public record.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from ppt import frontier
from ppt.common import PPTError, atomic_file

TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # a run record's `started`
E_STEPS, E_ROUNDS = 200, 5  # E's profile: grids of E_STEPS points, each 100 times finer than the last


@dataclass
class Law:
    """L(C) = E + A C^-alpha, C in comparison FLOPs; `flags` say where the fit is weak."""

    E: float
    A: float
    alpha: float
    flags: list[str] = field(default_factory=list)

    def loss(self, compute: float) -> float:
        return self.E + self.A * compute**-self.alpha

    def compute(self, loss: float) -> float | None:
        """The compute at which the law reaches `loss`; None where it never does."""
        return (self.A / (loss - self.E)) ** (1 / self.alpha) if loss > self.E and self.alpha > 0 else None


@dataclass
class Estimate:
    value: float | None
    interval: tuple[float, float] | None = None


@dataclass
class Forecast:
    """The prediction at `budget` from the runs at `fit_budgets`: each architecture's law and optimal loss, and each
    other architecture's k against `baseline`."""

    budget: float
    baseline: str
    seeds: list[int]
    fit_budgets: list[float]
    laws: dict[str, Law]
    loss: dict[str, Estimate]
    k: dict[str, Estimate]


def fit_law(compute: Sequence[float], loss: Sequence[float]) -> Law:
    """Step 2 of the module docstring, on frontier points (compute, loss)."""
    x, y = np.log(np.asarray(compute, dtype=float)), np.asarray(loss, dtype=float)
    if len(set(x)) < 2 or len(set(x)) < len(x):
        raise PPTError(f"a frontier law needs optima at 2 or more distinct budgets, got {list(compute)}: add a budget")
    if len(x) == 2:
        law = _law(0.0, x, y)
        law.flags.append("two budgets: E fixed at 0 (a pure power law; any E > 0 predicts a higher loss)")
    else:  # E on a grid over [0, min L), then on a finer grid around the best, E_ROUNDS times
        low, high = 0.0, float(y.min())
        for _ in range(E_ROUNDS):
            grid = low + (high - low) * np.arange(E_STEPS) / E_STEPS  # never min L itself, where ln(L - E) ends
            best = int(np.argmin(_squared_errors(grid, x, y)))
            low, high = grid[max(best - 1, 0)], grid[best] + (high - low) / E_STEPS
        law = _law(float(grid[best]), x, y)
        if law.E == 0:
            law.flags.append("E at its bound 0: the points fall faster than a saturating law allows")
        if len(x) == 3:
            law.flags.append("three budgets: the law passes through each, nothing is left to test its form")
    if law.alpha <= 0:
        law.flags.append("the frontier does not fall")
    return law


def _law(e: float, x: np.ndarray, y: np.ndarray) -> Law:
    """The law with E = e whose ln(L - E) is the least-squares line in ln C."""
    slope, intercept = np.polyfit(x, np.log(y - e), 1)
    return Law(float(e), float(math.exp(intercept)), float(-slope))


def _squared_errors(es: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The squared error in L of each E's law."""
    slope, intercept = np.polyfit(x, np.log(y[:, None] - es), 1)
    return np.sum((y[:, None] - es - np.exp(intercept + np.outer(x, slope))) ** 2, axis=0)


def predict(runs: Sequence[frontier.RunResult], baseline: str, budget: float) -> Forecast:
    """Steps 1-4 of the module docstring on the runs below `budget` (the others are left out)."""
    below = [r for r in runs if r.budget < budget]
    if not below:
        raise PPTError(f"no runs below {budget:.3g} FLOPs to predict it from: pass the smaller budgets' runs")
    result = _point(below, baseline, budget)
    if len(result.seeds) == 1:
        return result
    left_out = [_point([r for r in below if r.seed != seed], baseline, budget) for seed in result.seeds]
    t = frontier.t_quantile(0.975, len(result.seeds) - 1)
    for arch, estimate in result.loss.items():
        estimate.interval = frontier.seed_interval(estimate.value, [f.loss[arch].value for f in left_out], t)[1]
    for arch, estimate in result.k.items():
        values = [estimate.value, *(f.k[arch].value for f in left_out)]
        if all(v is not None and 0 < v < math.inf for v in values):
            estimate.interval = frontier.seed_interval(values[0], values[1:], t, ratio=True)[1]
    return result


def _point(runs: Sequence[frontier.RunResult], baseline: str, budget: float) -> Forecast:
    """Steps 1-3 on one set of runs."""
    result = frontier.verdict(runs, baseline)
    laws = {}
    for arch in sorted({o.arch for o in result.optima}, key=lambda a: (a != baseline, a)):  # the baseline first
        optima = sorted((o for o in result.optima if o.arch == arch), key=lambda o: o.budget)
        laws[arch] = fit_law([o.at["flops"] for o in optima], [o.loss for o in optima])
        laws[arch].flags += [f"{o.budget:.3g}'s optimum {flag}" for o in optima for flag in o.flags]
    loss = {arch: Estimate(law.loss(budget)) for arch, law in laws.items()}
    reached = {arch: law.compute(loss[baseline].value) for arch, law in laws.items() if arch != baseline}
    k = {arch: Estimate(None if compute is None else compute / budget) for arch, compute in reached.items()}
    return Forecast(budget, baseline, sorted({r.seed for r in runs}), sorted({r.budget for r in runs}), laws, loss, k)


def markdown(forecast: Forecast, measured: frontier.Verdict | None = None) -> str:
    """The forecast as a table; beside it, given `measured`, what the verdict found at the budget."""
    optima, ks = {}, {}
    if measured:
        optima = {o.arch: o for o in measured.optima if o.budget == forecast.budget}
        ks = {m.arch: m for m in measured.multipliers if (m.budget, m.unit) == (forecast.budget, "flops")}
    n, fit = len(forecast.seeds), ", ".join(f"{b:.3g}" for b in forecast.fit_budgets)
    lines = [f"Forecast at {forecast.budget:.3g} comparison FLOPs from the optima at {fit} ({n} seeds"
             f"{', 95% leave-one-seed-out jackknife t intervals' if n > 1 else ''}):", "",
             "| arch | law L(C) = E + A C^-alpha | loss* predicted | loss* measured | k predicted | k measured | "
             "flags |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arch, law in forecast.laws.items():
        o, m = optima.get(arch), ks.get(arch)
        cells = [f"E {law.E:.3f}, A {law.A:.4g}, alpha {law.alpha:.3f}", _shown(forecast.loss[arch], ".4f"),
                 _shown(o and Estimate(o.loss, o.loss_interval), ".4f"), _shown(forecast.k.get(arch)),
                 _shown(m and Estimate(m.k, m.interval)), "; ".join(law.flags)]  # fmt: skip
        lines.append(f"| {arch} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _shown(estimate: Estimate | None, form: str = ".3g") -> str:
    """A value and its interval; "" where there is none to show (a baseline's k), "n/a" where it was not found."""
    return "" if estimate is None else frontier.with_interval(estimate.value, estimate.interval, form)


# ---- pre-registration ----------------------------------------------------------------------------------------------


def write(forecast: Forecast, path: Path) -> None:
    """The forecast as JSON with the time and the sha256 of both (step 5); an existing file is never replaced."""
    path = Path(path)
    if path.exists():
        raise PPTError(f"{path} exists: a pre-registered forecast is written once; pass another path")
    body = {"written": datetime.now().astimezone().strftime(TIME_FORMAT), "forecast": asdict(forecast)}
    with atomic_file(path) as f:
        f.write(json.dumps(body | {"sha256": _digest(body)}, indent=1).encode())


def read(path: Path) -> tuple[Forecast, str]:
    """The forecast `write` recorded at `path`, and when it was written."""
    try:
        record = json.loads(Path(path).read_text())
        f = record["forecast"]
        estimates = {key: {a: Estimate(e["value"], e["interval"] and tuple(e["interval"])) for a, e in f[key].items()}
                     for key in ("loss", "k")}  # fmt: skip
        laws = {arch: Law(**law) for arch, law in f["laws"].items()}
        return Forecast(f["budget"], f["baseline"], f["seeds"], f["fit_budgets"], laws, **estimates), record["written"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PPTError(f"{path} is not a forecast `ppt.forecast.write` made ({exc!r}); delete it to write another "
                       "before the runs it predicts start") from exc  # fmt: skip


def why_not_preregistered(path: Path, started: str) -> str | None:
    """Why the forecast at `path` cannot count as written before the runs it predicts started at `started` (the
    earliest `started` of their run records), or None when nothing says so."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        body = {key: record[key] for key in ("written", "forecast")}
        written, start = (datetime.strptime(s, TIME_FORMAT).timestamp() for s in (record["written"], started))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PPTError(f"{path} is not a forecast `ppt.forecast.write` made, or {started!r} is no run record's "
                       f"`started` ({exc}); pass both as they were written") from exc  # fmt: skip
    if record.get("sha256") != _digest(body):
        return f"its content does not match its sha256: it was edited after it was written ({record['written']})"
    if written >= start:
        return f"it was written at {record['written']}, not before the runs started at {started}"
    if (modified := path.stat().st_mtime) >= start:
        when = datetime.fromtimestamp(modified).astimezone().strftime(TIME_FORMAT)
        return f"the file was modified at {when}, after the runs started at {started}"
    return None


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
