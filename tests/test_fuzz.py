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
