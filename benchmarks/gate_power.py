"""Gate power: how often `simharness compare` fails an unchanged tree (A/A pairs: false alarms) and how often it
catches changes of known size injected into the tree, by runs per side (1, 2, 3, 5); docs/baselines.md "Gate power".

    python3 benchmarks/gate_power.py --levels sim --out results/gate                 # sim, this CPU (exact)
    python3 benchmarks/gate_power.py --levels hil real --budget-s 450 --out $OUT/gate  # the GPU machine, one call
    python3 benchmarks/gate_power.py --levels hil --scenario scenarios/hil-cpu.yaml --budget-s 120 \\
        --seed-set engine.model=tiny --seed-set engine.device=cpu --seed-set workload.num_requests=6 --out /tmp/g
    python3 benchmarks/gate_power.py --analyse /tmp/g --out /tmp/g                  # the tables again, from the pool
    python3 benchmarks/gate_power.py --pools results/gate/h100/pool-call*.tgz --base-runs 5 --threshold 0.02 \
        --out results/gate/h100/step-gate                                          # committed pools, re-analysed

Every run is a process of its own (`--worker`), as a CI job's runs are. A measured level builds a pool: process p
runs each arm once, in an order shuffled by p, until the time budget is spent. A trial of n runs a side draws 2n
distinct processes and compares the base arm's runs of n of them with the current arm's runs of the other n; its
rates are over `--trials` such draws (all of them when there are fewer). With `--base-runs B` the base side holds B
runs instead (at most the pool's processes less n), as a CI job compares its n runs with a committed baseline of B
runs (a seed's comparison keeps n a side: its pool is two or three processes). With P processes, n is at most P / 2, and
trials reuse runs, so a rate from a small pool is coarser than its trial count says (the tables give P). The sim is
deterministic: one run per arm, and the verdict is the same for any n (n copies of a run are compared as n runs).

Arms: the baseline A; the decode device step 1/2/5/10% slower; one extra host sync per step (`metadata_item`); a
per-step host allocation (500 GC-tracked objects, with a 500,000-object heap on every arm); the scheduler's host phase
10% slower; acceptance collapsed to a tenth; and each seed change reversed (base: the seed scenario after the change,
current: before it). Knobs of the scenario inject what they can; the rest is injected in the worker process
(`inject`): at sim the device costs scale exactly (the roofline's by the scenario, a cost profile's
device terms in the worker) and the replay tables keep one accepted draft count in ten; at hil
the measured device phases are scaled in virtual time; at real a device copy inside each decode step's measured span
adds the fraction of the recent mean device time per step (`_slower_steps`); at hil and real 9 in 10 of the GPU
proposer's drafts are corrupted.

Writes OUT/<level>.csv (one row per comparison, n and trial: gate verdict), OUT/power-<level>.csv (rates) and
OUT/power.md (the tables, machine and pool sizes, and each metric's run-to-run spread and each arm's change:
`spread_table`); the pool of runs stays under OUT/pool (small files only). `--pools` re-analyses pools packed as
tarballs (results/gate/h100/) without running anything: they are unpacked into a temporary folder, each one's
processes numbered after the previous ones'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simharness.compare import DIRECTION, STEP_METRICS, Run, compare_runs, load_run  # noqa: E402
from simharness.gate_report import verdict  # noqa: E402
from simharness.levels import LEVELS  # noqa: E402
from simharness.metrics import engine_metrics  # noqa: E402
from simharness.overrides import parse_sets  # noqa: E402
from simharness.profile import resolve as resolve_profile  # noqa: E402
from simharness.records import SYNC_COLUMNS  # noqa: E402
from simharness.scenario import load_scenario  # noqa: E402
from simharness.seeds import SEEDS, seed_scenario_path  # noqa: E402

RUNS_PER_SIDE = (1, 2, 3, 5)
HEAP = {"engine.gc.heap_objects": 500_000}  # every arm: the heap a per-step allocation makes the collector walk
# measured levels: one point (a value for each field hil.yaml and hil-cpu.yaml sweep), the GPU proposer (the one
# `inject` corrupts)
MEASURED = {"engine.speculation.proposer": "ngram_gpu", "scheduler.depth": 2, "scheduler.policy": "optimistic"}
KEEP = ("summary.json", "meta.json", "scenario.yaml", "requests.parquet", "emissions.parquet", "steps.parquet")


@dataclass(frozen=True)
class Arm:
    """One arm: scenario overrides and what `inject` changes in the worker; `change` says it for the tables."""

    name: str
    change: str
    overrides: dict
    inject: tuple[str, float] | None = None  # ("device", factor) | ("acceptance", kept fraction)
    seed: str | None = None  # a seed's scenario instead of the gate's


def arms(level: str, sc_path: Path, seeds: list[str]) -> dict[str, Arm]:
    base = quiet_load(sc_path, {**HEAP, **({} if level == "sim" else MEASURED)})
    h = base.engine.host_costs
    out = [Arm("A", "none (A/A)", {})]
    for pct in (1, 2, 5, 10) if level == "sim" else (2, 5, 10):
        roofline = level == "sim" and resolve_profile(base.engine) is None  # else the worker scales the profile
        out.append(Arm(f"device+{pct}%", f"decode device step {pct}% slower",
                       _device(base, 1 + pct / 100) if roofline else {}, ("device", 1 + pct / 100)))
    out += [
        Arm("extra-sync", "one extra host sync per step", {"scheduler.sync_points.add": ["metadata_item"]}),
        Arm("host-alloc", "500 GC-tracked objects allocated per step", {"engine.gc.allocations_per_step": 500}),
        Arm("schedule+10%", "scheduler host phase 10% slower",
            {"engine.host_costs.schedule_us": h.schedule_us * 1.1,
             "engine.host_costs.schedule_per_req_us": h.schedule_per_req_us * 1.1}),
        Arm("acceptance/10", "acceptance collapsed to a tenth", {}, ("acceptance", 0.1)),
    ]
    for pr in seeds:
        values = quiet_load(seed_scenario_path(pr), {}).sweep[SEEDS[pr].field]
        for side, value in (("after", values[-1]), ("before", values[0])):
            out.append(Arm(f"seed-{pr}:{side}", f"#{pr} reversed ({SEEDS[pr].title})", {SEEDS[pr].field: value},
                           seed=pr))
    return {a.name: a for a in out}


def quiet_load(path: Path, overrides: dict):
    """The scenario, without the note that an override replaces a swept field (here it always does, on purpose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_scenario(path, overrides)


def _device(sc, factor: float) -> dict:
    """Sim without a cost profile: every device cost `factor` slower (rooflines' efficiencies down, fixed costs up):
    exact. A profile's device terms are scaled in the worker (`inject`)."""
    g = sc.engine.gpu_costs
    scaled = ("step_overhead_us", "layer_latency_us", "sampler_overhead_us", "ngram_gpu_us", "ngram_gpu_per_token_ns",
              "correction_us")
    return {"engine.gpu_costs.mem_efficiency": g.mem_efficiency / factor,
            "engine.gpu_costs.compute_efficiency": g.compute_efficiency / factor,
            **{f"engine.gpu_costs.{k}": getattr(g, k) * factor for k in scaled}}


# comparisons: (name, base arm, current arm, change)
def comparisons(arm_set: dict[str, Arm]) -> list[tuple[str, str, str, str]]:
    out = [("A/A", "A", "A", arm_set["A"].change)]
    for a in arm_set.values():
        if a.seed is None and a.name != "A":
            out.append((a.name, "A", a.name, a.change))
        elif a.name.endswith(":before"):
            out.append((f"seed-{a.seed} reversed", f"seed-{a.seed}:after", a.name, a.change))
    return out


# ------------------------------------------------------------------------------------------------ the worker


@contextlib.contextmanager
def inject(kind: str | None, value: float, level: str):
    """Changes no scenario field can make, in this process only, undone on leaving."""
    undo = []

    def patch(owner, name, new):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    if kind == "acceptance" and level == "sim":
        from simharness import acceptance

        build = acceptance.build_replay

        def collapsed(*args, **kwargs):
            t = build(*args, **kwargs)  # keep one entry in ten's accepted count, none of the rest
            keep = np.arange(len(t.accepted)) % round(1 / value) == 0
            return acceptance.ReplayAcceptance(t.offset, t.valid, np.where(keep, t.accepted, 0))

        patch(acceptance, "build_replay", collapsed)
    elif kind == "acceptance":
        import torch

        from simharness.engine import decode, decode_step
        from simharness.kernels import ngram

        def corrupted(history, lengths, **kwargs):
            drafts, valid = ngram.propose_ngram(history, lengths, **kwargs)  # flip the low bit of 9 in 10 drafts
            flip = (torch.rand(drafts.shape, device=drafts.device) >= value) & (drafts >= 0)
            return torch.where(flip, drafts ^ 1, drafts), valid

        for module in (decode, decode_step):  # every caller's own name: the prefill's drafts and the step's
            patch(module, "propose_ngram", corrupted)
    elif kind == "device" and level == "sim":  # the cost profile's device terms, all but the datasheet's: exact
        from simharness import costmodel
        from simharness.profile import EXPONENT, S_PER_BYTE, S_PER_FLOP

        resolve = costmodel.resolve_profile

        def slower_profile(engine):
            p = resolve(engine)
            keep = (S_PER_BYTE, S_PER_FLOP, EXPONENT)
            return None if p is None else replace(p, coef=tuple(c if i in keep else c * value
                                                                for i, c in enumerate(p.coef)))

        patch(costmodel, "resolve_profile", slower_profile)
    elif kind == "device":
        from simharness.engine.torch_backend import TorchBackend

        run = TorchBackend.run
        if level == "hil":  # virtual time: the measured device phases, `value` times longer

            def slower(self, step):
                timing = run(self, step)
                return timing._replace(device_s=timing.device_s * value,
                                       phases_s=tuple(s * value for s in timing.phases_s),
                                       parts_s=tuple(s * value for s in timing.parts_s))

            patch(TorchBackend, "run", slower)
        else:  # wall clock: the device really spends the extra time, inside each decode step
            _slower_steps(patch, run, value - 1)
    try:
        yield
    finally:
        for owner, name, old in reversed(undo):
            setattr(owner, name, old)


def _slower_steps(patch, run, fraction: float) -> None:
    """Real level: each step's device time `fraction` longer, by `patch`ing the backend's `run` and where the work
    goes: device work enqueued inside each decode step's measured span (between its start event and its inputs'
    copy: counted in its verify phase, as a slower kernel's time would be) of `fraction` times the mean device time
    of the last steps read back, less the injection itself (measured / (1 + fraction): a fixed point at fraction x
    the base time, with no bookkeeping of which step got how much). The work is a device-to-device copy sized by the
    copy's own timing, measured warm before the run: a copy runs at the memory's bandwidth whatever the SM clock (a
    sleep kernel counts SM cycles, and the clock it was timed at is not the clock of the run: it injected 10-90% of
    its share). The steps before the first readback (two or three) get none. On a CPU, where the step runs inside
    the call, a spin of the host after each decode step."""
    from collections import deque

    import torch

    from simharness.engine.decode import DecodeLoop
    from simharness.engine.step_graph import StepGraphs
    from simharness.engine.torch_backend import TorchBackend
    from simharness.realloop import spin

    recent: deque[float] = deque(maxlen=32)  # device seconds of the last steps read back

    def extra_s() -> float:
        return fraction * float(np.mean(recent)) / (1 + fraction) if recent else 0.0

    def measured(self, s):
        timing = run(self, s)
        recent.append(timing.device_s)
        return timing

    patch(TorchBackend, "run", measured)
    if torch.cuda.is_available():
        source, target = (torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2))
        fixed_s, per_byte_s = _copy_time(source, target)
        fill = StepGraphs._fill_pads

        def filled(self, block, batch, size, k, seed):
            fill(self, block, batch, size, k, seed)
            n = min(int((extra_s() - fixed_s) / per_byte_s), COPY_BYTES)
            if batch and n > 0:  # a launch (a capture fills batch 0), once a step was read back
                target[:n].copy_(source[:n])

        patch(StepGraphs, "_fill_pads", filled)
        return
    step = DecodeLoop.step

    def stepped(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        spin(extra_s())
        return result

    patch(DecodeLoop, "step", stepped)


COPY_BYTES = 1 << 30  # the largest injected copy: 0.35 ms on an H100, a tenth of a 3.5 ms step


def _copy_time(source, target) -> tuple[float, float]:
    """A device-to-device copy's time as fixed + per-byte seconds, from the medians of five copies of 64 MiB and of
    512 MiB each (after two of each), on the warm device."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sizes, medians = (1 << 26, 1 << 29), []
    for n in sizes:
        times = []
        for i in range(7):
            start.record()
            target[:n].copy_(source[:n])
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        medians.append(float(np.median(times)))
    per_byte = (medians[1] - medians[0]) / (sizes[1] - sizes[0])
    return medians[0] - per_byte * sizes[0], per_byte


def worker(pool: Path, level: str, process: int) -> None:
    """Run every arm of the plan once, in an order shuffled by `process`, each into pool/<level>/<arm>/p<process>."""
    from simharness import results
    from simharness.runner import execute
    from simharness.scenario import sweep_points

    plan = json.loads((pool / "plan.json").read_text())
    if plan.get("pin"):
        os.sched_setaffinity(0, plan["pin"])
    arm_set = arms(level, ROOT / plan["scenario"], plan["seeds"])
    order = list(arm_set)
    random.Random(process).shuffle(order)
    for name in order:
        arm = arm_set[name]
        path = seed_scenario_path(arm.seed) if arm.seed else ROOT / plan["scenario"]
        sets = parse_sets(plan["seed_sets"] if arm.seed else plan["sets"])
        extra = {} if arm.seed else {**HEAP, **({} if level == "sim" else MEASURED)}
        sc = quiet_load(path, {**extra, **sets, **arm.overrides, "engine.level": level})
        out = pool / level / _slug(name) / f"p{process:02d}"
        t = time.perf_counter()
        try:
            with inject(*(arm.inject or (None, 0.0)), level), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_dir = execute(sc, sweep_points(sc), out, retries=0)
        except Exception:  # one arm's failure must not cost the pool the others
            traceback.print_exc()
            print(f"{level} p{process} {name}: FAILED", flush=True)
            continue
        results.combine(run_dir)  # no report: the gate reads the summary and the samples
        for p in run_dir.iterdir():
            if p.name not in KEEP:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"{level} p{process} {name}: {time.perf_counter() - t:.1f} s", flush=True)


def _cpus(text: str) -> list[int]:
    """A CPU list as taskset spells it (2-5 or 2,3,7) -> the CPU numbers, each one this machine has."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if not first.strip().isdigit() or (last and not last.strip().isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (spell it as 2-5 or 2,3,7)")
        cpus.update(range(int(first), int(last or first) + 1))
    absent = sorted(cpus - os.sched_getaffinity(0))
    if absent:
        raise ValueError(f"CPUs {absent} are not available here (have {sorted(os.sched_getaffinity(0))})")
    return sorted(cpus)


def _slug(name: str) -> str:
    return name.replace("%", "pct").replace("/", "_").replace(":", "_").replace("+", "plus")


# ------------------------------------------------------------------------------------------------ the driver


def build_pool(pool: Path, level: str, budget_s: float, max_processes: int) -> None:
    """Start worker processes one after another while the next is expected to end within the budget (the sim's
    budget is 0: exactly `max_processes`); a worker's failure ends the level's pool, not the others'."""
    start, longest = time.perf_counter(), 0.0
    for process in range(max_processes):
        left = budget_s - (time.perf_counter() - start)
        if budget_s and (left <= 0 or left < longest):
            break
        t = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(pool.resolve()), level, str(process)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        longest = max(longest, time.perf_counter() - t)
        (pool / level / f"p{process:02d}.log").write_text(done.stdout + done.stderr)
        print(f"{level}: process {process} took {time.perf_counter() - t:.0f} s", flush=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            print(f"gate_power: worker {process} at {level} failed (log in {pool / level})", file=sys.stderr)
            break


def load_pool(pool: Path, level: str, arm_set: dict[str, Arm]) -> dict[str, dict[int, object]]:
    """arm -> process -> its run (loaded once: trials reuse them)."""
    out = {}
    for name in arm_set:
        runs = {}
        for p in sorted((pool / level / _slug(name)).glob("p*")):
            run_dir = next((d for d in p.glob("*/*") if (d / "summary.json").is_file()), None)
            if run_dir is not None:
                runs[int(p.name[1:])] = with_step_metrics(load_run(run_dir), run_dir)
        out[name] = runs
    return out


def with_step_metrics(run: Run, run_dir: Path) -> Run:
    """The run, with each gated step metric (compare.STEP_METRICS) its summary.json predates computed from its
    steps.parquet by `metrics.engine_metrics`, so that an older pool is judged with them. The pools keep no
    syncs.parquet: with none, a sync of the launch phase (none of the gate's arms has one) would count as launch."""
    missing = [m for m in STEP_METRICS if m not in run.summary]
    if not missing or not (run_dir / "steps.parquet").is_file():
        return run
    steps = pd.read_parquet(run_dir / "steps.parquet")
    kept = run_dir / "syncs.parquet"
    syncs = pd.read_parquet(kept) if kept.is_file() else pd.DataFrame(columns=["point", *SYNC_COLUMNS])
    rows = [engine_metrics(steps[steps["point"] == p], syncs[syncs["point"] == p]) for p in run.summary.index]
    filled = pd.DataFrame([{m: row[m] for m in missing} for row in rows], index=run.summary.index)
    return replace(run, summary=run.summary.join(filled))


def trials(pool_runs: dict[str, dict[int, object]], base: str, current: str, n: int, count: int, seed: int = 0,
           base_runs: int | None = None):
    """Up to `count` draws of b base-arm runs and n current-arm runs from b + n distinct processes (all of them when
    there are fewer); b is n, or `base_runs` as far as the pool allows; yields (base runs, current runs)."""
    procs = sorted(set(pool_runs[base]) & set(pool_runs[current]))
    b = n if base_runs is None else max(1, min(base_runs, len(procs) - n))
    if len(procs) < b + n:
        return
    rng = random.Random(seed)
    splits = set()
    total = math.comb(len(procs), b + n) * math.comb(b + n, n)
    while len(splits) < min(count, total):
        chosen = rng.sample(procs, b + n)
        splits.add((tuple(sorted(chosen[:b])), tuple(sorted(chosen[b:]))))
    for b, c in sorted(splits):
        yield [pool_runs[base][p] for p in b], [pool_runs[current][p] for p in c]


def analyse(pool: Path, level: str, count: int, threshold: float, base_runs: int | None = None
            ) -> tuple[pd.DataFrame, str]:
    """The trials' verdicts (a row each), and the pool's `spread_table`."""
    plan = json.loads((pool / "plan.json").read_text())
    arm_set = arms(level, ROOT / plan["scenario"], plan["seeds"])
    pool_runs = load_pool(pool, level, arm_set)
    rows = []
    for name, base, current, change in comparisons(arm_set):
        history = None if arm_set[base].seed else base_runs  # a seed's few processes: n a side
        for n in RUNS_PER_SIDE if level != "sim" else (1,):
            for i, (b, c) in enumerate(trials(pool_runs, base, current, n, count, base_runs=history)):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = compare_runs(b, c, threshold=threshold)
                flagged = sorted({r.metric for r in result if r.verdict == "regression"})
                changed = sum(r.verdict not in ("same", "noise") for r in result)
                worse = [r.change_pct * (-1 if DIRECTION[r.metric][0] else 1) for r in result
                         if r.metric in DIRECTION and DIRECTION[r.metric][0] is not None and np.isfinite(r.change_pct)]
                rows.append({"level": level, "comparison": name, "change": change, "n": n, "base_runs": len(b),
                             "trial": i,
                             "processes": len(pool_runs[current]), "verdict": verdict(result),
                             "rows_changed": changed, "worst_pct": max(worse, default=0.0),
                             "regressed": " ".join(flagged)})
    if not rows:
        raise SystemExit(f"gate_power: {level}: no trial: the pool ({pool / level}) has fewer than two processes "
                         "with runs of the compared arms")
    return pd.DataFrame(rows), spread_table(pool_runs, comparisons(arm_set))


# what the spread table shows besides the gated metrics: the step records' diagnostics
SPREAD_EXTRA = ("num_steps", "gpu_busy_fraction", "mean_bubble_ms", "sync_wait_ms_per_step")


def spread_table(pool_runs: dict[str, dict[int, object]], comps: list[tuple[str, str, str, str]]) -> str:
    """Markdown: per metric, the run-to-run spread of the A arm's runs (the standard deviation of the log of a run's
    value, in %), and each comparison's change (the median over the current arm's runs against the median over the
    base arm's, in %). A change the gate can see in n runs a side is several spreads times sqrt(2 / n)."""
    def values(arm: str, metric: str) -> np.ndarray:
        return np.array([float(r.summary[metric].iloc[0]) for r in pool_runs[arm].values() if metric in r.summary])

    shown = [c for c in comps if c[0] != "A/A" and pool_runs[c[1]] and pool_runs[c[2]]]
    lines = ["| metric | spread (A) | " + " | ".join(c[0] for c in shown) + " |",
             "|---|---:|" + "---:|" * len(shown)]
    for metric in [m for m, (better, _) in DIRECTION.items() if better is not None] + list(SPREAD_EXTRA):
        a = values("A", metric)
        if len(a) < 2:
            continue
        spread = f"{100 * np.std(np.log(a), ddof=1):.2f}%" if (a > 0).all() else "n/a"
        cells = []
        for _, base, current, _ in shown:
            b, c = np.median(values(base, metric)), np.median(values(current, metric))
            cells.append(f"{100 * (c / b - 1):+.1f}%" if b else ("+0.0%" if c == b else "n/a"))
        lines.append(f"| {metric} | {spread} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unpack_pools(tarballs: list[Path], dest: Path) -> Path:
    """The pools packed in `tarballs` (each holding one `*/pool/`), as one pool under dest/pool: each tarball's
    processes of a level numbered after the previous tarballs' (`pNN`); the first tarball's plan.json."""
    pool = dest / "pool"
    offsets: dict[str, int] = {}
    for i, tarball in enumerate(tarballs):
        unpacked = dest / f"t{i}"
        with tarfile.open(tarball) as tar:
            tar.extractall(unpacked, filter="data")
        src = next(unpacked.glob("*/pool"), None)
        if src is None:
            raise SystemExit(f"gate_power: {tarball}: no */pool/ folder inside")
        if i == 0:
            pool.mkdir()
            shutil.copy(src / "plan.json", pool / "plan.json")
        for level_dir in (d for d in src.iterdir() if d.is_dir()):
            offset = offsets.get(level_dir.name, 0)
            numbers = set()
            for process in level_dir.glob("*/p*"):
                number = int(process.name[1:])
                numbers.add(number)
                target = pool / level_dir.name / process.parent.name / f"p{number + offset:02d}"
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(process, target)
            offsets[level_dir.name] = offset + max(numbers, default=-1) + 1
    return pool


def rates(trial_rows: pd.DataFrame) -> pd.DataFrame:
    g = trial_rows.groupby(["level", "comparison", "change", "n"], sort=False)
    return g.agg(trials=("trial", "size"), processes=("processes", "first"),
                 fail_rate=("verdict", lambda v: float((v == "fail").mean())),
                 flagged_rate=("rows_changed", lambda v: float((v > 0).mean())),
                 worst_pct=("worst_pct", "median")).reset_index()


def table(power: pd.DataFrame, level: str) -> str:
    """Markdown: a row per comparison, a column per n: the gate's fail rate (false alarms for A/A, detection for the
    others), then the smallest device slowdown detected in >= 95% of trials."""
    p = power[power.level == level]
    ns = sorted(p.n.unique())
    exact = level == "sim"  # also: flagged (any metric listed as changed), and the largest change for the worse
    lines = ["| comparison | change | " + " | ".join(f"n={n}" for n in ns) + (" | flagged | worst metric |" if exact
                                                                             else " |"),
             "|---|---|" + "---:|" * (len(ns) + 2 * exact)]
    for (name, change), group in p.groupby(["comparison", "change"], sort=False):
        cells = []
        for n in ns:
            row = group[group.n == n]
            cells.append(f"{row.fail_rate.iloc[0]:.1%} ({row.trials.iloc[0]})" if len(row) else "n/a")
        if exact:
            cells += [f"{group.flagged_rate.iloc[0]:.0%}", f"{group.worst_pct.iloc[0]:+.2f}%"]
        lines.append(f"| {name} | {change} | " + " | ".join(cells) + " |")
    device = p[p.comparison.str.startswith("device+")]
    smallest = []
    for n in ns:
        hit = device[(device.n == n) & (device.fail_rate >= 0.95)]
        sizes = sorted(float(c.split("+")[1].rstrip("%")) for c in hit.comparison)
        smallest.append(f"{sizes[0]:g}%" if sizes else "> 10% or n/a")
    lines.append("| smallest device slowdown failed in >= 95% | | " + " | ".join(smallest) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, metavar=("POOL", "LEVEL", "PROCESS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="where the pool, the CSVs and power.md go")
    ap.add_argument("--levels", nargs="+", choices=list(LEVELS), help="the levels to run (default: sim), or to "
                    "analyse (default: every level in the pool)")
    ap.add_argument("--scenario", type=Path, help="the gate's scenario (default: scenarios/ci.yaml at sim, "
                    "scenarios/gate-gpu.yaml at hil/real)")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override the gate's scenario")
    ap.add_argument("--seeds", nargs="*", default=list(SEEDS), choices=list(SEEDS))
    ap.add_argument("--seed-set", action="append", default=[], metavar="PATH=VALUE",
                    help="override every seed scenario (e.g. workload.num_requests=32)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="measured levels: wall time for all pools")
    ap.add_argument("--max-processes", type=int, default=10, help="measured levels: at most this many per level")
    ap.add_argument("--pin", metavar="CPUS", help="run each worker on these CPUs only (e.g. 2-5 or 2,3): a host "
                    "whose speed moves by the core a process lands on, as a CI runner pinned to its cores would")
    ap.add_argument("--trials", type=int, default=200, help="draws of runs per comparison and n (0: build the pool "
                    "only, analyse it later with --analyse)")
    ap.add_argument("--threshold", type=float, default=0.05, help="the gate's threshold (compare --threshold)")
    ap.add_argument("--analyse", type=Path, metavar="POOL_OUT", help="run nothing: the tables of OUT/pool")
    ap.add_argument("--pools", type=Path, nargs="+", metavar="TGZ", help="run nothing: the tables of the pools "
                    "packed in these tarballs, in this order (results/gate/h100/pool-call*.tgz)")
    ap.add_argument("--base-runs", type=int, metavar="B", help="the base side holds B runs (a committed baseline, "
                    "`compare --last B`) instead of n")
    args = ap.parse_args()
    if args.worker:
        pool, level, process = args.worker
        worker(Path(pool), level, int(process))
        return
    if args.out is None:
        ap.error("--out is required")
    if args.pin is not None and (args.analyse or args.pools):
        ap.error("--pin: pins the workers that build a pool; --analyse and --pools run none")
    if args.pin is not None:
        try:
            args.pin = _cpus(args.pin)
        except ValueError as e:
            ap.error(f"--pin: {e}")
    if args.base_runs is not None and args.base_runs < 1:
        ap.error(f"--base-runs: must be at least 1, got {args.base_runs}")
    with tempfile.TemporaryDirectory() as unpacked:
        if args.pools:
            missing = [str(t) for t in args.pools if not t.is_file()]
            if missing:
                ap.error(f"--pools: no such file: {', '.join(missing)}")
            pool = unpack_pools(args.pools, Path(unpacked))
        else:
            pool = (args.analyse or args.out) / "pool"
            if args.analyse is None:
                build(args, pool)
        if args.trials:
            report(args, pool)


def build(args: argparse.Namespace, pool: Path) -> None:
    """Run the worker processes of every level into `pool`."""
    args.levels = args.levels or ["sim"]
    default = "scenarios/ci.yaml" if args.levels == ["sim"] else "scenarios/gate-gpu.yaml"
    scenario = (args.scenario or ROOT / default).resolve()
    if scenario.is_relative_to(ROOT):  # the pool is analysed on another machine too
        scenario = scenario.relative_to(ROOT)
    pool.mkdir(parents=True, exist_ok=True)
    (pool / "plan.json").write_text(json.dumps({"scenario": str(scenario), "sets": args.set, "seeds": args.seeds,
                                                "seed_sets": args.seed_set, "pin": args.pin}, indent=1))
    start = time.perf_counter()
    measured = [lv for lv in args.levels if lv != "sim"]
    for level in args.levels:
        (pool / level).mkdir(exist_ok=True)
        if level == "sim":
            build_pool(pool, level, 0.0, 2)  # A/A needs two processes; every other arm is exact in one
        else:
            left = args.budget_s - (time.perf_counter() - start)
            build_pool(pool, level, left / len(measured), args.max_processes)
            measured = measured[1:]


def report(args: argparse.Namespace, pool: Path) -> None:
    """The trials of every level in `pool`: OUT/<level>.csv, OUT/power-<level>.csv and OUT/power.md."""
    levels = [lv for lv in LEVELS if (pool / lv).is_dir() and lv in (args.levels or LEVELS)]
    analysed = {lv: analyse(pool, lv, args.trials, args.threshold, args.base_runs) for lv in levels}
    trial_rows = pd.concat([rows for rows, _ in analysed.values()])
    args.out.mkdir(parents=True, exist_ok=True)
    power = rates(trial_rows)
    sides = ("runs per side n" if args.base_runs is None else
             f"n runs of the current tree against a baseline of {args.base_runs} runs (fewer where the pool lacks "
             "processes: `base_runs` in the CSV)")
    text = [f"# Gate power ({platform.node()}, {time.strftime('%Y-%m-%d')})", "",
            f"Fail rate of `compare --threshold {args.threshold:g}` (exit 1) per comparison and {sides} (trials in "
            "brackets); A/A is the false-alarm rate. `benchmarks/gate_power.py`; docs/ci.md \"The GPU gate's "
            "statistic\".", ""]
    for level in levels:
        trial_rows[trial_rows.level == level].to_csv(args.out / f"{level}.csv", index=False)
        power[power.level == level].to_csv(args.out / f"power-{level}.csv", index=False)
        device = json.loads(next((pool / level).glob("*/p*/*/*/meta.json")).read_text()).get("device")
        text += [f"## {level} ({device}; pool: {power[power.level == level].processes.max()} processes)", "",
                 table(power, level), ""]
        if level != "sim":
            text += [f"Run-to-run spread and each arm's change ({level}):", "", analysed[level][1], ""]
    (args.out / "power.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
