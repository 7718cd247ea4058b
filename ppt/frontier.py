"""The architecture verdict: IsoFLOP frontiers and the compute multiplier between architectures, with paired
jackknife intervals over seeds (Hoffmann et al. 2022, "Chinchilla", approach 2); and the paired t interval.

The method, step by step (`verdict` does all of it):

1. IsoFLOP optimum, per (architecture, budget). Each size's loss is averaged over seeds; the parabola
   loss = c0 + c1 u + c2 u^2 in u = ln(size) is fit to those means by least squares (3 sizes or more); the optimum
   is its vertex u* = -c1 / (2 c2), loss* = the parabola there. Flags: "unbracketed" when u* lies outside the sizes
   tried (the vertex is still used, but it is an extrapolation: train a size beyond it); "opens downward" when
   c2 <= 0 (no minimum: the best observed size and its mean loss are used instead). The optimum's position in
   realized comparison FLOPs, tokens and GPU-seconds: ln x fit as a line in u over that budget's sizes (seed means
   of ln x), read at u*.
2. Frontier, per architecture and unit x (FLOPs, tokens, seconds): the optima, as points (ln x*, loss*) in order of
   x, joined by straight lines. Piecewise linear rather than a power law L = a x^b: it passes through every measured
   optimum and assumes no form between budgets, where a power law with few budgets and no irreducible-loss term
   bends the frontier by its form, not by the data.
3. Compute multiplier of architecture B against baseline A at each of A's budgets C, per unit x:
   k = x_B(loss*_A(C)) / x*_A(C), where x_B(L) is the smallest x at which B's frontier reaches loss L.
   "B reaches A's frontier loss at k times A's compute" (k < 1: B is cheaper); in tokens it is the equal-token view,
   in seconds the equal-time view. A loss outside B's frontier is reached by extending B's first or last segment,
   flagged "extrapolated"; when that segment does not fall there is no crossing and k is None. A k read on a segment
   whose end is a flagged optimum of B carries that flag ("through 1e+15's unbracketed optimum"). On a frontier convex
   in ln x (as loss = E + A / x^a is) an extended first segment lies below the true frontier, so an extrapolated
   k < 1 there is too small: 0.57 for a true 0.6 on tests/test_frontier.py's Chinchilla-law study.
4. Intervals: the jackknife over seeds. Steps 1-3 are redone n times, each with one seed left out of every
   architecture's runs alike (seed i sets the data order and the initialization of every architecture, so the design
   is paired and an offset a seed gives all runs cancels in k). With v = ln k, ln size* or loss*, and v_i its value
   without seed i, the standard error is sqrt((n-1)/n * sum (v_i - mean v_i)^2) and the 95% interval is
   v -+ t(n-1, 0.975) se (for k and size* a ratio either side). For a v linear in the seed means that is exactly the
   t interval of the per-seed values; it takes n fits and no RNG. One seed: no intervals; a k with no crossing (or not
   finite) in a leave-one-out fit: none, flagged. Simulations against the alternatives are in docs/results.md ("How the
   verdict's intervals were checked"): at 3-5 seeds this interval held the true k 94-95% of the time, the percentile
   bootstrap's 72-83%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ppt.common import PPTError

UNITS = ("flops", "tokens", "seconds")


@dataclass(frozen=True)
class RunResult:
    """One finished run. `size`: the parameter count the caller compares by (non-embedding or total, one kind for
    all runs); `loss`: final val bits-per-byte; `flops`: realized comparison FLOPs; `seconds`: GPU-seconds of the run
    measured alone on the GPU (or tokens / throughput), None when not measured."""

    arch: str
    budget: float
    size: float
    seed: int
    loss: float
    flops: float
    tokens: float
    seconds: float | None = None


@dataclass
class Optimum:
    """One IsoFLOP fit: the optimum (size*, loss*), its position `at` in each unit (seconds None when not measured),
    the points it was fit to (size, mean loss, {unit: mean x}), and 95% intervals (None with one seed)."""

    arch: str
    budget: float
    size: float
    loss: float
    at: dict[str, float | None]
    flags: list[str]
    points: list[tuple[float, float, dict[str, float]]]
    size_interval: tuple[float, float] | None = None
    loss_interval: tuple[float, float] | None = None


@dataclass
class Multiplier:
    """k for `arch` against the baseline at the baseline's `budget`, in `unit`; k None: no crossing."""

    arch: str
    budget: float
    unit: str
    k: float | None
    flags: list[str]
    interval: tuple[float, float] | None = None


@dataclass
class Verdict:
    """Every optimum, and every other architecture's multiplier against `baseline` at each of its budgets."""

    baseline: str
    seeds: list[int]
    optima: list[Optimum] = field(default_factory=list)
    multipliers: list[Multiplier] = field(default_factory=list)  # none in seconds unless every run has seconds


def verdict(runs: Sequence[RunResult], baseline: str) -> Verdict:
    """Steps 1-4 of the module docstring for every architecture against `baseline`."""
    cells, seeds = _cells(runs)
    archs = sorted({arch for arch, _ in cells})
    if baseline not in archs or len(archs) < 2:
        raise PPTError(f"the verdict needs the baseline {baseline!r} and another architecture; runs hold {archs}")
    for arch in archs:
        if sum(a == arch for a, _ in cells) < 2:
            raise PPTError(f"{arch} has runs at one budget; a frontier needs at least 2 budgets: add a budget")
    n = len(seeds)
    optima, multipliers = _estimate(cells, baseline, np.ones(n))
    if n == 1:
        return Verdict(baseline, seeds, optima, multipliers)
    # seed i left out of every architecture's runs alike, so the pairing holds
    left_out = [_estimate(cells, baseline, 1 - np.eye(n)[i]) for i in range(n)]
    t = t_quantile(0.975, n - 1)
    for i, o in enumerate(optima):
        ln_sizes = [math.log(d[0][i].size) for d in left_out]
        o.size_interval = tuple(map(math.exp, _jackknife(math.log(o.size), ln_sizes, t)))
        o.loss_interval = _jackknife(o.loss, [d[0][i].loss for d in left_out], t)
    for i, m in enumerate(multipliers):
        ks = [d[1][i].k for d in left_out]
        if all(k is not None and 0 < k < math.inf for k in [m.k, *ks]):
            m.interval = tuple(map(math.exp, _jackknife(math.log(m.k), [math.log(k) for k in ks], t)))
        elif m.k is not None:
            m.flags.append("no interval: a fit with one seed left out has no crossing")
    return Verdict(baseline, seeds, optima, multipliers)


def isoflop_minimum(sizes: Sequence[float], losses: Sequence[float]) -> tuple[float, float, list[str]]:
    """(size*, loss*, flags) of the least-squares parabola of loss in ln(size): step 1 of the module docstring."""
    u = np.log(np.asarray(sizes, dtype=float))
    c2, c1, c0 = np.polyfit(u, losses, 2)
    if c2 <= 0:
        best = int(np.argmin(losses))
        return float(sizes[best]), float(losses[best]), ["opens downward"]
    vertex = -c1 / (2 * c2)
    return float(np.exp(vertex)), float(c0 - c1**2 / (4 * c2)), [] if u.min() <= vertex <= u.max() else ["unbracketed"]


def paired_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float] | None:
    """(mean over seeds of a[seed] - b[seed], low, high): the 95% t interval with n - 1 degrees of freedom on the
    per-seed differences. None with fewer than 2 seeds. Both sides must hold the same seeds."""
    if a.keys() != b.keys():
        raise PPTError(f"a paired difference needs the same seeds on both sides, got {sorted(a)} and {sorted(b)}: "
                       "run the missing seeds, or compare unpaired")  # fmt: skip
    differences = np.array([a[seed] - b[seed] for seed in sorted(a)])
    if len(differences) < 2:
        return None
    mean = float(differences.mean())
    half = t_quantile(0.975, len(differences) - 1) * differences.std(ddof=1) / math.sqrt(len(a))
    return mean, mean - float(half), mean + float(half)


# ---- the estimate on one set of seed weights -----------------------------------------------------------------------


@dataclass
class _Cell:
    sizes: np.ndarray  # (sizes,), ascending
    values: np.ndarray  # (seeds, sizes, 4): loss, ln flops, ln tokens, ln seconds (nan: not measured)


def _cells(runs: Sequence[RunResult]) -> tuple[dict[tuple[str, float], _Cell], list[int]]:
    """Runs grouped by (arch, budget), checked: finite positive numbers, one run per (size, seed), 3 sizes or more,
    every size holding every seed (the paired design)."""
    seeds, grouped = sorted({run.seed for run in runs}), {}
    for run in runs:
        numbers = (run.budget, run.size, run.loss, run.flops, run.tokens, 1.0 if run.seconds is None else run.seconds)
        if not all(math.isfinite(x) and x > 0 for x in numbers):
            raise PPTError(f"{run}: budget, size, loss, flops, tokens and seconds must be finite and positive; "
                           "leave a diverged run out and drop its size from that budget")  # fmt: skip
        by_seed = grouped.setdefault((run.arch, run.budget), {}).setdefault(run.size, {})
        if run.seed in by_seed:
            raise PPTError(f"two runs of {run.arch} at budget {run.budget:g}, size {run.size:g}, seed {run.seed}")
        by_seed[run.seed] = run
    if not grouped:
        raise PPTError("no runs to fit")
    cells = {}
    for (arch, budget), by_size in grouped.items():
        if len(by_size) < 3:
            raise PPTError(f"{arch} at budget {budget:g} has {len(by_size)} size(s); an IsoFLOP parabola needs at "
                           "least 3: train more sizes at that budget")  # fmt: skip
        for size, by_seed in by_size.items():
            if missing := sorted(set(seeds) - set(by_seed)):
                raise PPTError(f"{arch} at budget {budget:g}, size {size:g} lacks seed(s) {missing}: seeds pair the "
                               "architectures, so every run needs every seed: run them or leave them out")  # fmt: skip
        sizes = sorted(by_size)
        rows = [[by_size[size][seed] for size in sizes] for seed in seeds]
        values = [[[r.loss, math.log(r.flops), math.log(r.tokens), math.log(r.seconds or math.nan)] for r in row]
                  for row in rows]  # fmt: skip
        cells[(arch, budget)] = _Cell(np.array(sizes, dtype=float), np.array(values))
    return dict(sorted(cells.items())), seeds


def _optimum(arch: str, budget: float, cell: _Cell, weights: np.ndarray) -> Optimum:
    means = np.tensordot(weights, cell.values, axes=1) / weights.sum()  # (sizes, 4)
    size, loss, flags = isoflop_minimum(cell.sizes, means[:, 0])
    lines = np.polyfit(np.log(cell.sizes), means[:, 1:], 1)  # (slope and intercept, unit)
    at = {u: None if np.isnan(x) else float(x) for u, x in zip(UNITS, np.exp(lines[0] * math.log(size) + lines[1]))}
    points = [(float(s), float(m[0]), {u: float(math.exp(x)) for u, x in zip(UNITS, m[1:])})
              for s, m in zip(cell.sizes, means)]  # fmt: skip
    return Optimum(arch, budget, size, loss, at, flags, points)


def _estimate(cells: dict, baseline: str, weights: np.ndarray) -> tuple[list[Optimum], list[Multiplier]]:
    """Steps 1-3 of the module docstring with seed i weighted by weights[i]."""
    optima = [_optimum(arch, budget, cell, weights) for (arch, budget), cell in cells.items()]
    multipliers = []
    for arch in sorted({o.arch for o in optima} - {baseline}):
        pair = [o for o in optima if o.arch in (arch, baseline)]
        for unit in [u for u in UNITS if all(o.at[u] is not None for o in pair)]:
            optima_b = sorted((o for o in pair if o.arch == arch), key=lambda o: o.at[unit])
            frontier = [(math.log(o.at[unit]), o.loss) for o in optima_b]
            for base in (o for o in pair if o.arch == baseline):
                reached = _reach(frontier, base.loss)
                k = None if reached is None else float(np.exp(reached[0])) / base.at[unit]  # np: inf, not raise
                flags = [f"baseline {f}" for f in base.flags] + (["no crossing"] if reached is None else reached[1])
                if reached is not None:  # the flags of the two optima of B whose segment it crossed
                    flags += [f"through {o.budget:.3g}'s {f} optimum" for o in optima_b[reached[2] : reached[2] + 2]
                              for f in o.flags]  # fmt: skip
                multipliers.append(Multiplier(arch, base.budget, unit, k, flags))
    return optima, multipliers


def _reach(frontier: list[tuple[float, float]], loss: float) -> tuple[float, list[str], int] | None:
    """(ln x, flags, the segment's first point) where the piecewise-linear frontier [(ln x, loss), ...] first reaches
    `loss` (step 3)."""
    segments = list(zip(frontier, frontier[1:]))
    for i, ((x0, y0), (x1, y1)) in enumerate(segments):
        if y0 != y1 and (y0 - loss) * (y1 - loss) <= 0:
            return x0 + (loss - y0) * (x1 - x0) / (y1 - y0), [], i
    i = 0 if loss > max(y for _, y in frontier) else len(segments) - 1
    (x0, y0), (x1, y1) = segments[i]
    if y1 >= y0 or x1 == x0:
        return None
    return x0 + (loss - y0) * (x1 - x0) / (y1 - y0), ["extrapolated"], i


def _jackknife(estimate: float, left_out: list[float], t: float) -> tuple[float, float]:
    """estimate -+ t * the jackknife standard error over the n leave-one-seed-out values (step 4)."""
    half = t * math.sqrt((len(left_out) - 1) * np.var(left_out))  # var: the mean squared deviation
    return estimate - half, estimate + half


# ---- report --------------------------------------------------------------------------------------------------------


def _with_interval(value: float | None, interval: tuple[float, float] | None, form: str = ".3g") -> str:
    if value is None:
        return "n/a"
    return f"{value:{form}}" + ("" if interval is None else f" [{interval[0]:{form}}, {interval[1]:{form}}]")


def markdown(result: Verdict) -> str:
    """Two tables: each IsoFLOP optimum, and each multiplier against the baseline per budget in each unit."""
    n = len(result.seeds)
    note = f"{n} seeds, 95% leave-one-seed-out jackknife t intervals" if n > 1 else "one seed: no intervals"
    header = "| arch | budget | size* | loss* (bpb) | FLOPs | tokens | GPU-s | flags |"
    lines = [f"### IsoFLOP optima ({note})", "", header, "|---|---|---|---|---|---|---|---|"]
    for o in result.optima:
        cells = [_with_interval(o.size, o.size_interval), _with_interval(o.loss, o.loss_interval, ".4f")]
        cells += [_with_interval(o.at[u], None) for u in UNITS] + [", ".join(o.flags)]
        lines.append(f"| {o.arch} | {o.budget:.3g} | {' | '.join(cells)} |")
    lines += ["", f"### Compute multiplier k against {result.baseline} ({note})", "",
              f"k: the architecture reaches {result.baseline}'s IsoFLOP-optimal loss at k times its FLOPs, tokens or "
              "GPU-seconds (k < 1: cheaper).", "", "| arch | baseline budget | k FLOPs | k tokens | k GPU-s | notes |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    by_key = {(m.arch, m.budget, m.unit): m for m in result.multipliers}
    for arch, budget in dict.fromkeys((m.arch, m.budget) for m in result.multipliers):
        cells, notes = [], []
        for m in (by_key.get((arch, budget, unit)) for unit in UNITS):
            cells.append("not measured" if m is None else _with_interval(m.k, m.interval))
            notes += [] if m is None else [f"{m.unit}: {flag}" for flag in m.flags]
        lines.append(f"| {arch} | {budget:.3g} | {' | '.join(cells)} | {'; '.join(notes)} |")
    return "\n".join(lines) + "\n"


def plot(result: Verdict, path: Path) -> None:
    """Loss against comparison FLOPs, tokens and GPU-seconds (log x; the equal-compute, equal-token and equal-time
    views): each IsoFLOP fit's points (seed means per size), each architecture's frontier through its optima, and
    with several seeds the optima's 95% loss intervals joined as a band. A unit with no measurement is left out."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state; a Figure saves through Agg

    units = [u for u in UNITS if all(o.at[u] is not None for o in result.optima)]
    fig = Figure(figsize=(5 * len(units), 4.5))
    for i, unit in enumerate(units):
        ax = fig.add_subplot(1, len(units), i + 1, sharey=fig.axes[0] if i else None)
        for arch in dict.fromkeys(o.arch for o in result.optima):
            optima = sorted((o for o in result.optima if o.arch == arch), key=lambda o: o.at[unit])
            (line,) = ax.plot([o.at[unit] for o in optima], [o.loss for o in optima], "o-", lw=1.5, label=arch)
            points = [p for o in optima for p in o.points]
            ax.scatter([p[2][unit] for p in points], [p[1] for p in points], s=10, alpha=0.5, color=line.get_color())
            if all(o.loss_interval for o in optima):
                low, high = zip(*(o.loss_interval for o in optima))
                ax.fill_between([o.at[unit] for o in optima], low, high, color=line.get_color(), alpha=0.2)
        ax.set_xscale("log")
        ax.set_xlabel({"flops": "comparison FLOPs", "tokens": "training tokens", "seconds": "GPU-seconds"}[unit])
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].set_ylabel("val bits per byte")
    fig.axes[0].legend(fontsize=8)
    fig.suptitle("IsoFLOP points (seed means per size), the frontier through the optima, band: 95% interval of the "
                 "optimum's loss", fontsize=9)  # fmt: skip
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---- Student's t --------------------------------------------------------------------------------------------------


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function, by the modified Lentz method."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return result


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1 - front * _beta_continued_fraction(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2, 0.5)
    return 1 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, by bisection (to 1e-12)."""
    if not 0 < p < 1 or df <= 0:
        raise PPTError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2
