"""The `simharness` command line: a thin layer over the Python API.

Exit status: 0 done; 1 a regression (compare) or a tolerance exceeded (fidelity); 2 bad input, with one message
naming the field; 3 compare: a point of one run is missing in the other; 130 interrupted (finished points kept).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table

from simharness.levels import LEVELS
from simharness.overrides import parse_sets
from simharness.scenario import Scenario, ScenarioError, ScenarioNote, load_scenario, unit_notes

# Plain click help pages: `--out DIR`, not typer's rich `<path>` and `<bool>` metavars.
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
bench_app = typer.Typer(no_args_is_help=True, help="Performance benchmarks of the harness's own parts.",
                        rich_markup_mode=None)
app.add_typer(bench_app, name="bench")


class Output(Console):
    """A rich console that wraps only for a terminal: output to a file, a pipe or a CI log keeps its lines whole (a
    path, a command, a table's widest cell) where rich would cut them at 80 columns. COLUMNS still sets a width."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(UNWRAPPED, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


UNWRAPPED = 1000  # columns of output not shown in a terminal: tables at their natural width, no line cut
err = Output(stderr=True)
out = Output()


SET_HELP = ("override a field (repeatable), e.g. scheduler.depth=3; a section's value, e.g. 'workload={num_requests: "
            "8}', sets the fields it names; on a swept field it replaces the sweep; sweep.scheduler.depth=[1,2] sets a "
            "sweep")


def fail(message: str) -> None:
    """Bad input: one clear message, exit status 2, no traceback."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@contextmanager
def notes() -> Iterator[None]:
    """Print what the scenario's validation or the run notes (an override replacing a sweep, fields a level
    ignores) as one `note:` line each, and any other warning as one `warning:` line, without Python's source
    line; printed when the block ends, however it ends, except on bad input, whose one message says it all."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ScenarioNote)
        try:
            yield
        except (ScenarioError, typer.Exit) as e:
            if isinstance(e, ScenarioError) or e.exit_code == 2:
                caught.clear()
            raise
        finally:
            for note in caught:
                kind = "note" if issubclass(note.category, ScenarioNote) else "warning"
                err.print(f"[bold]{kind}:[/] {escape(str(note.message))}", highlight=False, soft_wrap=True)


def load(scenario: Path, sets: list[str]) -> Scenario:
    """The scenario with its --set overrides; what the validation notes (an override replacing a sweep, a value
    in an implausible unit) is printed."""
    with notes():
        sc = load_scenario(scenario, parse_sets(sets))
    for note in unit_notes(sc):
        err.print(f"[bold]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return sc


WorkersOption = Annotated[str | None, typer.Option(
    "--workers", metavar="N", help="run the points in N local worker processes; auto: one per CPU, or one per "
    "visible GPU (each pinned to it) when points run on CUDA")]
RayOption = Annotated[str | None, typer.Option(
    "--ray", metavar="ADDR", help="run each point as a task on a Ray cluster: local (start one here), auto, or "
    "HOST:PORT")]
ProcessOption = Annotated[bool, typer.Option(
    "--process-per-point", help="run each point in a process started for it (with --workers, --ray or alone): "
    "measured repeats then also differ by process (CUDA context, caches, heap)")]
RetriesOption = Annotated[int, typer.Option("--retries", metavar="N", help="tries after the first for a point "
                                             "whose worker dies or raises; then the point is marked failed")]


def parse_workers(value: str | None) -> int | str | None:
    """--workers: a whole number (checked >= 1 with the run's other input) or auto."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        fail(f"--workers {value!r}: expected a whole number >= 1, or auto")


class SweepBar:
    """A sweep's progress on stderr: points done of all, running, failed, elapsed, time left and the last point;
    retries and failures are printed above the bar as they happen. Keeps the last status (its run directory).
    The counts and times keep their room in a terminal of 80 columns: the title and the point id (long in a sweep
    of many fields) take what is left, cut with an ellipsis."""

    def __init__(self, title: str):
        self.title, self.status = title, None
        self.bar = Progress(
            TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                       max_width=24)),
            BarColumn(bar_width=12), MofNCompleteColumn(), TextColumn("{task.fields[state]}"), TimeElapsedColumn(),
            TextColumn("left"), TimeRemainingColumn(),
            TextColumn("{task.fields[point]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=err, transient=True, expand=True,
            disable=not err.is_terminal,  # a file or CI log gets the messages alone (a bar's exit left a blank line)
        )

    def __enter__(self) -> SweepBar:
        self.bar.__enter__()
        self.task = self.bar.add_task(self.title, total=None, point="", state="")
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, status) -> None:
        self.status = status
        if status.message:
            self.bar.console.print(f"[yellow]{escape(status.message)}[/]", highlight=False, soft_wrap=True)
        self.bar.update(self.task, total=status.total, completed=status.done, point=status.point_id,
                        state=f"{status.running} running" + (f", {status.failed} failed" if status.failed else ""))


def report_failed(summary) -> None:
    """The points that failed for good, one line each, and exit status 1."""
    if "failed" not in summary.columns or summary["failed"].isna().all():
        return
    failed = summary[summary["failed"].notna()]
    for row in failed.itertuples():
        err.print(f"[bold red]failed:[/] {escape(f'{row.point}: {row.failed}')}", highlight=False, soft_wrap=True)
    err.print(f"{len(failed)} of {len(summary)} points failed (their reasons are in summary.csv and "
              "points/*.failed.json); the others are kept; --resume retries the failed ones")
    raise typer.Exit(1)


@app.command("run")
def run_cmd(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", metavar="SCENARIO")],
    out_dir: Annotated[Path, typer.Option("--out", help="results root", metavar="DIR")] = Path("results"),
    sets: Annotated[list[str], typer.Option("--set", help=SET_HELP, metavar="KEY=VALUE")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option("--resume", help="finish the missing points of this run directory",
                                                metavar="RUN_DIR")] = None,
    workers: WorkersOption = None,
    ray: RayOption = None,
    retries: RetriesOption = 2,
    process_per_point: ProcessOption = False,
) -> None:
    """Run a scenario's sweep; print a summary table and where the report is.

    Exit status: 0 done; 1 a point failed after its retries (the others are kept); 2 bad input (one message naming
    the field; nothing written); 130 interrupted (the finished points are kept: --resume RUN_DIR finishes the rest).
    """
    from simharness.runner import run

    bar = SweepBar(scenario.stem)
    try:
        sc = load(scenario, sets)
        with notes(), bar:
            result = run(sc, out_dir, resume=resume, progress=bar, workers=parse_workers(workers), ray=ray,
                         retries=retries, process_per_point=process_per_point)
    except ScenarioError as e:
        fail(str(e))
    except KeyboardInterrupt:
        if bar.status is not None:
            where = bar.status.run_dir
            command = shlex.join(["simharness", "run", str(scenario), "--resume", str(where),
                                  *(arg for value in sets for arg in ("--set", value))])
            err.print(f"interrupted: finished points are kept in {escape(str(where))}; finish with:",
                      highlight=False, soft_wrap=True)
            err.print(escape(command), highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    ok = result.summary.drop(result.failed.index)
    out.print(summary_table(ok, [p for p in [*sc.sweep, "repeat"] if p in result.summary.columns]))
    out.print(f"report: {escape(str(result.report))}", highlight=False, soft_wrap=True)
    report_failed(result.summary)


@app.command("fidelity")
def fidelity_cmd(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file", metavar="SCENARIO")],
    levels: Annotated[str, typer.Option("--levels", help="levels to run, comma-separated; real is the reference",
                                        metavar="LEVELS")] = ",".join(LEVELS),
    out_dir: Annotated[Path, typer.Option("--out", help="results root", metavar="DIR")] = Path("results/fidelity"),
    sets: Annotated[list[str], typer.Option("--set", help=SET_HELP, metavar="KEY=VALUE")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option("--resume", help="finish the missing points of this fidelity run",
                                                metavar="RUN_DIR")] = None,
    workers: WorkersOption = None,
    ray: RayOption = None,
    retries: RetriesOption = 2,
    process_per_point: ProcessOption = False,
) -> None:
    """Run every point at each level on the same requests and seed; report each level's error against the real
    level.

    Exit status: 0 done; 1 an error exceeds the scenario's fidelity.tolerances, or a point failed; 2 bad input.
    """
    from simharness.fidelity import run_fidelity

    try:
        sc = load(scenario, sets)
        with notes(), SweepBar(f"{sc.name} fidelity") as bar:
            result = run_fidelity(sc, out_dir, levels=[lv.strip() for lv in levels.split(",") if lv.strip()],
                                  resume=resume, progress=bar, workers=parse_workers(workers), ray=ray,
                                  retries=retries, process_per_point=process_per_point)
    except ScenarioError as e:
        fail(str(e))
    table = Table(title="fidelity: |error| against the real level", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("level", "metric", "median", "worst", "worst point"):
        table.add_column(column, justify="left" if column in ("level", "metric", "worst point") else "right",
                         overflow="fold")  # the point ids share long prefixes: never cut to one
    for r in result.stats.itertuples():
        table.add_row(r.level, r.metric, f"{r.median_abs_error:.1%}", f"{r.worst_abs_error:.1%}", str(r.worst_point))
    out.print(table)
    for violation in result.violations:
        err.print(f"[bold red]tolerance exceeded:[/] {escape(str(violation))}", highlight=False, soft_wrap=True)
    out.print(f"report: {escape(str(result.report))}", highlight=False, soft_wrap=True)
    report_failed(result.summary)
    if result.violations:
        raise typer.Exit(1)


def print_fit_quality(what: str, quality: dict[str, dict]) -> None:
    """A fit's k-fold relative error per phase (calibrate, profile)."""
    table = Table(title=f"k-fold relative error on steps the fit did not see ({what})", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("phase", "steps", "median", "P90"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, q in quality.items():
        table.add_row(phase, str(q["steps"]), f"{q['median_rel_error']:.1%}", f"{q['p90_rel_error']:.1%}")
    out.print(table)


@app.command("calibrate")
def calibrate_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="hil or real run directories (fidelity runs too)",
                                                   metavar="RUN_DIR")],
    out_path: Annotated[Path, typer.Option("--out", help="the calibration YAML to write", metavar="FILE")] = Path(
        "costs.yaml"),
    level: Annotated[str | None, typer.Option("--level", help="measured level to fit: real or hil (default: real "
                                              "if any)", metavar="LEVEL")] = None,
    fit_where: Annotated[list[str], typer.Option("--fit-where", help="fit only points with these swept values "
                                                 "(repeatable)", metavar="PATH=V1,V2")] = [],  # noqa: B006
    check: Annotated[bool, typer.Option("--check", help="run the points the fit left out at the sim level, "
                                        "uncalibrated and calibrated, and print their errors against the measured "
                                        "level")] = False,
) -> None:
    """Fit the sim cost model from measured step records; print the fit's k-fold error and write a calibration
    that a scenario uses with `engine.calibration: PATH`. Exit 2 on bad input."""
    from simharness import results
    from simharness.calibration import MEASURED_LEVELS, calibrate, load_fit_data, parse_where, write_calibration
    from simharness.fidelity import check_calibration

    if level is not None and level not in MEASURED_LEVELS:
        fail(f"--level {level}: unknown level; choose {' or '.join(MEASURED_LEVELS)}")
    try:
        results.check_writable(out_path, "--out")  # before the fit, not after it
        with notes():  # a run stored with engine.backend
            data = load_fit_data(run_dirs, level=level, where=parse_where(fit_where))
        fitted = calibrate(data)
        calibration = write_calibration(fitted, out_path)
    except ScenarioError as e:
        fail(str(e))
    print_fit_quality(f"{data.level}, {data.device}, {data.model}", fitted["quality"])
    if fitted["kept_from_scenario"]:
        out.print(f"not measured, kept from the scenario: {', '.join(fitted['kept_from_scenario'])}")
    out.print(f"calibration: {escape(str(calibration))}", highlight=False, soft_wrap=True)
    if check:
        try:
            stats, run_dir, drift = check_calibration(data, calibration, calibration.parent / "check")
        except ScenarioError as e:
            fail(str(e))
        table = Table(title=f"held-out points: |error| against the {data.level} level", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        for column in ("sim", "metric", "points", "median", "worst"):
            table.add_column(column, justify="left" if column in ("sim", "metric") else "right")
        for r in stats.itertuples():
            table.add_row(r.level, r.metric, str(r.points), f"{r.median_abs_error:.1%}", f"{r.worst_abs_error:.1%}")
        out.print(table)
        out.print(f"check run: {escape(str(run_dir))}", highlight=False, soft_wrap=True)
        if drift:
            err.print(f"[yellow]warning:[/] {escape(drift)}", highlight=False, soft_wrap=True)


@app.command("profile")
def profile_cmd(
    model: Annotated[str, typer.Option("--model", help="the catalogue model to profile",
                                       metavar="MODEL")] = "llama-3.2-1b",
    grid: Annotated[Path | None, typer.Option("--grid", help="the designed grid (default: "
                                              "scenarios/profile/grid.yaml)", metavar="FILE")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="the profile YAML to write (default: simharness/"
                                                  "data/profiles/<gpu>-<model>.yaml)", metavar="FILE")] = None,
    runs: Annotated[Path, typer.Option("--runs", help="results root of the grid's run",
                                       metavar="DIR")] = Path("results/profile-runs"),
    from_runs: Annotated[list[Path], typer.Option("--from", help="fit from this grid run instead of measuring "
                                                  "(repeatable)", metavar="RUN_DIR")] = [],  # noqa: B006
    sets: Annotated[list[str], typer.Option("--set", help=SET_HELP, metavar="KEY=VALUE")] = [],  # noqa: B006
) -> None:
    """Measure the designed grid at the real level on this GPU and fit the model's cost profile (physical device
    terms, launch overlap per depth, host phases); print the fit's held-out error. Exit 2 on bad input."""
    from simharness.profile_grid import GRID, measure_profile

    try:
        result = measure_profile(model, grid=grid or GRID, out=out_path, runs=runs, sets=parse_sets(sets),
                                 from_runs=from_runs)
    except ScenarioError as e:
        fail(str(e))
    p = result.profile
    print_fit_quality(f"{p['level']}, {p['device']}, {p['model']}", p["quality"])
    out.print("efficiency against the datasheet: " + ", ".join(f"{k} {v:.2f}" for k, v in p["efficiency"].items()))
    for line in result.sources:  # which blocks each grid run gave (a block measured again: its newest run)
        out.print(f"grid run {escape(line)}", highlight=False, soft_wrap=True)
    out.print(f"profile: {result.path}")


@app.command("derive-profile")
def derive_profile_cmd(
    source: Annotated[Path, typer.Argument(help="a profile measured on another part of the same chip design",
                                           metavar="PROFILE")],
    gpu: Annotated[str, typer.Option("--gpu", help="the GPU to derive it for, e.g. H200", metavar="GPU")],
    out_path: Annotated[Path | None, typer.Option("--out", help="the profile YAML to write (default: simharness/"
                                                  "data/profiles/<gpu>-<model>.yaml)", metavar="FILE")] = None,
) -> None:
    """Derive a GPU's cost profile from one measured on another part of its chip design (the H200 from the H100):
    its datasheet's rates, every fitted efficiency, overlap and host cost kept. Exit 2 on bad input; an existing
    file is never overwritten."""
    import yaml

    from simharness.profile import ProfileError, default_path, derive_profile

    try:
        data = derive_profile(source, gpu)
    except ProfileError as e:
        fail(str(e))
    path = out_path if out_path is not None else default_path(data["gpu"], data["model"])
    if path.exists():
        fail(f"--out {path}: exists; remove it or name another file")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out.print(f"profile: {path} ({data['note']})", highlight=False, soft_wrap=True)


SUMMARY_ROWS = 40  # a terminal shows this many points of a sweep; the rest are in summary.csv and the report


def summary_table(summary, swept: list[str]) -> Table:
    """The run's headline metrics, a row per point (the first SUMMARY_ROWS of a larger sweep), labelled by its swept
    values as in the report. The numbers never wrap (their two-line headers are as narrow as they are); the label
    takes the width that is left, which holds two swept values at 80 columns, and wraps between values."""
    from simharness.report import point_label

    table = Table(title="summary (latencies in ms)", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1))
    cols = [("mean\nTPOT", "mean_tpot_ms", "{:.3f}"), ("P99\nTPOT", "p99_tpot_ms", "{:.3f}"),
            ("mean\nTTFT", "mean_ttft_ms", "{:.1f}"), ("out\ntok/s", "output_throughput", "{:.0f}"),
            ("accept\n%", "acceptance_rate", "{:.1f}"), ("GPU\nbusy", "gpu_busy_fraction", "{:.2f}"),
            ("syncs\n/step", "syncs_per_step", "{:.2f}")]
    table.add_column("point", overflow="fold")
    for title, _, _ in cols:
        table.add_column(title, justify="right", no_wrap=True)
    for _, row in summary.head(SUMMARY_ROWS).iterrows():
        label = point_label(row, swept) or row["point"]
        table.add_row(label, *(fmt.format(row[key]) if key in row else "" for _, key, fmt in cols))
    if len(summary) > SUMMARY_ROWS:
        table.caption = f"the first {SUMMARY_ROWS} of {len(summary)} points; all of them: summary.csv, report.md"
    return table


@app.command("report")
def report_cmd(run_dir: Annotated[Path, typer.Argument(help="a run directory", metavar="RUN_DIR")]) -> None:
    """Re-render a run directory's report (and its combined tables) from its points.

    Exit status: 0 done; 2 not a run directory, or one that cannot be written.
    """
    from simharness import results
    from simharness.runner import combine_and_report

    try:
        with notes():  # a run stored with engine.backend
            results.load_run_scenario(run_dir)
        if (run_dir / "fidelity.json").is_file():  # a fidelity run's report
            from simharness.fidelity import write_fidelity

            report = write_fidelity(run_dir).report
        else:
            combine_and_report(run_dir)
            report = run_dir / "report.md"
    except ScenarioError as e:
        fail(str(e))
    out.print(f"report: {escape(str(report))}", highlight=False, soft_wrap=True)


@app.command("frontier")
def frontier_cmd(
    run_dir: Annotated[Path, typer.Argument(help="a run directory sweeping engine.speculation.k and the load",
                                            metavar="RUN_DIR")],
    schedule_out: Annotated[Path | None, typer.Option("--schedule", help="also write the derived k schedules "
                                                      "(YAML: per group, the speculation fields to set)",
                                                      metavar="FILE")] = None,
) -> None:
    """The speculation frontier of a run: per load the best k for throughput and for TPOT, where speculation stops
    paying, and the k schedule derived from it; writes frontier.csv and plots/frontier.png into the run.

    Exit status: 0 done; 2 not a run directory, or one whose sweep lacks k or a load.
    """
    import yaml

    from simharness.frontier import crossover_text, group_label, write_frontier

    try:
        with notes():  # a run stored with engine.backend
            fr, schedules = write_frontier(run_dir)
    except ScenarioError as e:
        fail(str(e))
    for row in fr.crossovers.to_dict("records"):
        label = group_label(row, fr.groups)
        stops = {m: crossover_text(row, m) for m in ("throughput", "tpot")}
        out.print(f"{label}: speculation stops paying at {fr.load.rsplit('.', 1)[-1]} {stops['throughput']} "
                  f"(throughput), {stops['tpot']} (TPOT); --set 'engine.speculation.k_schedule={schedules[label]}' "
                  f"--set engine.speculation.k={max(schedules[label].values())}", highlight=False, soft_wrap=True)
    if schedule_out is not None:
        snippets = {label: {"k": max(s.values()), "k_schedule": s} for label, s in schedules.items()}
        try:
            schedule_out.write_text(yaml.safe_dump(snippets, sort_keys=False))
        except OSError as e:
            fail(f"--schedule {schedule_out}: cannot write ({e.strerror or e})")
    out.print(f"frontier: {run_dir / 'frontier.csv'}, {run_dir / 'plots' / 'frontier.png'}")


@app.command("compare")
def compare_cmd(
    paths: Annotated[list[Path], typer.Argument(
        help="BASE... CURRENT: baseline runs, then the current run; each a run directory, its summary.json, or a "
        "folder of run directories (all its runs)", metavar="RUN")],
    threshold: Annotated[float, typer.Option("--threshold", help="relative change that counts as a regression",
                                             metavar="FRACTION")] = 0.05,
    alpha: Annotated[float, typer.Option("--alpha", help="family significance level of the test over runs "
                                         "(several runs a side; two-sided), split over the groups of related metrics "
                                         "that vary (docs/ci.md)", metavar="P")] = 0.02,
    last: Annotated[int | None, typer.Option("--last", help="rolling baseline: the median of the N newest "
                                             "baseline runs", metavar="N")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the verdicts as JSON (with "
                                                  "benchmark lists)", metavar="FILE")] = None,
    junit_out: Annotated[Path | None, typer.Option("--junit", help="also write JUnit XML (a test case per point "
                                                   "and metric)", metavar="FILE")] = None,
    markdown_out: Annotated[Path | None, typer.Option("--markdown", help="also write the Markdown summary (e.g. "
                                                      "to $GITHUB_STEP_SUMMARY)", metavar="FILE")] = None,
    force: Annotated[bool, typer.Option("--force", help="compare runs of different scenarios or devices")] = False,
    show_all: Annotated[bool, typer.Option("--all", help="list unchanged metrics too")] = False,
) -> None:
    """Compare runs point by point: the current run against one baseline run, or against the median of several
    (a rolling baseline; with several runs the run is the unit of the significance test, docs/baselines.md).

    Exit status: 0 no regression and the same points; 1 a metric regressed; 2 bad input (or an output not
    writable); 3 no regression, but a point of one side is missing in the other (an unfinished run).
    """
    from simharness.compare import CompareError, compare_runs, load_runs, newest
    from simharness.gate_report import EXIT, junit, markdown, to_json, verdict

    if len(paths) < 2:
        fail("compare: give at least one baseline and the current run (BASE... CURRENT)")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bases = newest(load_runs(paths[:-1]), last)
            currents = load_runs(paths[-1:])
            rows = compare_runs(bases, currents, threshold=threshold, alpha=alpha, force=force)
    except CompareError as e:
        fail(str(e))
    for warning in caught:
        kind = "[bold]note:[/]" if issubclass(warning.category, ScenarioNote) else "[bold yellow]warning:[/]"
        err.print(f"{kind} {warning.message}", highlight=False, soft_wrap=True)
    sides = f"base: {len(bases)} run(s)" + (" (median)" if len(bases) > 1 else "") + f", current: {len(currents)}"
    context = f"{sides} run(s); threshold {threshold:.3g}" + (f", p < {alpha:.3g}" if len(bases) + len(currents) > 2
                                                             else "")
    text = markdown(rows, show_all=show_all, context=context)
    for target, option, content in ((json_out, "--json", lambda: json.dumps(to_json(rows, context), indent=1)),
                                    (junit_out, "--junit", lambda: junit(rows, context)),
                                    (markdown_out, "--markdown", lambda: text)):
        if target is None:
            continue
        try:
            with target.open("a" if option == "--markdown" else "w") as f:
                f.write(content())
        except OSError as e:
            fail(f"{option} {target}: cannot write ({e.strerror or e})")
    typer.echo(text)
    raise typer.Exit(EXIT[verdict(rows)])


@app.command("host-profile")
def host_profile_cmd(
    out_dir: Annotated[Path, typer.Option("--out", help="where the profile and its step timings go", metavar="DIR")]
    = Path("results/host"),
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="runs of every point, interleaved")] = 3,
    steps: Annotated[int, typer.Option("--steps", min=1, help="decode steps timed per point and run")] = 30,
) -> None:
    """Time vLLM's own scheduler and output processor on synthetic requests with speculative tokens, fit the host
    profile (per phase: per step, per request, per draft token) and write it (docs/host-costs.md). Needs vLLM.

    Exit status: 0 done; 2 vLLM missing or unsupported, or an unwritable --out.
    """
    from simharness.hostprofile import HostProfileError
    from simharness.hostspeed import HostGauge

    try:
        from simharness.vllmhost import measure_profile, vllm_version

        vllm_version()
        out_dir.mkdir(parents=True, exist_ok=True)
    except HostProfileError as e:
        fail(str(e))
    except OSError as e:
        fail(f"--out {out_dir}: cannot create it ({e.strerror or e})")
    profile, path = measure_profile(out_dir, repeats, steps)
    table = Table(title=f"vLLM {profile.vllm_version} host phases, µs ({profile.machine})", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("mode", "phase", "per step", "per request", "per token", "held-out median |error|", "worst"):
        table.add_column(column, justify="left" if column in ("mode", "phase") else "right")
    for mode, phases in profile.fits.items():
        for phase, fit in phases.items():
            per = fit.per_unit_us
            token = per.get("draft_tokens", per.get("sampled_tokens"))  # drafts scheduled; output: tokens sampled
            table.add_row(mode, phase, f"{fit.base_us:.1f}", f"{per['reqs']:.2f}", f"{token:.3f}",
                          f"{fit.median_error:.1%}", f"{fit.worst_error:.1%}")
    out.print(table)
    out.print(f"host gauge {profile.host_gauge_us:.1f} µs (now {HostGauge().fastest_s * 1e6:.1f}); profile: {path}")


@bench_app.command("kernels")
def bench_kernels(
    device: Annotated[str, typer.Option("--device", help="cpu or cuda", metavar="DEVICE")] = "cuda",
    out_dir: Annotated[Path, typer.Option("--out", help="where kernels.csv/.md go", metavar="DIR")] = Path(
        "results/kernels"),
    quick: Annotated[bool, typer.Option("--quick", help="small sizes, few repeats")] = False,
) -> None:
    """Benchmark the n-gram proposer, rejection sampler and verify step.

    Exit status: 0 done; 2 bad input (no CUDA device for --device cuda).
    """
    import torch

    from simharness.bench import kernel_tables, run_kernel_bench

    if device not in ("cpu", "cuda"):
        fail(f"--device: {device!r} is neither cpu nor cuda")
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here (use --device cpu)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {out_dir}: cannot create it ({e.strerror or e})")
    start = time.monotonic()

    def progress(what: str) -> None:  # a line a group of rows: on CPU the whole run takes minutes
        elapsed = int(time.monotonic() - start)
        err.print(f"[{elapsed // 60}:{elapsed % 60:02d}] {escape(what)}", highlight=False, soft_wrap=True)

    frame = run_kernel_bench(device, out_dir, quick=quick, progress=progress)
    for kernel, table in kernel_tables(frame):  # one per kernel: no column of another kernel's NaNs
        out.print(f"\n[bold]{kernel}[/]")
        out.print(table.to_string(index=False, na_rep="", float_format="{:.4g}".format), highlight=False)
    out.print(f"written: {escape(str(out_dir / 'kernels.md'))}", highlight=False, soft_wrap=True)


def main() -> None:
    app(prog_name="simharness")


if __name__ == "__main__":
    sys.exit(main())
