"""Session setup. Triton runs in its interpreter only on a machine without CUDA: there the CPU kernel tests need it
from the first import of Triton on. On a GPU machine Triton compiles, every CUDA test runs, and the CPU kernel tests
interpret their own kernels (`helpers.interpreted_kernels`). The summary says how many CUDA tests ran."""

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    outcomes: Counter[str] = Counter()
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "cuda" in getattr(report, "keywords", {}) and (report.when == "call" or outcome != "passed"):
                outcomes[outcome] += 1
    if outcomes:
        ran = outcomes["passed"] + outcomes["failed"]
        terminalreporter.write_line(
            f"CUDA tests: {ran} ran ({outcomes['passed']} passed, {outcomes['failed']} failed), "
            f"{outcomes['error']} errors, {outcomes['skipped']} skipped"
        )
