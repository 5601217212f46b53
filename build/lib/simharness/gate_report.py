"""The gate's outputs, one content in three forms: Markdown for a pull-request comment or a CI job summary
(regressions first, then changes, then a one-line verdict), JSON with the same content, and JUnit XML (one test
case per point and metric) that CI systems show natively."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import asdict

from simharness.compare import DIRECTION, Row

CHANGES = ("missing in current", "missing in base", "improvement", "changed")  # in the order they are listed
QUIET = ("noise", "same")
EXIT = {"fail": 1, "incomplete": 3, "pass": 0}  # the command's exit status for each verdict


def verdict(rows: list[Row]) -> str:
    """fail: a metric regressed; incomplete: no regression, but a point of one side is missing; else pass."""
    if any(r.verdict == "regression" for r in rows):
        return "fail"
    if any(r.verdict.startswith("missing") for r in rows):
        return "incomplete"
    return "pass"


def verdict_line(rows: list[Row], context: str = "") -> str:
    """One line: the verdict, the counts, and what was compared (`context`: the runs, threshold and test)."""
    count = {v: sum(r.verdict == v for r in rows) for v in ("regression", "improvement", "changed")}
    missing = {side: sum(r.verdict == f"missing in {side}" for r in rows) for side in ("base", "current")}
    compared = [r for r in rows if not r.verdict.startswith("missing")]
    line = (f"{verdict(rows).upper()}: {count['regression']} regression(s), {count['improvement']} improvement(s), "
            f"{count['changed']} changed" + "".join(f", {n} point(s) missing in {side}" for side, n in
                                                    missing.items() if n)
            + f" over {len(compared)} metrics at {len({r.point for r in compared})} common points "
            f"({sum(r.verdict in QUIET for r in rows)} unchanged or within noise)")
    return line + (f"; {context}" if context else "")


def _sorted(rows: list[Row], verdicts: tuple[str, ...]) -> list[Row]:
    return sorted((r for r in rows if r.verdict in verdicts), key=lambda r: (verdicts.index(r.verdict), r.point,
                                                                              r.metric))


def markdown(rows: list[Row], *, show_all: bool = False, context: str = "") -> str:
    """Regressions, then changes (missing points, improvements, changed; with `show_all` also noise and same), then
    the verdict line."""
    changes = CHANGES + (QUIET if show_all else ())
    parts = []
    for title, shown in (("Regressions", _sorted(rows, ("regression",))), ("Changes", _sorted(rows, changes))):
        if not shown:
            continue
        lines = [f"#### {title} ({len(shown)})", "", "| point | metric | base | current | change % | verdict |",
                 "|---|---|---:|---:|---:|---|"]
        lines += [_markdown_row(r) for r in shown]
        parts.append("\n".join(lines))
    parts.append(f"**{verdict_line(rows, context)}**")
    return "\n\n".join(parts) + "\n"


def _markdown_row(r: Row) -> str:
    if r.verdict.startswith("missing"):
        here, gone = ("absent", "present") if r.verdict == "missing in base" else ("present", "absent")
        return f"| {r.point} | (all) | {here} | {gone} | | ⚠️ {r.verdict} |"
    mark = {"regression": "❌ regression", "improvement": "✅ improvement"}.get(r.verdict, r.verdict)
    if r.p_value is not None and math.isfinite(r.p_value):
        mark += f" (p={r.p_value:.2g})"
    return f"| {r.point} | {r.metric} | {r.base:.4g} | {r.current:.4g} | {r.change_pct:+.2f} | {mark} |"


def to_json(rows: list[Row], context: str = "") -> dict:
    """The Markdown's content: the verdict and its line, the regressions, the changes, every row; plus
    github-action-benchmark / Bencher lists of the current values (diagnostics, which have no good direction, are in
    the rows only)."""
    smaller, bigger = [], []
    for r in rows:
        if r.metric not in DIRECTION:  # a missing point's row
            continue
        bigger_better, unit = DIRECTION[r.metric]
        if bigger_better is None:
            continue
        entry = {"name": f"{r.point} {r.metric}", "unit": unit, "value": _finite(r.current)}
        (bigger if bigger_better else smaller).append(entry)
    return {
        "verdict": verdict(rows),
        "verdict_line": verdict_line(rows, context),
        "regressions": sum(r.verdict == "regression" for r in rows),
        "improvements": sum(r.verdict == "improvement" for r in rows),
        "changed": sum(r.verdict == "changed" for r in rows),
        "missing_points": {side: [r.point for r in rows if r.verdict == f"missing in {side}"]
                           for side in ("base", "current")},
        "regression_rows": [_json_row(r) for r in _sorted(rows, ("regression",))],
        "change_rows": [_json_row(r) for r in _sorted(rows, CHANGES)],
        "rows": [_json_row(r) for r in rows],
        "customSmallerIsBetter": smaller,
        "customBiggerIsBetter": bigger,
    }


def _json_row(r: Row) -> dict:
    return {k: _finite(v) for k, v in asdict(r).items()}


def _finite(value):
    """Strict JSON has no inf/NaN (a change from a zero base is infinite): write null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def junit(rows: list[Row], context: str = "") -> str:
    """JUnit XML: one test case per point (class) and metric (name); a regression is a failure, a point missing on one
    side an error (the run is incomplete), everything else passes with its numbers as output."""
    failures = sum(r.verdict == "regression" for r in rows)
    errors = sum(r.verdict.startswith("missing") for r in rows)
    attrs = {"name": "simharness compare", "tests": str(len(rows)), "failures": str(failures), "errors": str(errors)}
    suites = ET.Element("testsuites", attrs)
    suite = ET.SubElement(suites, "testsuite", {**attrs, "skipped": "0"})
    ET.SubElement(ET.SubElement(suite, "properties"), "property", {"name": "verdict",
                                                                   "value": verdict_line(rows, context)})
    for r in rows:
        case = ET.SubElement(suite, "testcase", {"classname": r.point, "name": r.metric or "(all)"})
        if r.verdict.startswith("missing"):
            ET.SubElement(case, "error", {"type": "missing", "message": f"point {r.verdict}"})
            continue
        text = f"base {r.base:.6g}, current {r.current:.6g} ({r.change_pct:+.2f} %): {r.verdict}"
        if r.p_value is not None and math.isfinite(r.p_value):
            text += f" (p={r.p_value:.2g})"
        if r.verdict == "regression":
            ET.SubElement(case, "failure", {"type": "regression", "message": text}).text = text
        else:
            ET.SubElement(case, "system-out").text = text
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
