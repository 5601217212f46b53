"""Phases and the sync recorder: attribution to step, phase and source line on a CPU through the warning
hook alone; on CUDA (run on the GPU machine) a planted `.item()` is caught and a sync-free region is not."""

from __future__ import annotations

import inspect
import time
import warnings

import pytest
import torch

from simharness.instrument import DEVICE_SYNC_COLUMNS, SYNC_WARNING, SyncRecorder
from simharness.phases import current_phase, phase

# torch's message: the C++ text and where it was raised
TORCH_TEXT = f"{SYNC_WARNING} (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:154.)"
HERE = "tests/test_instrument.py"


def _line() -> int:
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


def test_phases_nest_without_cuda_or_profiler() -> None:
    assert current_phase() == ""
    with phase("step"):
        assert current_phase() == "step"
        with phase("prep"):
            assert current_phase() == "prep"
        with phase("step"):  # the same name nested in itself
            assert current_phase() == "step"
        assert current_phase() == "step"
    assert current_phase() == ""
    assert phase("prep") is phase("prep")


def test_phase_closes_on_exception() -> None:
    with pytest.raises(KeyError), phase("update"):
        raise KeyError("x")
    assert current_phase() == ""


def test_recorder_without_cuda_records_nothing() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    recorder = SyncRecorder()
    with recorder, phase("prep"), pytest.warns(UserWarning, match="synchronizing"):
        recorder.start_step(0)
        warnings.warn(TORCH_TEXT, stacklevel=1)  # not hooked: an ordinary warning
    frame = recorder.frame()
    assert list(frame.columns) == DEVICE_SYNC_COLUMNS and frame.empty
    assert list(frame.dtypes.astype(str)) == ["int64", "str", "str", "float64"]
    assert recorder.count(0) == 0


def test_attribution_to_step_phase_and_site() -> None:
    recorder = SyncRecorder(warnings_only=True)
    with recorder:
        warnings.warn(TORCH_TEXT, stacklevel=1)
        first = _line() - 1
        recorder.start_step(3)
        with phase("step"):
            with phase("prep"):
                time.sleep(0.01)
                warnings.warn(TORCH_TEXT, stacklevel=1)
                prep = _line() - 1
            warnings.warn(TORCH_TEXT, stacklevel=1)
        recorder.start_step(4)
        for _ in range(2):
            with phase("readback"):
                warnings.warn(TORCH_TEXT, stacklevel=1)
                readback = _line() - 1
    frame = recorder.frame()
    assert list(frame.columns) == DEVICE_SYNC_COLUMNS
    assert list(frame.dtypes.astype(str)) == ["int64", "str", "str", "float64"]
    assert frame[["step", "phase", "site"]].values.tolist() == [
        [-1, "", f"{HERE}:{first}"],
        [3, "prep", f"{HERE}:{prep}"],
        [3, "step", f"{HERE}:{prep + 2}"],
        [4, "readback", f"{HERE}:{readback}"],
        [4, "readback", f"{HERE}:{readback}"],
    ]
    assert frame["wait_s"].iloc[1] >= 0.01  # from entering "prep" to the sync's return, the sleep included
    assert (frame["wait_s"].drop(1) < 0.01).all()
    assert [recorder.count(s) for s in (-1, 3, 4, 5)] == [1, 2, 2, 0]


def _sync_in_torch_code() -> None:
    warnings.warn(TORCH_TEXT, stacklevel=1)


def test_site_skips_torch_frames(monkeypatch) -> None:
    """A sync raised inside torch's Python code is reported at the caller's line."""
    recorder = SyncRecorder(warnings_only=True)
    code = _sync_in_torch_code.__code__.replace(co_filename=torch.__file__)
    monkeypatch.setattr(_sync_in_torch_code, "__code__", code)
    with recorder:
        _sync_in_torch_code()
        call = _line() - 1
    assert recorder.frame()["site"].tolist() == [f"{HERE}:{call}"]


def test_other_warnings_pass_through_unchanged() -> None:
    seen = []
    recorder = SyncRecorder(warnings_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args: seen.append(args)
        with recorder:
            warnings.warn("something else", DeprecationWarning, stacklevel=1)
            other = _line() - 1
            warnings.warn(TORCH_TEXT, stacklevel=1)
    assert len(seen) == 1
    message, category, filename, lineno, file, line = seen[0]
    assert (str(message), category, lineno, file, line) == ("something else", DeprecationWarning, other, None, None)
    assert filename == __file__
    assert len(recorder.frame()) == 1


def test_state_restored_after_exception() -> None:
    filters, show = list(warnings.filters), warnings.showwarning
    recorder = SyncRecorder(warnings_only=True)
    with pytest.raises(ValueError, match="boom"), recorder, phase("prep"):
        raise ValueError("boom")
    assert warnings.filters == filters and warnings.showwarning is show
    assert current_phase() == ""
    with recorder:  # usable again
        warnings.warn(TORCH_TEXT, stacklevel=1)
    assert len(recorder.frame()) == 1
    with pytest.raises(RuntimeError, match="already recording"), recorder, recorder:
        pass
    assert warnings.showwarning is show


# --------------------------------------------------------------------------------------------
# CUDA

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_planted_item_is_caught_on_cuda() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    recorder = SyncRecorder()
    with recorder:
        recorder.start_step(7)
        with phase("prep"):
            b = a @ a
            b.sum().item()
            planted = _line() - 1
        with phase("propose"):
            c = (b + 1).relu_()  # queued work only: no sync
    torch.cuda.synchronize()
    assert torch.cuda.get_sync_debug_mode() == mode
    frame = recorder.frame()
    assert frame[["step", "phase", "site"]].values.tolist() == [[7, "prep", f"{HERE}:{planted}"]]
    assert frame["wait_s"].iloc[0] >= 0
    assert recorder.count(7) == 1 and c.shape == b.shape


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_free_region_records_nothing_on_cuda() -> None:
    a = torch.randn(512, 512, device="cuda")
    recorder = SyncRecorder()
    with recorder:
        recorder.start_step(0)
        with phase("verify"):
            b = torch.where(a > 0, a, 0.0).cumsum(0)
            a.index_copy_(0, torch.argmax(b, dim=1), b)
    torch.cuda.synchronize()
    assert recorder.frame().empty and recorder.count(0) == 0
