"""Fuzzing the command line: generated scenario documents and --set options, run through `simharness run`
in-process. Whatever the input: exit 0 or 2, never a traceback, and on exit 2 no run directory left behind.

Values are drawn from small valid ones, boundary and out-of-range ones, wrong types and non-finite numbers, so a
run that is valid stays tiny (a few requests of a few tokens: about a second with its report). Examples are
derandomized so CI runs the same ones; raise FUZZ_EXAMPLES to search longer.
"""

import math
import os
import traceback
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from simharness.cli import app

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))

wrong = st.sampled_from([None, True, "3", "x", [1], {"a": 1}, 2.5])
non_finite = st.sampled_from([math.inf, -math.inf, math.nan, 1e300, -1e-300])
small_int = st.integers(-2, 6)
count = st.one_of(st.integers(0, 6), st.sampled_from([-1, 100_000_000, 2**70]), wrong)
tokens = st.one_of(st.integers(1, 48), st.sampled_from([0, -5, 2**30]), wrong)
cost = st.one_of(st.floats(0, 500), st.floats(-10, 0), non_finite, wrong)
fraction = st.one_of(st.floats(0, 1), st.sampled_from([-0.1, 1.5, 1e-300]), non_finite, wrong)
name = st.sampled_from(["fz", "f.z", ".", "..", "", "a/b", "é", "x" * 200])


def choice(*values: object) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(values), wrong)


# dotted path -> the values it is given
FIELDS: dict[str, st.SearchStrategy] = {
    "name": st.one_of(name, wrong),
    "seed": st.one_of(st.integers(0, 10), st.sampled_from([-1, 2**64]), wrong),
    "workload.arrival": choice("closed", "poisson", "gamma", "bursty"),
    "workload.concurrency": count,
    "workload.num_requests": count,
    "workload.requests_per_user": st.one_of(st.none(), count),
    "workload.rate": st.one_of(st.floats(0.5, 100), cost),
    "workload.burstiness": st.one_of(st.floats(0.1, 4), cost),
    "workload.cap_concurrency": choice(True, False),
    "workload.prompt_len": st.fixed_dictionaries({}, optional={"dist": choice("fixed", "uniform", "normal", "corpus"),
                                                               "value": tokens, "min": tokens, "max": tokens,
                                                               "mean": cost, "std": cost}),
    "workload.output_len.value": tokens,
    "workload.output_len.dist": choice("fixed", "uniform", "corpus", "zipf"),
    "workload.kinds": st.one_of(st.dictionaries(st.sampled_from(["code_edit", "summarize", "free", "poem"]), cost,
                                                max_size=3), wrong),
    "engine.gpu": choice("H100", "a100", "L40S", "B999", ""),
    "engine.model": choice("llama-3.2-1b", "tiny", "qwen3-1.7b", "nope", "/nonexistent", "."),
    "engine.level": choice("sim", "simulated"),
    "engine.backend": choice("model", "simulated"),
    "engine.speculation.proposer": choice("none", "ngram_cpu", "ngram_gpu", "eagle"),
    "engine.speculation.k": st.one_of(small_int, st.sampled_from([17]), wrong),
    "engine.speculation.min_n": st.one_of(small_int, wrong),
    "engine.speculation.max_n": st.one_of(small_int, wrong),
    "engine.speculation.tie_break": choice("earliest", "latest", "random"),
    "engine.speculation.invalid_slots": choice("trim", "fill", "drop"),
    "engine.speculation.acceptance.model": choice("iid", "positional", "replay", "oracle"),
    "engine.speculation.acceptance.alpha": fraction,
    "engine.speculation.acceptance.rates": st.one_of(st.lists(fraction, max_size=5), wrong),
    "engine.gpu_costs.mem_bandwidth_gbs": st.one_of(st.none(), st.floats(0.5, 1e4), cost),
    "engine.gpu_costs.bf16_tflops": st.one_of(st.none(), st.floats(0.001, 1e3), cost),
    "engine.gpu_costs.mem_efficiency": fraction,
    "engine.gpu_costs.step_overhead_us": cost,
    "engine.host_costs.prep_us": cost,
    "engine.host_costs.sync_us": cost,
    "engine.gc": st.fixed_dictionaries({}, optional={"probability": fraction, "mean_ms": cost,
                                                     "distribution": choice("fixed", "exponential", "pareto")}),
    "scheduler.depth": st.one_of(small_int, st.sampled_from([8, 9]), wrong),
    "scheduler.policy": choice("wait", "optimistic", "eager"),
    "scheduler.max_num_seqs": count,
    "scheduler.max_num_batched_tokens": st.one_of(tokens, count),
    "scheduler.chunked_prefill": choice(True, False),
    "scheduler.sync_points.add": st.lists(st.one_of(
        st.sampled_from(["metadata_item", "bool_mask_index", "accepted_counts", "nope"]),
        st.fixed_dictionaries({"name": st.sampled_from(["custom", "metadata_item"])},
                              optional={"phase": choice("schedule", "prep", "launch", "update", "never"),
                                        "waits_for": choice("all_launched", "oldest_in_flight", "nothing")})),
        max_size=3),
    "scheduler.sync_points.remove": st.lists(st.sampled_from(["accepted_counts", "valid_draft_counts",
                                                              "output_readback", "nope"]), max_size=3),
    "report.percentiles": st.one_of(st.lists(st.one_of(st.floats(0, 100), cost), max_size=3), wrong),
    "report.trace_steps": st.one_of(st.integers(0, 50), count),
    "report.timeline_steps": st.one_of(st.integers(1, 8), count),
    "bogus.field": st.integers(),
}
SWEEPABLE = ["scheduler.depth", "workload.concurrency", "scheduler.policy", "engine.speculation.k",
             "engine.host_costs.prep_us", "engine.gpu", "nope.field"]


def _number_key(value: object) -> object:
    """Sweep values are kept distinct (repeated values are the repeats feature's, not this test's)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return ("number", float(value)) if not math.isnan(value) else ("nan",)
    return ("other", repr(value))


sweep = st.dictionaries(
    st.sampled_from(SWEEPABLE),
    st.one_of(st.lists(st.one_of(*(FIELDS[p] for p in SWEEPABLE[:-1])), max_size=3, unique_by=_number_key), wrong),
    max_size=2,
)

BASE = {
    "name": "fz",
    "workload": {"num_requests": 3, "concurrency": 2, "prompt_len": {"dist": "uniform", "min": 8, "max": 32},
                 "output_len": {"dist": "fixed", "value": 6}},
    "engine": {"model": "llama-3.2-1b", "speculation": {"acceptance": {"model": "iid"}}},
    "report": {"trace_steps": 10, "timeline_steps": 2},
}


def _set_path(doc: dict, path: str, value: object) -> None:
    node = doc
    parts = path.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


@st.composite
def documents(draw) -> str:
    """A scenario file's text: the tiny base with a few fields changed, sometimes a sweep, sometimes broken YAML."""
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    for path in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        _set_path(doc, path, draw(FIELDS[path]))
    if draw(st.booleans()):
        doc["sweep"] = draw(sweep)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    damage = draw(st.sampled_from(["none"] * 6 + ["dup", "tab", "truncate", "bytes", "scalar"]))
    if damage == "dup":
        text += "seed: 1\nseed: 2\n"
    elif damage == "tab":
        text = "\t" + text
    elif damage == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif damage == "bytes":
        text += draw(st.text(max_size=8))
    elif damage == "scalar":
        text = draw(st.sampled_from(["3", "[1, 2]", "", "~", "!!binary AAAA"]))
    return text


def _set_option(path_value: tuple[str, object]) -> str:
    path, value = path_value
    return f"{path}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


sets = st.lists(
    st.one_of(
        st.sampled_from(sorted(FIELDS)).flatmap(lambda p: FIELDS[p].map(lambda v: (p, v))).map(_set_option),
        st.sampled_from(SWEEPABLE[:4]).flatmap(
            lambda p: st.lists(FIELDS[p], max_size=3, unique_by=_number_key).map(
                lambda v: _set_option((f"sweep.{p}", v)))
        ),
        st.sampled_from(["nodots", "=3", "a..b=1", "scheduler.depth=", "sweep.=[1]", "scheduler.depth=[unclosed",
                         "scheduler={depth: 2}", "sweep={}"]),
    ),
    max_size=3,
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=documents(), options=sets)
def test_cli_never_tracebacks(tmp_path: Path, text: str, options: list[str]) -> None:
    case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    case.mkdir()
    path = case / "s.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    out = case / "out"
    args = ["run", str(path), "--out", str(out)]
    for option in options:
        args += ["--set", option]
    r = CliRunner().invoke(app, args)
    detail = "".join(traceback.format_exception(*r.exc_info)) if r.exc_info and r.exit_code not in (0, 2) else ""
    assert r.exit_code in (0, 2), f"{args}\n{text}\n{r.output}\n{detail}"
    assert "Traceback" not in r.output, r.output
    if r.exit_code == 2:
        assert r.stderr.lstrip().startswith("error: "), r.output  # one message (after a cleared progress bar)
        assert not list(out.rglob("scenario.yaml")) and not list(out.rglob("points")), "a partial run directory"
    else:
        assert len(list(out.rglob("report.md"))) == 1


# ------------------------------------------------------------------------------------------------------------------
# Scenarios that are certainly bad: the tiny base with one to three mistakes, each of which alone makes it invalid
# (a later mistake never repairs an earlier one: each sets its path to a bad value), in the file or on the command
# line, among a few valid changes. Issue 36: exit 2, one message, no traceback, nothing written, over 500 cases.

BAD_EXAMPLES = int(os.environ.get("FUZZ_BAD_EXAMPLES", "500"))

# dotted path -> values that are wrong whatever else the scenario says
BAD: dict[str, list[object]] = {
    "name": ["", ".", "..", "a/b", "x" * 101, 3, None],
    "seed": [-1, 2**64, "3", 1.5, True],
    "repeats": [0, 101, "2"],
    "workload.arrival": ["bursty", 3, None],
    "workload.concurrency": [0, -1, 100_001, 2.5, "4"],
    "workload.num_requests": [0, 100_001, True, [3]],
    "workload.rate": [0, -1.0, math.inf, math.nan, "fast"],
    "workload.burstiness": [0, 1e4, -math.inf],
    "workload.prompt_len": [3, "uniform", {"dist": "zipf"}, {"min": 0}, {"min": 9, "max": 3}, {"value": 2**21}],
    "workload.output_len.value": [0, -5, 2**30, "8"],
    "workload.kinds": [{}, {"poem": 1.0}, {"free": -1.0}, {"free": 0.0}, [1]],
    "workload.random_fraction": [-0.1, 1.5, math.nan],
    "engine.gpu": ["B999", "", 100],
    "engine.model": ["nope", "/nonexistent", "llama-9", 8],
    "engine.level": ["simulated", None],
    "engine.backend": ["simulated", None],
    "engine.device": ["tpu"],
    "engine.host_slowdown": [1.0, 11, -2],
    "engine.speculation.k": [-1, 17, "4"],
    "engine.speculation.proposer": ["eagle"],
    "engine.speculation": [{"min_n": 4, "max_n": 2}, {"min_n": 0}],
    "engine.speculation.acceptance.alpha": [1.0, -0.1, math.nan],
    "engine.speculation.acceptance.rates": [[1.5], "x", [None]],
    "engine.gpu_costs.mem_bandwidth_gbs": [0.5, -1, math.inf],
    "engine.gpu_costs.mem_efficiency": [0, 1.5],
    "engine.host_costs.prep_us": [-1, 1e10, math.inf, "200"],
    "engine.gc.probability": [1.5, -1],
    "engine.gc.distribution": ["pareto"],
    "scheduler.depth": [0, 9, True, "3", 2.5],
    "scheduler.policy": ["eager", 1],
    "scheduler.max_num_seqs": [0, -3],
    "scheduler.sync_points.add": [["metadata_item", "metadata_item"], [{"name": "x", "phase": "never"}]],
    "scheduler.sync_points.remove": ["accepted_counts"],
    "report.percentiles": [[101], "x", [-1]],
    "report.timeline_steps": [0, -1],
    "report.goodput.tpot_ms": [0, -5.0],
    "fidelity.runs": [0, 21],
    "fidelity.tolerances": [{"gpu": {}}, {"sim": {"mean_tpot_ms": {"median": 0}}}],
    # unknown keys, one of them with a Cyrillic е that reads like the field
    "bogus": [1],
    "schedulеr": [{"depth": 2}],
    "workload.bogus": [1],
    "scheduler.dеpth": [2],
    # sweeps: empty, over no field, a repeated value, not a list
    "sweep": [{"scheduler.depth": []}, {"nope.field": [1]}, {"scheduler.depth": [1, 1]}, {"scheduler.depth": 3}, [1]],
}
# mistakes found only once the points are resolved: their message names the point, not the file or option
LATE: dict[str, list[object]] = {
    "scheduler.sync_points.add": [["nope"]],
    "scheduler.sync_points.remove": [["nope"]],
    "sweep": [{"scheduler.depth": [2, 0]}, {"workload": [{"bogus": 1}]}, {"workload.concurrency": [2, "x"]}],
}
# --set options that are wrong as text, and run options that are out of range
BAD_SET_TEXT = ["nodots", "=3", "scheduler.depth=[unclosed", "scheduler.depth=", "scheduler.depth={a: [}",
                "sweep.=[1]", "workload=3", "schedular.depth=2", "seed=1\nseed: 2"]
BAD_OPTIONS = [["--workers", "0"], ["--workers", "many"], ["--retries", "-1"], ["--workers", "2", "--ray", "local"]]
# valid changes, some kept in the file around the mistakes
GOOD: dict[str, list[object]] = {
    "workload.num_requests": [1, 2, 4],
    "scheduler.depth": [1, 3],
    "scheduler.policy": ["wait"],
    "engine.speculation.k": [0, 2],
    "engine.gpu": ["A100", "h200"],
    "seed": [7],
}
# YAML that is broken whatever it holds
BAD_YAML = ["seed: 1\nseed: 2\n", "\tname: x\n", "x: [1\n", "--- 3\n", "name: &a x\nseed: *b\n"]


def _option_text(path: str, value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...").strip()
    return f"{path}={text}"


@st.composite
def bad_cases(draw) -> tuple[str, list[str], set[str]]:
    """(scenario text, command-line arguments after the file, where the mistakes are: file, --set, or other
    for a run option or a mistake found late), certainly bad input."""
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    for path in draw(st.lists(st.sampled_from(sorted(GOOD)), max_size=3, unique=True)):
        _set_path(doc, path, draw(st.sampled_from(GOOD[path])))
    args: list[str] = []
    sources: set[str] = set()
    text_damage = None
    for kind in draw(st.lists(st.sampled_from(["file"] * 4 + ["set"] * 3 + ["set text", "option", "yaml"]),
                              min_size=1, max_size=3)):
        late = kind in ("file", "set") and draw(st.integers(0, 9)) == 0
        sources.add({"set text": "--set", "yaml": "file", "option": "other"}.get(kind, "other" if late else kind))
        if kind == "set text":
            args += ["--set", draw(st.sampled_from(BAD_SET_TEXT))]
        elif kind == "option":
            args += draw(st.sampled_from(BAD_OPTIONS))
        elif kind == "yaml":
            text_damage = draw(st.sampled_from(BAD_YAML))
        else:
            mistakes = LATE if late else BAD
            path = draw(st.sampled_from(sorted(mistakes)))
            value = draw(st.sampled_from(mistakes[path]))
            if kind == "file":
                _set_path(doc, path, value)
            elif path == "sweep":
                args += ["--set", _option_text(f"sweep.{next(iter(value))}", next(iter(value.values())))
                         if isinstance(value, dict) else _option_text("sweep", value)]
            else:
                args += ["--set", _option_text(path, value)]
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    return (text + text_damage if text_damage else text), args, {"--set" if s == "set" else s for s in sources}


@settings(max_examples=BAD_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bad_cases())
def test_bad_input_is_one_message_and_nothing_written(tmp_path: Path, case: tuple[str, list[str], set[str]]) -> None:
    text, options, sources = case
    case_dir = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    case_dir.mkdir()
    path = case_dir / "s.yaml"
    path.write_text(text, encoding="utf-8")
    out = case_dir / "out"
    r = CliRunner().invoke(app, ["run", str(path), "--out", str(out), *options])
    detail = "".join(traceback.format_exception(*r.exc_info)) if r.exc_info and r.exit_code != 2 else ""
    assert r.exit_code == 2, f"{options}\n{text}\n{r.output}\n{detail}"
    message = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("note: ")).strip()
    assert message.startswith("error: ") and message.count("error:") == 1, r.stderr
    if sources == {"--set"}:  # the message names its source
        assert message.startswith("error: --set "), message
    elif sources == {"file"}:
        assert message.startswith(f"error: {path}"), message
    assert "Traceback" not in r.output and "Warning" not in r.stderr, r.output
    assert not out.exists(), "bad input wrote something"
