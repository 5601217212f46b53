"""The device fit's residuals on the grid's decode-only steps (issue 35, exploration): medians of prediction /
measured window - 1 by drafts per row (decode tokens / rows - 1, rounded) and decode rows, for the shipped profile
and for refits of the same grid under variants of the device-step model. Usage:

    python benchmarks/profile_residuals.py RUN_DIR ... [--profile PATH] [--variant NAME ...] [--write-dir DIR]
        [--by-start]

RUN_DIRs: the profile's grid runs (results/profiles/runs/<gpu>-<model>.tgz unpacked). Variants (`VARIANTS`):
`shipped` (the profile as it is, in-sample), `refit` (the fit as `profile_fit` runs it), `exponent1` (the
memory/compute overlap exponent's lower bound at 1 instead of 4), `split` (separate overlaps for the linear layers,
weights against their FLOPs, and attention, KV reads against its FLOPs), `gemm` (`split` with the linear layers'
compute efficiency growing with the tokens of the forward, tokens / (tokens + n_half)), `rows` (the shipped model
plus a cost per decode row), `interleave` (the shipped model, slower by a fitted factor on the steps whose device
starts before their launch ends), `early_rows` (the shipped model plus a cost per decode row on those steps). Each
refit prints its k-fold median / P90 |error| and its residual table; `--by-start` also splits the table by whether
the step's device started before its launch ended. With --write-dir a refit the sim can run (`refit`, `exponent1`)
is written as a profile file there, for benchmarks/validation.py with the file in place of the shipped one.
Nothing in simharness/ changes: the variants swap the fit's model for the run of this script alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simharness import profile_fit as pf
from simharness.models import model_config
from simharness.profile import (
    COMPUTE,
    EXPONENT,
    FIXED,
    MEMORY,
    PER_FORWARD,
    PROPOSER,
    RANDOM,
    S_PER_BYTE,
    S_PER_FLOP,
    SAMPLER,
    TERMS,
    UNITS,
    default_path,
    load_profile,
    prior_coefficients,
    profile_times,
    shape_sizes,
)
from simharness.profile_grid import grid_fit_data
from simharness.scenario import GpuCosts

ROW_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EXTRA_TERM = len(TERMS)  # a variant's extra coefficient (`gemm`: tokens at half peak efficiency; `rows`: s per row)
SEARCH = dict(pf.SEARCH)  # profile_fit's own search, which each variant starts from


def pnorm(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    """The overlap of two times as `profile._forward` takes it (a p-norm)."""
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    safe = np.where(hi > 0, hi, 1.0)
    return np.where(hi > 0, hi * (1 + (lo / safe) ** p) ** (1 / p), 0.0)


def split_times(coef: np.ndarray, sizes: np.ndarray, x: np.ndarray, gemm: bool = False) -> np.ndarray:
    """`profile.profile_times` with each forward as two overlaps summed: weights against linear FLOPs, KV reads
    against attention FLOPs; with `gemm`, the linear FLOPs at efficiency tokens / (tokens + coef[EXTRA_TERM])."""
    weights, kv, linear, attention, logits = sizes
    rows, tokens, context, preqs, ptokens, random_tokens, history = x.T
    m, c, p = coef[MEMORY] * coef[S_PER_BYTE], coef[COMPUTE] * coef[S_PER_FLOP], coef[EXPONENT]
    n_half = coef[EXTRA_TERM] if gemm else 0.0

    def forward(w_bytes, kv_bytes, lin_tokens, pairs):
        lin = c * linear * (lin_tokens + n_half * (lin_tokens > 0))
        return pnorm(m * w_bytes, lin, p) + pnorm(m * kv_bytes, c * attention * pairs, p)

    t = coef[FIXED] + coef[PER_FORWARD] * preqs + coef[PROPOSER] * history
    safe_rows, safe_reqs = np.maximum(rows, 1), np.maximum(preqs, 1)
    q, ctx = tokens / safe_rows, context / safe_rows
    decode = forward(weights, kv * (context + tokens), tokens, tokens * (ctx + (q + 1) / 2))
    t = t + np.where(rows > 0, coef[PER_FORWARD] + decode, 0.0)
    prefill = forward(weights * preqs, kv * ptokens, ptokens, ptokens * (ptokens / safe_reqs + 1) / 2)
    t = t + np.where(preqs > 0, prefill, 0.0)
    return t + (coef[SAMPLER] * (tokens + preqs) + coef[RANDOM] * random_tokens) * logits * coef[S_PER_BYTE]


def row_times(coef: np.ndarray, sizes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`profile.profile_times` plus a cost per decode row (per-sequence work: attention's per-row setup and
    reduction, the sampler's and acceptance's per-row kernels), which the shipped model has only through tokens."""
    return profile_times(coef[: len(TERMS)], sizes, x) + coef[EXTRA_TERM] * x[:, 0]


def interleave_times(coef: np.ndarray, sizes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`profile.profile_times` slowed by a factor 1 + coef[EXTRA_TERM] on the steps whose device starts before
    their launch ends (x's last column, `started_early`): kernels then issue at the host's pace, with gaps."""
    return profile_times(coef[: len(TERMS)], sizes, x[:, :-1]) * (1 + coef[EXTRA_TERM] * x[:, -1])


def early_row_times(coef: np.ndarray, sizes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`profile.profile_times` plus coef[EXTRA_TERM] seconds per decode row on the steps whose device starts before
    their launch ends (x's last column): host work per row that the device waits on inside the step."""
    return profile_times(coef[: len(TERMS)], sizes, x[:, :-1]) + coef[EXTRA_TERM] * x[:, 0] * x[:, -1]


# name -> (the fit's model of a step's device work, lower bound of the exponent, fits an EXTRA term)
VARIANTS = {
    "refit": (profile_times, 4.0, False),
    "exponent1": (profile_times, 1.0, False),
    "split": (split_times, 1.0, False),
    "gemm": (lambda coef, sizes, x: split_times(coef, sizes, x, gemm=True), 1.0, True),
    "rows": (row_times, 1.0, True),
    "interleave": (interleave_times, 4.0, True),
    "early_rows": (early_row_times, 4.0, True),
}
EARLY = ("interleave", "early_rows")  # the variants that read `started_early`
EXTRA = {"gemm": ("n_half", 1.0, 64.0, (0.0, 4096.0), 1e4), "rows": ("per_row_us", 1e-6, 0.0, (0.0, 1e3), 100.0),
         "interleave": ("early_slowdown", 1.0, 0.0, (0.0, 4.0), 10.0),
         "early_rows": ("early_per_row_us", 1e-6, 0.0, (0.0, 1e3), 100.0)}


def use_variant(name: str) -> None:
    """Swap profile_fit's model of the device work and its search for the variant's (this process only)."""
    model, exponent_low, extra = VARIANTS[name]
    search = dict(SEARCH)
    kind, scale, _, width = search[EXPONENT]
    search[EXPONENT] = (kind, scale, (exponent_low, 16.0), width)
    if extra:  # the extra term (EXTRA: name, scale, prior value, bounds, prior width); a wide prior: the grid decides
        _, scale, _, bounds, width = EXTRA[name]
        search[EXTRA_TERM] = ("linear", scale, bounds, width)
    pf.SEARCH, pf.FITTED, pf.profile_times = search, tuple(search), model


def residual_table(pred: np.ndarray, window: np.ndarray, steps: pd.DataFrame) -> pd.DataFrame:
    """Median prediction / window - 1 of the decode-only steps by drafts per row and decode rows (steps in [ ])."""
    decode = (steps["prefill_reqs"].to_numpy() == 0) & (steps["decode_rows"].to_numpy() > 0)
    s = steps[decode]
    frame = pd.DataFrame({
        "drafts_per_row": np.rint(s["decode_tokens"] / s["decode_rows"] - 1).astype(int),
        "rows": pd.cut(s["decode_rows"], ROW_EDGES, right=False,
                       labels=[f"{a}-{b}" for a, b in zip(ROW_EDGES, ROW_EDGES[1:], strict=False)]),
        "residual": pred[decode] / window[decode] - 1})
    grouped = frame.groupby(["drafts_per_row", "rows"], observed=True)["residual"]
    cells = grouped.median().map("{:+.0%}".format) + " [" + grouped.size().astype(str) + "]"
    return cells.unstack("rows").fillna("")


def started_early(x: np.ndarray, launch: np.ndarray) -> np.ndarray:
    """The FEATURES with a last column: 1 where the step's device started before its launch ended."""
    return np.column_stack([x, launch > 0])


def markdown(table: pd.DataFrame) -> str:
    """A table of strings as markdown, its index as the first column."""
    lines = [f"| {table.index.name} \\ rows | " + " | ".join(map(str, table.columns)) + " |",
             "|---" * (len(table.columns) + 1) + "|"]
    return "\n".join(lines + [f"| {i} | " + " | ".join(r) + " |" for i, r in table.iterrows()])


def fit_variant(name: str, x, window, launch, depth, sizes, prior) -> tuple[pf.DeviceFit, np.ndarray]:
    """The variant's best fit over the launch-tail starts and its k-fold |errors|."""
    use_variant(name)
    if name in EARLY:
        x = started_early(x, launch)
    if VARIANTS[name][2]:
        prior = np.append(prior, EXTRA[name][2] * EXTRA[name][1])
    best, _ = pf.fit_device_starts(x, window, launch, depth, sizes, prior)
    return best, pf.kfold_errors(x, window, launch, depth, sizes, prior, best.params)


def write_profile(shipped: Path, fit: pf.DeviceFit, quality: dict, out: Path) -> None:
    """The shipped profile with the refit's device terms and launch tails (lead and host costs as shipped)."""
    data = yaml.safe_load(shipped.read_text())
    data["device_step"] = {n: float(fit.coef[i] / UNITS[i]) for i, n in enumerate(TERMS)}
    data["efficiency"] = {"memory": float(1 / fit.coef[MEMORY]), "compute": float(1 / fit.coef[COMPUTE]),
                          "sampler": float(1 / fit.coef[SAMPLER])}
    for d, tail in fit.tails.items():
        data["overlap"][d]["tail_us"] = tail * 1e6
    data["quality"]["device"] = quality
    out.write_text(yaml.safe_dump(data, sort_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--profile", type=Path, help="default: the committed profile of the runs' GPU and model")
    parser.add_argument("--variant", nargs="*", default=["shipped"], choices=["shipped", *VARIANTS])
    parser.add_argument("--write-dir", type=Path)
    parser.add_argument("--by-start", action="store_true",
                        help="also the table of the steps whose device starts before their launch ends, and the rest")
    args = parser.parse_args()
    data, _ = grid_fit_data(args.runs)
    ok = pf.device_samples(data.steps)
    sizes = shape_sizes(model_config(data.model))
    x, window, depth = pf.step_features(ok), ok["window_s"].to_numpy(float), ok["depth"].to_numpy(int)
    launch = (ok["launch_end_s"] - ok["gpu_start_s"]).to_numpy(float)
    features = pd.DataFrame(x[:, :5], columns=["decode_rows", "decode_tokens", "decode_context", "prefill_reqs",
                                               "prefill_tokens"])
    shipped_path = args.profile or default_path(data.gpu, data.model)
    prior = prior_coefficients(data.gpu, GpuCosts())
    random_path = pf.fit_random_path(ok, x, sizes[4] * prior[S_PER_BYTE])
    if random_path is not None:
        prior[RANDOM] = random_path[0]
    print(f"{len(ok)} steps with a device window, {int((features['prefill_reqs'] == 0).sum())} decode-only")
    for name in args.variant:
        if name == "shipped":
            shipped = load_profile(shipped_path)
            fit = pf.DeviceFit(np.array(shipped.coef), {d: t for d, (_, t) in shipped.overlap.items()}, None, 0.0)
            errors = None
        else:
            fit, errors = fit_variant(name, x, window, launch, depth, sizes, prior)
        pred = pf.predict_window(fit, started_early(x, launch) if name in EARLY else x, launch, depth, sizes)
        extra = f", {EXTRA[name][0]}={fit.coef[EXTRA_TERM] / EXTRA[name][1]:.3g}" if name in EXTRA else ""
        print(f"\n## {name}: " + ", ".join(f"{TERMS[i]}={fit.coef[i] / UNITS[i]:.4g}" for i in range(len(TERMS)))
              + extra
              + f"; tails us {', '.join(f'{d}: {t * 1e6:.0f}' for d, t in fit.tails.items())}")
        print(f"in-sample median |error| {np.median(np.abs(pred / window - 1)):.1%}"
              + ("" if errors is None else f", k-fold median {np.median(errors):.1%} / P90 "
                 f"{np.percentile(errors, 90):.1%}"))
        print("median prediction / window - 1 of the decode-only steps [steps], drafts per row x decode rows:")
        print(markdown(residual_table(pred, window, features)))
        if args.by_start:
            for label, group in (("device starts before the launch ends", launch > 0),
                                 ("device queued behind the previous step", launch <= 0)):
                print(f"\n{label}:")
                print(markdown(residual_table(pred[group], window[group], features[group].reset_index(drop=True))))
        if args.write_dir and errors is not None and VARIANTS[name][0] is profile_times:
            args.write_dir.mkdir(parents=True, exist_ok=True)
            quality = {"steps": len(ok), "median_rel_error": float(np.median(errors)),
                       "p90_rel_error": float(np.percentile(errors, 90))}
            write_profile(shipped_path, fit, quality, args.write_dir / f"{name}.yaml")


if __name__ == "__main__":
    main()
