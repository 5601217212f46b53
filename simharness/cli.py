"""The `simharness` command line: a thin layer over the Python API."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from simharness.scenario import ScenarioError, load_scenario, parse_value

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Performance benchmarks of the harness's own parts.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True)
out = Console()


def fail(message: str) -> None:
    """Bad input: one clear message, exit status 2, no traceback."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_sets(sets: list[str]) -> dict[str, object]:
    overrides = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            fail(f"--set {item!r}: expected KEY=VALUE, e.g. --set scheduler.depth=3")
        overrides[key.strip()] = parse_value(value)
    return overrides


@app.command("run")
def run_cmd(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file")],
    out_dir: Annotated[Path, typer.Option("--out", help="results root")] = Path("results"),
    sets: Annotated[list[str], typer.Option("--set", help="override a field: KEY=VALUE (repeatable)")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option(help="finish the missing points of this run directory")] = None,
) -> None:
    """Run a scenario's sweep; print a summary table and where the report is."""
    from simharness.runner import run

    state: dict = {}
    try:
        sc = load_scenario(scenario, parse_sets(sets))
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[point]}"), console=err, transient=True,
        ) as bar:
            task = bar.add_task(sc.name, total=None, point="")

            def progress(run_dir: Path, done: int, total: int, point_id: str) -> None:
                state["run_dir"] = run_dir
                bar.update(task, total=total, completed=done, point=point_id)

            result = run(sc, out_dir, resume=resume, progress=progress)
    except ScenarioError as e:
        fail(str(e))
    except KeyboardInterrupt:
        where = state.get("run_dir")
        if where is not None:
            err.print(f"interrupted: finished points are kept in {where}; finish with "
                      f"`simharness run {scenario} --resume {where}` (and the same --set options)")
        raise typer.Exit(130) from None
    swept = [p for p in [*sc.sweep, "repeat"] if p in result.summary.columns]
    out.print(summary_table(result.summary, swept))
    out.print(f"report: {result.report}")


@app.command("fidelity")
def fidelity_cmd(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file")],
    levels: Annotated[str, typer.Option(help="levels to run, comma-separated; real is the reference")] = "sim,hil,real",
    out_dir: Annotated[Path, typer.Option("--out", help="results root")] = Path("results/fidelity"),
    sets: Annotated[list[str], typer.Option("--set", help="override a field: KEY=VALUE (repeatable)")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option(help="finish the missing points of this fidelity run")] = None,
) -> None:
    """Run every point at each level on the same requests and seed; report each level's error against the real
    level. Exit 1 when an error exceeds the scenario's fidelity.tolerances, 2 on bad input."""
    from simharness.fidelity import run_fidelity

    try:
        sc = load_scenario(scenario, parse_sets(sets))
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[point]}"), console=err, transient=True,
        ) as bar:
            task = bar.add_task(f"{sc.name} fidelity", total=None, point="")

            def progress(run_dir: Path, done: int, total: int, point_id: str) -> None:
                bar.update(task, total=total, completed=done, point=point_id)

            result = run_fidelity(sc, out_dir, levels=[lv.strip() for lv in levels.split(",") if lv.strip()],
                                  resume=resume, progress=progress)
    except ScenarioError as e:
        fail(str(e))
    table = Table(title="fidelity: |error| against the real level", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("level", "metric", "median", "worst", "worst point"):
        table.add_column(column, justify="left" if column in ("level", "metric", "worst point") else "right")
    for r in result.stats.itertuples():
        table.add_row(r.level, r.metric, f"{r.median_abs_error:.1%}", f"{r.worst_abs_error:.1%}", str(r.worst_point))
    out.print(table)
    for violation in result.violations:
        err.print(f"[bold red]tolerance exceeded:[/] {violation}", highlight=False)
    out.print(f"report: {result.report}")
    if result.violations:
        raise typer.Exit(1)


@app.command("calibrate")
def calibrate_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="hil or real run directories (fidelity runs too)")],
    out_path: Annotated[Path, typer.Option("--out", help="the calibration YAML to write")] = Path("costs.yaml"),
    level: Annotated[str | None, typer.Option(help="measured level to fit: real or hil (default: real if any)")] = None,
    fit_where: Annotated[list[str], typer.Option("--fit-where", help="fit only points with these swept values: "
                                                 "PATH=V1,V2 (repeatable)")] = [],  # noqa: B006
    check: Annotated[bool, typer.Option(help="run the points the fit left out at the sim level, uncalibrated and "
                                        "calibrated, and print their errors against the measured level")] = False,
) -> None:
    """Fit the sim cost model from measured step records; print the fit's k-fold error and write a calibration
    that a scenario uses with `engine.calibration: PATH`. Exit 2 on bad input."""
    from simharness.calibration import calibrate, check_calibration, load_fit_data, parse_where, write_calibration

    try:
        data = load_fit_data(run_dirs, level=level, where=parse_where(fit_where))
        fitted = calibrate(data)
        calibration = write_calibration(fitted, out_path)
    except ScenarioError as e:
        fail(str(e))
    table = Table(title=f"k-fold relative error on steps the fit did not see ({data.level}, {data.device}, "
                  f"{data.model})", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("phase", "steps", "median", "P90"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, q in fitted["quality"].items():
        table.add_row(phase, str(q["steps"]), f"{q['median_rel_error']:.1%}", f"{q['p90_rel_error']:.1%}")
    out.print(table)
    if fitted["kept_from_scenario"]:
        out.print(f"not measured, kept from the scenario: {', '.join(fitted['kept_from_scenario'])}")
    out.print(f"calibration: {calibration}")
    if check:
        try:
            stats, run_dir = check_calibration(data, calibration, calibration.parent / "check")
        except ScenarioError as e:
            fail(str(e))
        table = Table(title=f"held-out points: |error| against the {data.level} level", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        for column in ("sim", "metric", "points", "median", "worst"):
            table.add_column(column, justify="left" if column in ("sim", "metric") else "right")
        for r in stats.itertuples():
            table.add_row(r.level, r.metric, str(r.points), f"{r.median_abs_error:.1%}", f"{r.worst_abs_error:.1%}")
        out.print(table)
        out.print(f"check run: {run_dir}")


def summary_table(summary, swept: list[str]) -> Table:
    """The run's headline metrics, a row per point, labelled by its swept values as in the report. The numbers
    never wrap (their two-line headers are as narrow as they are); the label takes the width that is left."""
    from simharness.report import point_label

    table = Table(title="summary", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    cols = [("mean\nTPOT ms", "mean_tpot_ms", "{:.3f}"), ("P99\nTPOT ms", "p99_tpot_ms", "{:.3f}"),
            ("mean\nTTFT ms", "mean_ttft_ms", "{:.1f}"), ("out\ntok/s", "output_throughput", "{:.0f}"),
            ("accept\n%", "acceptance_rate", "{:.1f}"), ("GPU\nbusy", "gpu_busy_fraction", "{:.2f}"),
            ("syncs\n/step", "syncs_per_step", "{:.2f}")]
    table.add_column("point", overflow="fold", ratio=1)
    for title, _, _ in cols:
        table.add_column(title, justify="right", no_wrap=True)
    for _, row in summary.iterrows():
        label = point_label(row, swept) or row["point"]
        table.add_row(label, *(fmt.format(row[key]) if key in row else "" for _, key, fmt in cols))
    return table


@app.command("report")
def report_cmd(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Re-render a run directory's report (and its combined tables) from its points."""
    from simharness import results
    from simharness.report import write_report

    try:
        results.load_run_scenario(run_dir)
    except ScenarioError as e:
        fail(str(e))
    if (run_dir / "fidelity.json").is_file():  # a fidelity run's report
        from simharness.fidelity import write_fidelity

        out.print(f"report: {write_fidelity(run_dir).report}")
        return
    results.combine(run_dir)
    out.print(f"report: {write_report(run_dir)}")


@app.command("compare")
def compare_cmd(
    base: Annotated[Path, typer.Argument(help="baseline run directory or summary.json")],
    current: Annotated[Path, typer.Argument(help="current run directory or summary.json")],
    threshold: Annotated[float, typer.Option(help="relative change that counts as a regression")] = 0.05,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write verdicts + benchmark lists")] = None,
    force: Annotated[bool, typer.Option(help="compare runs of different scenarios")] = False,
    show_all: Annotated[bool, typer.Option("--all", help="list unchanged metrics too")] = False,
) -> None:
    """Compare two runs point by point; exit 1 if anything regressed, 2 on bad input."""
    from simharness.compare import CompareError, compare, markdown, to_json

    if threshold <= 0:
        fail("--threshold: must be > 0")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = compare(base, current, threshold=threshold, force=force)
    except CompareError as e:
        fail(str(e))
    for warning in caught:
        err.print(f"[bold yellow]warning:[/] {warning.message}", highlight=False, soft_wrap=True)
    typer.echo(markdown(rows, show_all=show_all))
    if json_out is not None:
        json_out.write_text(json.dumps(to_json(rows), indent=1))
    if any(r.verdict == "regression" for r in rows):
        raise typer.Exit(1)


@bench_app.command("kernels")
def bench_kernels(
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cuda",
    out_dir: Annotated[Path, typer.Option("--out", help="where kernels.csv/.md go")] = Path("results/kernels"),
    quick: Annotated[bool, typer.Option(help="small sizes, few repeats")] = False,
) -> None:
    """Benchmark the n-gram proposer, rejection sampler and verify step."""
    import torch

    from simharness.kernels.bench import run_kernel_bench

    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here (use --device cpu)")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = run_kernel_bench(device, out_dir, quick=quick)
    out.print(table.to_string(index=False))
    out.print(f"written: {out_dir / 'kernels.md'}")


def main() -> None:
    app(prog_name="simharness")


if __name__ == "__main__":
    sys.exit(main())
