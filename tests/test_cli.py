"""The command line as a new user meets it: bad input exits 2 with one message and writes nothing, --set and
sweeps do what they say, unwritable output is reported, interrupted runs resume and report what is missing,
help pages are plain and list the exit codes."""

import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import typer
import yaml
from rich.console import Console
from typer.testing import CliRunner

from simharness import results
from simharness.cli import app, summary_table

ROOT = Path(__file__).resolve().parents[1]
# A tiny sim scenario (iid acceptance: no torch import, well under a second a point).
TINY = {
    "name": "tiny",
    "workload": {"num_requests": 4, "concurrency": 2, "prompt_len": {"dist": "uniform", "min": 16, "max": 64},
                 "output_len": {"dist": "fixed", "value": 8}},
    "engine": {"model": "llama-3.2-1b", "speculation": {"acceptance": {"model": "iid"}}},
    "sweep": {"scheduler.depth": [1, 2]},
    "report": {"trace_steps": 10, "timeline_steps": 2},
}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def scenario_file(tmp_path: Path, data: dict | str = TINY) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def run_dirs(out: Path) -> list[Path]:
    return sorted(out.glob("*/*/"))


def assert_bad_input(r, message: str, out: Path) -> None:
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not run_dirs(out)  # nothing written for bad input


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "text,args,message",
    [
        ("name: x\nengine: {gpu: B999}\n", [], "engine.gpu: unknown GPU 'B999'"),
        ("name: x\nseed: -1\n", [], "seed: Input should be greater than or equal to 0"),
        ("name: x\nseed: 1\nseed: 2\n", [], "duplicate key 'seed'"),
        ("name: ..\n", [], "name: '..' is not a usable directory name"),
        ("name: x\n", ["--set", "scheduler.depth=true"], "scheduler.depth: Input should be a valid integer"),
        ("name: x\n", ["--set", 'scheduler.depth="3"'], "scheduler.depth: Input should be a valid integer"),
        ("name: x\n", ["--set", "engine.host_costs.prep_us=.inf"], "prep_us: Input should be a finite number"),
        ("name: x\n", ["--set", "workload.num_requests=100000000"], "less than or equal to 100000"),
        ("name: x\n", ["--set", "sweep.scheduler.depth=3"], "sweep.scheduler.depth: Input should be a valid list"),
        ("name: x\n", ["--set", "scheduler.sync_points.add=[metadata_item, metadata_item]"], "listed more than once"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, text, args, message):
    r = invoke("run", scenario_file(tmp_path, text), "--out", tmp_path / "out", *args)
    assert_bad_input(r, message, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_binary_scenario_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(bytes(range(256)))
    assert_bad_input(invoke("run", path, "--out", tmp_path / "out"), "not a UTF-8 text file", tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# --set and sweeps


def test_set_on_a_swept_field_replaces_the_sweep_and_says_so(tmp_path):
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path, "--set", "scheduler.depth=2")
    assert r.exit_code == 0, r.output
    assert "note: --set scheduler.depth replaces sweep.scheduler.depth [1, 2]" in " ".join(r.stderr.split())
    run_dir = next((tmp_path / "tiny").iterdir())
    recorded = yaml.safe_load((run_dir / "scenario.yaml").read_text())
    assert recorded["sweep"] == {} and recorded["scheduler"]["depth"] == 2  # what ran is what is recorded
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [row["effective_depth"] for row in summary] == [2]


def test_a_sweep_is_set_from_the_command_line(tmp_path):
    r = invoke("run", scenario_file(tmp_path, {**TINY, "sweep": {}}), "--out", tmp_path,
               "--set", "sweep.scheduler.depth=[2, 3]")
    assert r.exit_code == 0, r.output
    run_dir = next((tmp_path / "tiny").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [row["point"] for row in summary] == ["scheduler.depth=2", "scheduler.depth=3"]


@pytest.mark.parametrize("how", ["set", "sweep"])
def test_a_section_value_merges_into_the_files_section(tmp_path, how):
    """Issue 36, case 1: `--set 'workload={num_requests: 3}'` or a sweep over the section ran the default
    128-1024-token prompts and 128-token outputs; now the file's 16-64 and 8 stay."""
    data = {**TINY, "sweep": {"workload": [{"num_requests": 3}]}} if how == "sweep" else TINY
    extra = ["--set", "workload={num_requests: 3}"] if how == "set" else []
    r = invoke("run", scenario_file(tmp_path, data), "--out", tmp_path, *extra)
    assert r.exit_code == 0, r.output
    requests = pd.read_parquet(next((tmp_path / "tiny").iterdir()) / "requests.parquet")
    assert len(requests) == 3 * (2 if how == "set" else 1)  # the set keeps the file's depth sweep
    assert requests["prompt_tokens"].between(16, 64).all() and (requests["output_tokens"] == 8).all()


def test_a_value_in_an_implausible_unit_is_one_note(tmp_path):
    """Issue 36, case 7: `mem_bandwidth_gbs: 3.35` (TB/s meant) ran silently; now one note says the unit."""
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path, "--set", "engine.gpu_costs.mem_bandwidth_gbs=3.35")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == ("note: engine.gpu_costs.mem_bandwidth_gbs: 3.35 GB/s is outside the "
                                        "plausible 100 to 20,000 GB/s; the field is in GB/s: is the value in another "
                                        "unit?")
    # and, the scenario's GPU and model having a cost profile, that the roofline with that bandwidth ran instead
    assert r.stderr.count("note:") == 2 and "Warning" not in r.stderr
    assert "engine.gpu_costs: set, so the sim runs the roofline" in " ".join(r.stderr.split())


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "schedular.depth=2"], "error: --set schedular.depth: schedular: unknown field (did you mean "
                                     "'scheduler'?)"),
    (["--set", "scheduler.depth=[1"], "error: --set scheduler.depth: cannot parse value '[1'"),
    (["--set", "scheduler.dеpth=2"], "error: --set scheduler.dеpth: unknown field (its 'е' is the non-ASCII U+0435"),
])  # fmt: skip
def test_set_errors_name_the_option_not_the_file(tmp_path, args, message):
    """Issue 36, case 8: a typo on the command line was blamed on the scenario file."""
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path / "out", *args)
    assert_bad_input(r, message, tmp_path / "out")
    assert "s.yaml" not in r.stderr


def test_calibrate_level_says_the_choices(tmp_path):
    r = invoke("calibrate", tmp_path, "--level", "gpu", "--out", tmp_path / "c.yaml")
    assert r.exit_code == 2 and "error: --level gpu: unknown level; choose real or hil" in r.stderr, r.output
    assert not (tmp_path / "c.yaml").exists()


# ---------------------------------------------------------------------------------------------
# where the run goes


def test_out_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "below"):
        r = invoke("run", scenario_file(tmp_path), "--out", out)
        assert r.exit_code == 2, r.output
        assert f"--out {out}: cannot create a run directory there" in " ".join(r.stderr.split())


def test_read_only_out_exits_2(tmp_path, monkeypatch):
    # (root ignores permission bits, so the refusal is the file system's answer, simulated)
    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path / "ro")
    assert r.exit_code == 2, r.output
    assert "cannot create a run directory there (Permission denied)" in " ".join(r.stderr.split())


@pytest.mark.parametrize("failing_point", [0, 1])
def test_full_file_system_exits_2(tmp_path, monkeypatch, failing_point):
    write_point = results.write_point

    def full(run_dir, index, summary):
        if index == failing_point:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_point(run_dir, index, summary)

    monkeypatch.setattr(results, "write_point", full)
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert "cannot write the run (No space left on device)" in " ".join(r.stderr.split())
    kept = run_dirs(tmp_path / "out")
    if failing_point == 0:
        assert not kept and not (tmp_path / "out" / "tiny").exists()  # no empty run directory left behind
    else:
        assert len(kept) == 1 and results.finished_points(kept[0]) == {0}  # the finished point is kept


# ---------------------------------------------------------------------------------------------
# interrupted runs: resume and report


def test_resume_and_report_ignore_a_half_written_point(tmp_path):
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    (run_dir,) = run_dirs(tmp_path / "out")
    # what a kill -9 during the atomic write of point 1 leaves
    shutil.rmtree(run_dir / "points" / "0001")
    (run_dir / "points" / "0001.tmp").mkdir()
    (run_dir / "points" / "0001.tmp" / "steps.parquet").write_bytes(b"half")
    r = invoke("report", run_dir)
    assert r.exit_code == 0, r.output
    text = (run_dir / "report.md").read_text()
    assert "1 of 2 points" in text and "1 point(s) missing" in text and "`scheduler.depth=2`" in text
    r = invoke("run", scenario_file(tmp_path), "--resume", run_dir)
    assert r.exit_code == 0, r.output
    assert results.finished_points(run_dir) == {0, 1}
    text = (run_dir / "report.md").read_text()
    assert ", 2 point(s)" in text and "missing" not in text


def test_resume_mismatch_names_the_fields(tmp_path):
    r = invoke("run", scenario_file(tmp_path), "--out", tmp_path / "out")
    (run_dir,) = run_dirs(tmp_path / "out")
    r = invoke("run", scenario_file(tmp_path), "--resume", run_dir, "--set", "seed=5",
               "--set", "sweep.scheduler.depth=[1, 3]")
    assert r.exit_code == 2, r.output
    assert "was started from a different scenario (differs in seed, sweep.scheduler.depth)" in " ".join(
        r.stderr.split())


def test_report_of_a_run_kept_without_its_points_exits_2_and_changes_nothing(tmp_path):
    """A run kept as its tables only (no points/, as results/ keeps measured runs): `report` cannot rebuild it, says
    so, and leaves its summary and report as they were (rebuilding from no points emptied the summary)."""
    r = invoke("run", "scenarios/quickstart.yaml", "--out", tmp_path, "--set", "workload.num_requests=3",
               "--set", "sweep.scheduler.depth=[1]", "--set", "sweep.workload.concurrency=[1]")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    run_dir = next(p.parent for p in tmp_path.rglob("summary.csv"))
    shutil.rmtree(run_dir / "points")
    kept = {name: (run_dir / name).read_bytes() for name in ("summary.csv", "summary.json", "report.md")}
    r = invoke("report", run_dir)
    assert r.exit_code == 2 and "no points/" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert {name: (run_dir / name).read_bytes() for name in kept} == kept


def test_report_of_a_broken_run_directory_exits_2(tmp_path):
    (tmp_path / "scenario.yaml").write_bytes(b"\xff\xfe")
    r = invoke("report", tmp_path)
    assert r.exit_code == 2 and "not a UTF-8 text file" in r.stderr


# ---------------------------------------------------------------------------------------------
# output quality


def test_summary_labels_do_not_wrap_at_80_columns():
    swept = ["scheduler.depth", "workload.concurrency", "engine.speculation.proposer", "scheduler.policy"]
    rows = [{"point": "x", "scheduler.depth": d, "effective_depth": d, "workload.concurrency": c,
             "engine.speculation.proposer": "ngram_gpu", "scheduler.policy": "optimistic", "mean_tpot_ms": 12.345,
             "p99_tpot_ms": 123.456, "mean_ttft_ms": 12345.6, "output_throughput": 123456.0, "acceptance_rate": 55.5,
             "gpu_busy_fraction": 0.95, "syncs_per_step": 2.0} for d in (1, 2) for c in (4, 64)]
    summary = pd.DataFrame(rows)
    console = Console(width=80, record=True)
    console.print(summary_table(summary, swept[:2]))  # the quickstart's sweep: one line per point
    text = console.export_text()
    assert all(f"depth={d}, concurrency={c} " in text for d in (1, 2) for c in (4, 64)), text
    console = Console(width=80, record=True)
    console.print(summary_table(summary, swept))  # longer labels wrap between values, never inside one
    lines = [line[:25].strip() for line in console.export_text().splitlines()]
    items = {"depth=1,", "depth=2,", "concurrency=4,", "concurrency=64,", "ngram_gpu,", "optimistic"}
    label_lines = [line for line in lines if line and line not in ("point", "summary (latencies in ms)")
                   and not line.startswith("─")]
    assert label_lines and all(set(line.split()) <= items for line in label_lines), label_lines


def test_a_large_sweeps_summary_shows_its_first_points_and_says_where_the_rest_are():
    from simharness.cli import SUMMARY_ROWS

    summary = pd.DataFrame([{"point": f"p{i}", "workload.concurrency": i, "mean_tpot_ms": 1.0}
                            for i in range(SUMMARY_ROWS + 7)])
    console = Console(width=100, record=True)
    console.print(summary_table(summary, ["workload.concurrency"]))
    text = console.export_text()
    assert f"concurrency={SUMMARY_ROWS - 1} " in text and f"concurrency={SUMMARY_ROWS} " not in text
    assert f"the first {SUMMARY_ROWS} of {SUMMARY_ROWS + 7} points" in " ".join(text.split())


@pytest.mark.parametrize("command", [[], ["run"], ["compare"], ["report"], ["fidelity"], ["bench", "kernels"]])
def test_help_pages_are_plain_and_list_exit_codes(command):
    r = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    assert "Exit status: 0 done" in r.stdout or "Exit status: 0 no regression" in r.stdout, r.stdout
    assert re.search(r"; 2 (bad input|not a run directory)", " ".join(r.stdout.split())), r.stdout
    assert not re.search(r"<(bool|list\[str\]|float|text)>", r.stdout), r.stdout


def declared_options() -> dict[tuple[str, str], tuple[str, ...]]:
    """(command, parameter) -> the names its typer.Option declares, for every option of every command."""
    from typer.models import OptionInfo

    groups = [("", app), *((f"{g.name} ", g.typer_instance) for g in app.registered_groups)]
    declared = {}
    for prefix, group in groups:
        for command in group.registered_commands:
            for param, hint in typing.get_type_hints(command.callback, include_extras=True).items():
                for info in (m for m in getattr(hint, "__metadata__", ()) if isinstance(m, OptionInfo)):
                    # Annotated's typer.Option("--out") keeps its first name where a default would be
                    first = (info.default,) if isinstance(info.default, str) else ()
                    declared[(prefix + command.name, param)] = (*first, *info.param_decls)
    return declared


def test_every_option_is_named_explicitly():
    """typer's name for an option it names itself changed between versions (0.27.2 named one declared with a
    metavar `--DEVICE`: `bench kernels --device cuda` failed), so every option declares its name, and the
    installed typer parses exactly the declared names (scripts/check-lowest runs this file under the lowest
    typer and click that pyproject.toml allows)."""
    declared = declared_options()
    assert len(declared) >= 25 and ("bench kernels", "device") in declared
    unnamed = [key for key, names in declared.items() if not names or not all(n.startswith("--") for n in names)]
    assert not unnamed, f"options without an explicit --name: {unnamed}"
    root = typer.main.get_command(app)
    commands = {f"{g} {n}": c for g, grp in root.commands.items() if hasattr(grp, "commands")
                for n, c in grp.commands.items()} | root.commands
    for (command, param), names in declared.items():
        (option,) = [p for p in commands[command].params if p.name == param]
        assert sorted(option.opts + option.secondary_opts) == sorted(names), (command, param)
    r = invoke("bench", "kernels", "--device", "tpu")  # the GPU image's failure: "No such option: --device"
    assert r.exit_code == 2 and "--device: 'tpu' is neither cpu nor cuda" in r.stderr, r.output


def test_output_not_in_a_terminal_is_not_wrapped(tmp_path, monkeypatch):
    """Captured output (a pipe, a file, CI's log) keeps its lines whole: the report's path on one line, however
    long; an interrupted run prints the resume command on one line with the run's --set options, and it works."""
    out = tmp_path / ("a-long-results-directory-name-" * 3) / "out"
    sets = ["--set", "workload.num_requests=3", "--set", "workload.output_len={dist: fixed, value: 6}"]
    write_point = results.write_point

    def interrupted(run_dir, index, summary):
        if index == 1:
            raise KeyboardInterrupt
        write_point(run_dir, index, summary)

    monkeypatch.setattr(results, "write_point", interrupted)
    r = invoke("run", scenario_file(tmp_path), "--out", out, *sets)
    assert r.exit_code == 130, r.output
    (run_dir,) = run_dirs(out)
    command = f"simharness run {scenario_file(tmp_path)} --resume {run_dir} --set workload.num_requests=3 " \
              "--set 'workload.output_len={dist: fixed, value: 6}'"
    assert command in r.stderr.splitlines(), r.stderr
    monkeypatch.setattr(results, "write_point", write_point)
    r = invoke(*shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    assert f"report: {run_dir / 'report.md'}" in r.stdout.splitlines()


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_progress_line_keeps_counts_and_times_in_a_narrow_terminal(columns):
    """The long point id of a many-field sweep gives way: the count, state, elapsed and time left stay whole, on
    one line."""
    from simharness.cli import SweepBar
    from simharness.runner import SweepStatus

    bar = SweepBar("fidelity")
    bar.task = bar.bar.add_task(bar.title, total=None, point="", state="")
    point = "engine.speculation.proposer=ngram_gpu,scheduler.policy=optimistic,scheduler.depth=3," \
            "workload.concurrency=64,engine.speculation.k=4"
    bar(SweepStatus(Path("run"), total=1088, done=17, running=2, failed=1, point_id=point))
    console = Console(width=columns, record=True, force_terminal=True)
    console.print(bar.bar.make_tasks_table(bar.bar.tasks))
    lines = console.export_text().splitlines()
    assert len(lines) == 1 and len(lines[0]) <= columns, lines
    assert re.search(r"━+ +17/1088 2 running, 1 failed 0:00:0\d left -:--:-- ", lines[0]), lines


def test_ignored_fields_are_noted_once_per_run(tmp_path):
    """Fields every sim point ignores are one note for the run, not a Python warning (with its source line) a
    point."""
    doc = {**TINY, "engine": {**TINY["engine"], "device": "cuda", "host_slowdown": 1.2},
           "sweep": {"scheduler.depth": [1, 2], "workload.concurrency": [1, 2]}}
    r = invoke("run", scenario_file(tmp_path, doc), "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == ["note: engine.device, engine.host_slowdown: set, but a sim point runs no decode "
                                     "loop; ignored (4 of 4 points)"], r.stderr


def test_fidelity_table_shows_whole_point_ids(monkeypatch, tmp_path):
    """The "worst point" column is never cut to the long prefix its ids share, in a terminal of 80 columns too."""
    import simharness.fidelity as fidelity

    ids = [f"engine.speculation.proposer=ngram_gpu,scheduler.policy=optimistic,workload.concurrency={c}"
           for c in (4, 16)]
    stats = pd.DataFrame({"level": ["hil", "sim"], "metric": "mean_tpot_ms", "points": 2, "median_abs_error": 0.01,
                          "worst_abs_error": 0.02, "worst_point": ids})
    result = SimpleNamespace(stats=stats, violations=[], report=tmp_path / "report.md",
                             summary=pd.DataFrame({"point": ids}))
    monkeypatch.setattr(fidelity, "run_fidelity", lambda *args, **kwargs: result)
    for env in ({}, {"COLUMNS": "80"}):
        r = CliRunner().invoke(app, ["fidelity", str(scenario_file(tmp_path))], env=env)
        assert r.exit_code == 0, r.output
        text = "".join(r.stdout.split())
        assert all(i in text for i in ids), r.stdout


# ---------------------------------------------------------------------------------------------
# a CPU-only install: no Triton


@pytest.mark.slow
def test_scenarios_run_without_triton(tmp_path):
    """The CPU build of torch comes without Triton: the quickstart, the CI scenario and hil on CPU (the real decode
    loop, its torch ops) must not need it."""
    shim = "import sys; sys.modules['triton'] = None; from simharness.cli import main; main()"  # import fails
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    extra = {"hil-cpu": ["--set", "sweep.scheduler.depth=[2]", "--set", "workload.num_requests=3"]}
    procs = {name: subprocess.Popen([sys.executable, "-c", shim, "run", f"scenarios/{name}.yaml", "--out",
                                     str(tmp_path / name), *extra.get(name, [])], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("quickstart", "ci", "hil-cpu")}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        assert "report: " in stdout and "Traceback" not in stderr
        (run_dir,) = run_dirs(tmp_path / name)
        assert json.loads((run_dir / "meta.json").read_text())["scenario"] == name


def test_bench_kernels_says_what_it_measures(tmp_path, monkeypatch):
    """On CPU the benchmark takes minutes: a line as each group of rows starts, with the time since the start."""
    import simharness.bench as bench

    monkeypatch.setattr(bench, "time_call", lambda fn, device, repeats: (1.0, 1.0))  # every row, no timing
    r = invoke("bench", "kernels", "--device", "cpu", "--quick", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[0] == "[0:00] copy bandwidth and matmul peak", lines
    assert [line.split("] ")[1] for line in lines[1:]] == [
        *(f"n-gram proposer: batch {b}, width {w}" for b in (16, 64) for w in (2048, 8192)),
        *(f"rejection sampler: {d}, batch {b}" for d in ("float32", "bfloat16") for b in (16, 64)),
        "verify step: tiny, batches 1, 8", "decode step: tiny, batches 1, 8"], lines
    assert all(re.fullmatch(r"\[\d+:\d\d\] .+", line) for line in lines)


def test_bench_kernels_prints_no_nan_frame(tmp_path, monkeypatch):
    """Each kernel's rows are printed with that kernel's columns only (a NaN-filled frame said nothing)."""
    import simharness.bench as bench

    frame = pd.DataFrame([
        {"kernel": "ngram", "impl": "torch", "batch": 16, "width": 2048, "device_ms": 1.5, "speedup_vs_torch": 1.0},
        {"kernel": "rejection", "impl": "reference", "batch": 16, "k": 4, "device_ms": 2.5, "pct_of_copy_bw": 0.4},
        {"kernel": "verify", "impl": "eager", "batch": 1, "model": "tiny", "device_ms": 19.0, "wall_ms": float("nan")},
    ])
    monkeypatch.setattr(bench, "run_kernel_bench", lambda device, out_dir, quick=False, progress=None: frame)
    r = invoke("bench", "kernels", "--device", "cpu", "--quick", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    assert "NaN" not in r.stdout and "nan" not in r.stdout.lower().replace("ngram", "")
    assert r.stdout.index("ngram") < r.stdout.index("speedup_vs_torch") < r.stdout.index("rejection")
    assert "pct_of_copy_bw" not in r.stdout.split("rejection")[0]
    r = invoke("bench", "kernels", "--device", "tpu")
    assert r.exit_code == 2 and "--device: 'tpu' is neither cpu nor cuda" in r.stderr
