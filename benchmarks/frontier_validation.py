"""A predicted speculation frontier against a measured one on the same grid (issue 31, item 4; docs/frontier.md).

    python benchmarks/frontier_validation.py --measured results/frontier/h100-hil/1b/hil \\
        --sim profiled=results/frontier/h100-hil/1b/sim-profiled --sim none=results/frontier/h100-hil/1b/sim-none \\
        --out results/frontier/h100-hil/1b

Each directory is one written by `benchmarks/frontier.py` (points.csv, crossovers.csv). Per group (text mix) and
load: the best k for throughput and for mean TPOT, measured and predicted, how many steps of the k grid apart, and
the measured ties (every k within --tie % of the measured best: with one run per point a closer gap is not a
difference); per group and metric the crossover load, as the frontier computes it (every k > 0 worse than k = 0)
and tie-aware (no k > 0 better than k = 0 by more than --tie %), and the grid steps between predicted and
measured (no crossover counts as one step past the largest load); per point the predicted error in %. OUT gets
comparison_best_k.csv, comparison_crossovers.csv and comparison_points.csv.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from simharness.frontier import METRICS, THROUGHPUT, TPOT, K

NAMES = {THROUGHPUT: "throughput", TPOT: "tpot"}


def axes(points: pd.DataFrame) -> tuple[list[str], str]:
    """The group paths and the load path of a frontier's points.csv (the columns before k)."""
    before = list(points.columns[: list(points.columns).index(K)])
    return before[:-1], before[-1]


def better(metric: str, value: float, than: float, tie: float) -> bool:
    """Whether `value` beats `than` by more than `tie` % on `metric`."""
    gain = value / than - 1 if METRICS[metric][1] is max else 1 - value / than
    return gain * 100 > tie


def ties(at: pd.DataFrame, metric: str, tie: float) -> list[int]:
    """The ks of one load whose `metric` the best k does not beat by more than `tie` %."""
    best = at[metric].max() if METRICS[metric][1] is max else at[metric].min()
    return [int(k) for k, v in zip(at[K], at[metric], strict=True) if not better(metric, best, v, tie)]


def best_k(points: pd.DataFrame, groups: list[str], load: str, metric: str) -> pd.Series:
    """The best k per group and load."""
    pick = points.groupby([*groups, load])[metric].idxmax() if METRICS[metric][1] is max else \
        points.groupby([*groups, load])[metric].idxmin()
    return points.loc[pick.values].set_index([*groups, load])[K].astype(int)


def crossover(points: pd.DataFrame, load: str, metric: str, tie: float) -> float:
    """One group's first load at which no k > 0 beats k = 0 by more than `tie` % (tie 0: the frontier's rule
    without repeats); NaN for none."""
    for value, at in points.groupby(load, sort=True):
        base = at.loc[at[K] == 0, metric].iloc[0]
        if not any(better(metric, v, base, tie) for v in at.loc[at[K] > 0, metric]):
            return value
    return math.nan


def steps(grid: list, a: float, b: float) -> int:
    """Grid steps between two loads (or ks); NaN (none) is one step past the grid's end."""
    def index(x: float) -> int:
        return len(grid) if isinstance(x, float) and math.isnan(x) else grid.index(x)
    return abs(index(a) - index(b))


def compare(measured: pd.DataFrame, sims: dict[str, pd.DataFrame], tie: float) -> tuple[pd.DataFrame, ...]:
    """best_k, crossovers and points tables of the predictions against the measurement."""
    groups, load = axes(measured)
    kgrid, lgrid = sorted(measured[K].unique().tolist()), sorted(measured[load].unique().tolist())
    key = [*groups, load, K]
    points = measured[key + [THROUGHPUT, TPOT]].rename(columns={m: f"{NAMES[m]}_measured" for m in NAMES})
    for name, sim in sims.items():
        if sorted(sim[K].unique().tolist()) != kgrid or sorted(sim[load].unique().tolist()) != lgrid:
            raise SystemExit(f"--sim {name}: not the measured grid of k and {load}")
        points = points.merge(sim[key + [THROUGHPUT, TPOT]].rename(
            columns={m: f"{NAMES[m]}_{name}" for m in NAMES}), on=key, validate="one_to_one")
        for m in NAMES.values():
            points[f"{m}_{name}_error_pct"] = (points[f"{m}_{name}"] / points[f"{m}_measured"] - 1) * 100
    best, cross = [], []
    for metric, m in NAMES.items():
        measured_best = best_k(measured, groups, load, metric)
        predicted = {name: best_k(sim, groups, load, metric) for name, sim in sims.items()}
        for index, k in measured_best.items():
            at = measured[(measured[[*groups, load]] == pd.Series(index, [*groups, load])).all(axis=1)]
            tied = ties(at, metric, tie)
            row = {**dict(zip([*groups, load], index, strict=True)), "metric": m, "measured_best_k": k,
                   "measured_ties": " ".join(map(str, tied))}
            for name, pred in predicted.items():
                p = int(pred[index])
                row[f"{name}_best_k"] = p
                row[f"{name}_k_steps"] = steps(kgrid, p, k)
                row[f"{name}_within_one"] = row[f"{name}_k_steps"] <= 1
                row[f"{name}_within_one_of_tie"] = min(steps(kgrid, p, t) for t in tied) <= 1
            best.append(row)
        for labels, at in measured.groupby(groups, sort=False) if groups else [((), measured)]:
            labels = dict(zip(groups, labels if isinstance(labels, tuple) else (labels,), strict=True))
            row = {**labels, "metric": m, "measured": crossover(at, load, metric, 0),
                   "measured_tie_aware": crossover(at, load, metric, tie)}
            for name, sim in sims.items():
                mine = sim[(sim[groups] == pd.Series(labels)).all(axis=1)] if groups else sim
                row[name] = crossover(mine, load, metric, 0)
                row[f"{name}_tie_aware"] = crossover(mine, load, metric, tie)
                row[f"{name}_steps"] = steps(lgrid, row[name], row["measured"])
                row[f"{name}_tie_aware_steps"] = steps(lgrid, row[f"{name}_tie_aware"], row["measured_tie_aware"])
            cross.append(row)
    return pd.DataFrame(best), pd.DataFrame(cross), points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", required=True, type=Path, help="the measured frontier's directory")
    ap.add_argument("--sim", action="append", required=True, metavar="NAME=DIR", help="a predicted frontier")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tie", type=float, default=2.0, help="%% within which two ks count as a tie (default 2)")
    args = ap.parse_args()
    sims = {}
    for spec in args.sim:
        name, _, path = spec.partition("=")
        sims[name] = pd.read_csv(Path(path) / "points.csv")
    best, cross, points = compare(pd.read_csv(args.measured / "points.csv"), sims, args.tie)
    args.out.mkdir(parents=True, exist_ok=True)
    best.to_csv(args.out / "comparison_best_k.csv", index=False)
    cross.to_csv(args.out / "comparison_crossovers.csv", index=False)
    points.to_csv(args.out / "comparison_points.csv", index=False)
    for name in sims:
        for m in NAMES.values():
            share = best.loc[best.metric == m]
            err = points[f"{m}_{name}_error_pct"].abs()
            print(f"{name} {m}: best k within one step at {share[f'{name}_within_one'].sum()}/{len(share)} loads "
                  f"({share[f'{name}_within_one_of_tie'].sum()} of a measured tie); |error| median "
                  f"{err.median():.1f}%, max {err.max():.1f}%")
    print(cross.to_string(index=False))


if __name__ == "__main__":
    main()
