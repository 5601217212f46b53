"""Fit a cost profile (simharness.profile) from measured step records: the device terms from each step's device
window, the launch overlap per depth, the host phases affine in requests and tokens.

The device window of a step runs from its first kernel to its last (`gpu_end - gpu_start`), not from the launch's
end: at the real level the device starts while the host still enqueues, so the window is the step's device work
or, where the host's enqueue is the slower, the launch's end plus a tail (`max(work, launch_end + tail -
gpu_start)`). The fit models that max, so launch-bound steps bound the work from above without being mistaken for
it. Fitting is bounded robust least squares on relative errors (scipy's `least_squares`, soft-L1), with a weak
pull of every term towards the roofline's (`profile.prior_coefficients`): a term the grid cannot separate
stays at the roofline instead of wandering. The random sampling path's term is not fitted to the step's window,
where it would absorb whatever the other terms miss at the few shapes the grid samples at a temperature, but to the
sampler's own device time, measured per step (docs/calibration.md, "Profiles").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from simharness.calibration import (
    FOLDS,
    HOST_PHASES,
    MIN_STEPS_PER_TERM,
    FitData,
    fit_host,
    fit_nonneg,
    measured,
)
from simharness.jit import loaded_digest
from simharness.models import model_config
from simharness.profile import (
    ATTENTION,
    COMPUTE,
    EXPONENT,
    FIXED,
    FORMAT,
    MEMORY,
    MERGE,
    PER_FORWARD,
    POSITION,
    PREFIX_ATTENTION,
    PROPOSER,
    RANDOM,
    S_PER_BYTE,
    SAMPLER,
    TERMS,
    UNITS,
    prior_coefficients,
    profile_times,
    shape_sizes,
)
from simharness.scenario import GpuCosts, ScenarioError

PRIOR_WEIGHT = 0.01  # a term one prior width off the roofline costs as much as a 1% error on one step
ROBUST_SCALE = 0.05  # relative errors beyond this count linearly, not squared (soft-L1)
MIN_STEPS = 200
REWEIGHTINGS = 5  # of `fit_weighted` (on the grid's CPU proposer it settles after two)


def step_features(steps: pd.DataFrame) -> np.ndarray:
    """The FEATURES of each step (calibration.point_steps' rows); the random path's tokens at the point's share of
    rows sampled at a temperature."""
    x = steps[["device_rows", "device_tokens", "decode_context", "prefill_reqs", "prefill_padded"]].to_numpy(float)
    random_tokens = steps["decode_tokens"].to_numpy(float) * steps["random_fraction"].to_numpy(float)
    history = steps["history"].to_numpy(float) * steps["ngram_gpu_step"].to_numpy(float)
    return np.column_stack([x, random_tokens, history, steps[["prefill_context", "max_context"]].to_numpy(float)])


# The fitted terms: how each is searched (value = scale * parameter, or exp(parameter) for a slowdown), its bounds
# and the width of its prior, in parameter units.
SEARCH = {
    FIXED: ("linear", 1e-6, (0.0, 1e5), 200.0),  # µs
    PER_FORWARD: ("linear", 1e-6, (0.0, 1e5), 200.0),  # µs
    # a slowdown against the datasheet is at least 1: no kernel reads faster than its bandwidth or computes faster
    # than its peak (the 8B's grid otherwise trades the weight read against the per-forward time past it)
    MEMORY: ("log", 1.0, (0.0, np.log(100.0)), 1.0),
    COMPUTE: ("log", 1.0, (0.0, np.log(100.0)), 1.0),
    SAMPLER: ("log", 1.0, (0.0, np.log(100.0)), 1.0),
    PROPOSER: ("linear", 1e-9, (0.0, 1e4), 10.0),  # ns per token
    EXPONENT: ("linear", 1.0, (4.0, 16.0), 4.0),
    ATTENTION: ("log", 1.0, (0.0, np.log(100.0)), 1.0),  # no faster than the datasheet's peak
    PREFIX_ATTENTION: ("log", 1.0, (0.0, np.log(100.0)), 1.0),
    POSITION: ("linear", 1e-9, (0.0, 1e3), 20.0),  # ns a position, a layer
    MERGE: ("linear", 1e-9, (0.0, 1e4), 500.0),  # ns a partial, a layer
}
FITTED = tuple(SEARCH)  # the random path's term (RANDOM) is the sampler phase's (`fit_random_path`)
TAIL_BOUNDS_US = (0.0, 1e4)


@dataclass
class DeviceFit:
    """The fitted device coefficients (`profile.TERMS`, seconds), each depth's launch tail (seconds), the
    parameters they came from (a warm start for the k-fold refits) and the fit's cost (the robust objective)."""

    coef: np.ndarray
    tails: dict[int, float]
    params: np.ndarray
    cost: float


def fit_device(x: np.ndarray, window: np.ndarray, launch: np.ndarray | None, depth: np.ndarray,
               sizes: np.ndarray, prior: np.ndarray, start: np.ndarray | None = None,
               hold: dict[int, float] | None = None, tail_start_us: float = 100.0) -> DeviceFit:
    """Fit the device terms (FITTED; the others stay at `prior`) to each step's device `window` (seconds) from
    its FEATURES `x`. With `launch` (the launch's end less the device start, seconds: the real level), a step's
    window is modelled as max(work, launch + tail of its depth); without (hil, gated), as the work alone. `hold`
    keeps some of the FITTED terms at given values (`start` still lists every FITTED term's parameter); without
    `start`, the search starts from the prior and every tail at `tail_start_us`."""
    from scipy.optimize import least_squares  # a second to import: only when fitting

    hold = hold or {}
    prior = prior.copy()
    prior[list(hold)] = list(hold.values())
    terms = tuple(t for t in FITTED if t not in hold)
    depths = sorted(set(depth.tolist())) if launch is not None else []
    column = np.searchsorted(depths, depth) if depths else None
    kinds = [SEARCH[t] for t in terms]
    theta0 = np.array([np.log(prior[t]) if kind == "log" else prior[t] / scale
                       for t, (kind, scale, _, _) in zip(terms, kinds, strict=True)] + [tail_start_us] * len(depths))
    lower = np.array([b[0] for _, _, b, _ in kinds] + [TAIL_BOUNDS_US[0]] * len(depths))
    upper = np.array([b[1] for _, _, b, _ in kinds] + [TAIL_BOUNDS_US[1]] * len(depths))
    widths = np.array([w for _, _, _, w in kinds])
    prior_theta = theta0[: len(terms)]

    def coefficients(theta: np.ndarray) -> np.ndarray:
        coef = prior.copy()
        for t, (kind, scale, _, _), p in zip(terms, kinds, theta, strict=False):
            coef[t] = np.exp(p) if kind == "log" else p * scale
        return coef

    def predict(theta: np.ndarray) -> np.ndarray:
        work = profile_times(coefficients(theta), sizes, x)
        if launch is None:
            return work
        tails = theta[len(terms):] * 1e-6
        return np.maximum(work, launch + tails[column])

    def residuals(theta: np.ndarray) -> np.ndarray:
        pull = PRIOR_WEIGHT * (theta[: len(terms)] - prior_theta) / widths
        return np.concatenate([predict(theta) / window - 1.0, pull])

    if start is not None:
        start = np.delete(start, [FITTED.index(t) for t in hold])
    first = theta0 if start is None else np.clip(start, lower, upper)
    fit = least_squares(residuals, first, bounds=(lower, upper), loss="soft_l1", f_scale=ROBUST_SCALE,
                        x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
    tails = {d: float(fit.x[len(terms) + i] * 1e-6) for i, d in enumerate(depths)}
    return DeviceFit(coefficients(fit.x), tails, fit.x, float(fit.cost))


# The fit's cost is not convex in the launch tails (a step's window is the larger of its work and the launch's end
# plus the tail), and the per-forward time and the weight reads, both paid once a forward, trade off where the grid's
# KV reads do not pin the memory slowdown: the fit starts from several tails and reports the near-equal optima
# (docs/calibration.md, "A robust device fit").
TAIL_STARTS_US = (100.0, 1.0, 300.0, 1000.0, 3000.0)  # the first is the default start
TIE = 1e-4  # another start's fit replaces the default start's only where its cost is lower by more than this
NEAR_COST = 0.01  # a fit within 1% of the best fit's cost is a near-equal optimum
SCAN = (0.0, 0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 3.0)  # per-forward times held, as multiples of the best fit's


def fit_device_starts(x: np.ndarray, window: np.ndarray, launch: np.ndarray | None, depth: np.ndarray,
                      sizes: np.ndarray, prior: np.ndarray) -> tuple[DeviceFit, list[DeviceFit]]:
    """`fit_device` started with every launch tail at each of TAIL_STARTS_US (once without `launch`): the best fit
    and all of them."""
    fits = [fit_device(x, window, launch, depth, sizes, prior, tail_start_us=t)
            for t in (TAIL_STARTS_US if launch is not None else TAIL_STARTS_US[:1])]
    best = min(fits, key=lambda f: f.cost)
    return (best if best.cost < fits[0].cost * (1 - TIE) else fits[0]), fits


def near_equal_optima(x: np.ndarray, window: np.ndarray, launch: np.ndarray | None, depth: np.ndarray,
                      sizes: np.ndarray, prior: np.ndarray, best: DeviceFit, starts: list[DeviceFit]) -> dict:
    """What the fits within NEAR_COST of the best fit's cost span, which the grid cannot tell apart: the per-forward
    time and the efficiencies (memory, linear layers, attention) that go with it (fits with the per-forward time held
    at each of SCAN times the best fit's, at least 100 µs) and each depth's launch tail (the fits of the other
    `starts`)."""
    unit = max(best.coef[PER_FORWARD], 100e-6)
    held = [fit_device(x, window, launch, depth, sizes, prior, best.params, hold={PER_FORWARD: f * unit})
            for f in SCAN]
    near = [f for f in [best, *held] if f.cost <= best.cost * (1 + NEAR_COST)]
    near_tails = [f for f in [best, *starts] if f.cost <= best.cost * (1 + NEAR_COST)]
    span = lambda values: [float(min(values)), float(max(values))]  # noqa: E731
    return {"within_cost": NEAR_COST,
            "per_forward_us": span([f.coef[PER_FORWARD] * 1e6 for f in near]),
            "memory_efficiency": span([1 / f.coef[MEMORY] for f in near]),
            "compute_efficiency": span([1 / f.coef[COMPUTE] for f in near]),
            "attention_efficiency": span([1 / f.coef[ATTENTION] for f in near]),
            "prefix_attention_efficiency": span([1 / f.coef[PREFIX_ATTENTION] for f in near]),
            "tail_us": {d: span([f.tails[d] * 1e6 for f in near_tails]) for d in best.tails}}


def predict_window(fit: DeviceFit, x: np.ndarray, launch: np.ndarray | None, depth: np.ndarray,
                   sizes: np.ndarray) -> np.ndarray:
    """The device window a fit gives each step (as `fit_device` models it)."""
    work = profile_times(fit.coef, sizes, x)
    if launch is None:
        return work
    return np.maximum(work, launch + np.array([fit.tails[d] for d in depth.tolist()]))


def device_samples(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps whose device window was measured (finite, positive), with their launch start."""
    measured = steps["measured"].str.split(",").map(lambda m: "gpu" in m).astype(bool)
    window = steps["gpu_end_s"] - steps["gpu_start_s"]
    ok = steps[measured & np.isfinite(window) & (window > 0)].copy()
    ok["window_s"] = ok["gpu_end_s"] - ok["gpu_start_s"]
    ok["launch_start_s"] = ok["launch_end_s"] - ok["launch_s"]
    return ok


def fit_overlap(ok: pd.DataFrame, tails: dict[int, float], censored: bool,
                launch_bound: np.ndarray) -> dict[int, dict[str, float]]:
    """Per depth: the device's lead after the launch starts (median over the steps that found the device idle at
    their launch's start, so that the lead is not a wait for the previous step), the fitted tail and how many steps
    the fit has the launch's end bound (`launch_bound`): with none, nothing measured the tail, which stays where the
    fit started it."""
    idle = ok[ok["prev_gpu_end_s"].isna() | (ok["prev_gpu_end_s"] <= ok["launch_start_s"])]
    lead_all = float(np.median(idle["gpu_start_s"] - idle["launch_start_s"])) if len(idle) else 0.0
    out = {}
    for depth in sorted(set(ok["depth"].astype(int))):
        at = idle[idle["depth"] == depth]
        lead = float(np.median(at["gpu_start_s"] - at["launch_start_s"])) if len(at) else lead_all
        out[depth] = {"lead_us": max(lead, 0.0) * 1e6, "tail_us": tails.get(depth, 0.0) * 1e6 if censored else 0.0,
                      "idle_steps": int(len(at)),
                      "launch_bound_steps": int(launch_bound[ok["depth"].to_numpy(int) == depth].sum())}
    return out


def fold_masks(n: int, folds: int = FOLDS, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(training mask, held-out indices) of each of `folds` random folds over `n` samples."""
    order = np.random.default_rng(seed).permutation(n)
    for fold in np.array_split(order, folds):
        train = np.ones(n, dtype=bool)
        train[fold] = False
        yield train, fold


def kfold_errors(x, window, launch, depth, sizes, prior, start) -> np.ndarray:
    """|predicted / measured - 1| of every step's window, each predicted by a fit on the other folds."""
    errors = np.empty(len(window))
    for train, fold in fold_masks(len(window)):
        cut = (lambda a, m: None if a is None else a[m])  # noqa: E731
        fit = fit_device(x[train], window[train], cut(launch, train), depth[train], sizes, prior, start)
        errors[fold] = np.abs(predict_window(fit, x[fold], cut(launch, fold), depth[fold], sizes) / window[fold] - 1)
    return errors


def fit_weighted(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of y on x with each sample weighted by its predicted value, iterated from the
    relative fit: for a phase whose time spans orders of magnitude and scatters in proportion, plain least squares
    lets the largest samples set every term, and dividing by the measured time biases the fit low (by about 1.5
    squared scatters: 6% at the CPU proposer's 20%)."""
    coef = fit_nonneg(x, y, relative=True)
    for _ in range(REWEIGHTINGS):
        weight = 1 / np.maximum(x @ coef, 1e-3 * np.median(y))
        coef = fit_nonneg(x * weight[:, None], y * weight, relative=False)
    return coef


def fit_weighted_phase(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
    """`fit_weighted`'s coefficients and its k-fold quality (relative error on samples each fit did not see)."""
    errors = np.empty(len(y))
    for train, fold in fold_masks(len(y)):
        errors[fold] = np.abs(x[fold] @ fit_weighted(x[train], y[train]) / y[fold] - 1)
    return fit_weighted(x, y), {"steps": len(y), "median_rel_error": float(np.median(errors)),
                                "p90_rel_error": float(np.percentile(errors, 90))}


def fit_proposer(steps: pd.DataFrame) -> tuple[np.ndarray, dict] | None:
    """The CPU proposer's host phase (`calibration.HOST_PHASES["propose"]`: per step, per request, per history
    token) by `fit_weighted`: its time spans 30 µs to 3 ms over the grid and scatters by about 20% at every size.
    Coefficients (seconds per unit) and the k-fold quality; None with too few steps."""
    features = HOST_PHASES["propose"][0]
    ok = steps[measured(steps, "propose") & np.isfinite(steps["propose_s"]) & (steps["propose_s"] > 0)]
    if len(ok) < MIN_STEPS_PER_TERM * len(features):
        return None
    return fit_weighted_phase(ok[list(features)].to_numpy(float), ok["propose_s"].to_numpy(float))


def fit_profile_host(steps: pd.DataFrame) -> tuple[dict[str, float], list[str], dict[str, dict]]:
    """`calibration.fit_host` (fitted host costs, fields kept from the scenario, per-phase quality), with the CPU
    proposer's phase from `fit_proposer`."""
    host, kept, qualities = fit_host(steps)
    fitted = fit_proposer(steps)
    if fitted is not None:
        _, fields, units = HOST_PHASES["propose"]
        host.update({f: float(c / unit) for f, c, unit in zip(fields, fitted[0], units, strict=True)})
        qualities["propose"] = fitted[1]
    return host, kept, qualities


def fit_random_path(steps: pd.DataFrame, x: np.ndarray, logit_seconds: float) -> tuple[float, dict] | None:
    """The random sampling path's extra (`random_sampler_extra`: logit reads at the datasheet's bandwidth per
    verified token sampled at a temperature) from the sampler's own device time per step (`sample_s`): a base, a
    cost per position verified (`decode_tokens`; the sampler skips a row's slots past its drafts, whatever the width)
    and prompt sampled, and one per random token (`fit_weighted`). `x` holds the steps' FEATURES,
    `logit_seconds` one position's logit read at the datasheet's bandwidth. None where the sampler was not timed
    or no step sampled at a temperature (the term then stays at the roofline's)."""
    sample = steps["sample_s"].to_numpy(float) if "sample_s" in steps else np.full(len(steps), np.nan)
    ok = np.isfinite(sample) & (sample > 0)
    if ok.sum() < MIN_STEPS_PER_TERM * 3 or not (x[ok, 5] > 0).any():
        return None
    sampled = steps["decode_tokens"].to_numpy(float)[ok] + x[ok, 3]  # each verified position, and a prompt's last
    coef, quality = fit_weighted_phase(np.column_stack([np.ones(ok.sum()), sampled, x[ok, 5]]), sample[ok])
    return float(coef[2] / logit_seconds), {**quality, "random_steps": int((x[ok, 5] > 0).sum())}


def fit_profile(data: FitData) -> dict:
    """The profile (a YAML-ready mapping) from a measured grid's steps (calibration.load_fit_data)."""
    try:
        prior = prior_coefficients(data.gpu, GpuCosts())
    except ValueError:
        raise ScenarioError(f"device {data.device!r}: field gpu: a profile needs a catalogue GPU's datasheet "
                            "(H100, H200, A100, L40S)") from None
    ok = device_samples(data.steps)
    if len(ok) < MIN_STEPS:
        raise ScenarioError(f"too few steps to fit a profile: {len(ok)} have a device window, need {MIN_STEPS}")
    sizes = shape_sizes(model_config(data.model))
    x, window = step_features(ok), ok["window_s"].to_numpy(float)
    depth = ok["depth"].to_numpy(int)
    censored = data.level == "real"
    launch = (ok["launch_end_s"] - ok["gpu_start_s"]).to_numpy(float) if censored else None
    random_path = fit_random_path(ok, x, sizes[4] * prior[S_PER_BYTE])
    if random_path is not None:  # measured in the sampler: the device fit takes it as it is
        prior[RANDOM] = random_path[0]
    fit, starts = fit_device_starts(x, window, launch, depth, sizes, prior)
    errors = kfold_errors(x, window, launch, depth, sizes, prior, fit.params)
    per_depth = {int(d): float(np.median(errors[depth == d])) for d in sorted(set(depth.tolist()))}
    # the steps whose window the device work sets (not the launch's end): the work terms alone predict them
    work = profile_times(fit.coef, sizes, x)
    bound = work > launch + np.array([fit.tails[d] for d in depth.tolist()]) if censored else np.ones(len(x), bool)
    host, kept, qualities = fit_profile_host(data.steps)
    return {
        "format": FORMAT,
        "note": f"fitted by `simharness profile` from {data.level}-level step records of a designed grid",
        "device": data.device, "gpu": data.gpu, "model": data.model, "level": data.level,
        "device_step": {name: float(fit.coef[i] / UNITS[i]) for i, name in enumerate(TERMS)},
        "efficiency": {"memory": float(1 / fit.coef[MEMORY]), "compute": float(1 / fit.coef[COMPUTE]),
                       "attention": float(1 / fit.coef[ATTENTION]),
                       "prefix_attention": float(1 / fit.coef[PREFIX_ATTENTION]),
                       "sampler": float(1 / fit.coef[SAMPLER])},
        "overlap": fit_overlap(ok, fit.tails, censored, ~bound),
        "host_costs": host,
        "kept_from_scenario": kept,
        "quality": {"device": {"steps": len(ok), "median_rel_error": float(np.median(errors)),
                               "p90_rel_error": float(np.percentile(errors, 90)),
                               "median_rel_error_by_depth": per_depth, "device_bound_steps": int(bound.sum()),
                               "device_bound_median_rel_error": float(np.median(errors[bound])) if bound.any()
                               else None,
                               "near_equal": near_equal_optima(x, window, launch, depth, sizes, prior, fit, starts)},
                    # the sampler's own time, which gives the random path's term (absent: the roofline's)
                    **({"sampler": random_path[1]} if random_path is not None else {}), **qualities},
        "validation": None,
        "provenance": {"runs": data.runs, "steps": len(data.steps), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "profile_source_digest": loaded_digest()},
    }  # fmt: skip
