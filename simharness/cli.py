"""The `simharness` command line: a thin layer over the Python API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from simharness.scenario import ScenarioError, load_scenario, parse_value

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Performance benchmarks of the harness's own parts.")
app.add_typer(bench_app, name="bench")
err = Console(stderr=True)
out = Console()


def fail(message: str) -> None:
    """Bad input: one clear message, exit status 2, no traceback."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_sets(sets: list[str]) -> dict[str, object]:
    overrides = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            fail(f"--set {item!r}: expected KEY=VALUE, e.g. --set scheduler.depth=3")
        overrides[key.strip()] = parse_value(value)
    return overrides


WorkersOption = Annotated[str | None, typer.Option(
    "--workers", help="run the points in N local worker processes; auto: one per CPU, or one per visible GPU "
    "(each pinned to it) when points run on CUDA")]
RayOption = Annotated[str | None, typer.Option(
    "--ray", help="run each point as a task on a Ray cluster: local (start one here), auto, or HOST:PORT")]
RetriesOption = Annotated[int, typer.Option("--retries", help="tries after the first for a point whose worker "
                                                              "dies or raises; then the point is marked failed")]


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
    retries and failures are printed above the bar as they happen. Keeps the last status (its run directory)."""

    def __init__(self, title: str):
        self.title, self.status = title, None
        self.bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
            TextColumn("{task.fields[point]}"),
            console=err, transient=True,
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
                        state=f"{status.running} running, {status.failed} failed")


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
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file")],
    out_dir: Annotated[Path, typer.Option("--out", help="results root")] = Path("results"),
    sets: Annotated[list[str], typer.Option("--set", help="override a field: KEY=VALUE (repeatable)")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option(help="finish the missing points of this run directory")] = None,
    workers: WorkersOption = None,
    ray: RayOption = None,
    retries: RetriesOption = 2,
) -> None:
    """Run a scenario's sweep; print a summary table and where the report is. Exit 1 when a point failed."""
    from simharness.runner import run

    bar = SweepBar(scenario.stem)
    try:
        sc = load_scenario(scenario, parse_sets(sets))
        with bar:
            result = run(sc, out_dir, resume=resume, progress=bar, workers=parse_workers(workers), ray=ray,
                         retries=retries)
    except ScenarioError as e:
        fail(str(e))
    except KeyboardInterrupt:
        if bar.status is not None:
            where = bar.status.run_dir
            err.print(f"interrupted: finished points are kept in {where}; finish with "
                      f"`simharness run {scenario} --resume {where}` (and the same --set options)")
        raise typer.Exit(130) from None
    ok = result.summary.drop(result.failed.index)
    out.print(summary_table(ok, [p for p in sc.sweep if p in result.summary.columns]))
    out.print(f"report: {result.report}")
    report_failed(result.summary)


@app.command("fidelity")
def fidelity_cmd(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML file")],
    levels: Annotated[str, typer.Option(help="levels to run, comma-separated; real is the reference")] = "sim,hil,real",
    out_dir: Annotated[Path, typer.Option("--out", help="results root")] = Path("results/fidelity"),
    sets: Annotated[list[str], typer.Option("--set", help="override a field: KEY=VALUE (repeatable)")] = [],  # noqa: B006
    resume: Annotated[Path | None, typer.Option(help="finish the missing points of this fidelity run")] = None,
    workers: WorkersOption = None,
    ray: RayOption = None,
    retries: RetriesOption = 2,
) -> None:
    """Run every point at each level on the same requests and seed; report each level's error against the real
    level. Exit 1 when an error exceeds the scenario's fidelity.tolerances or a point failed, 2 on bad input."""
    from simharness.fidelity import run_fidelity

    try:
        sc = load_scenario(scenario, parse_sets(sets))
        with SweepBar(f"{sc.name} fidelity") as bar:
            result = run_fidelity(sc, out_dir, levels=[lv.strip() for lv in levels.split(",") if lv.strip()],
                                  resume=resume, progress=bar, workers=parse_workers(workers), ray=ray,
                                  retries=retries)
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
    report_failed(result.summary)
    if result.violations:
        raise typer.Exit(1)


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
        rows = compare(base, current, threshold=threshold, force=force)
    except CompareError as e:
        fail(str(e))
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
