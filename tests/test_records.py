"""Records: a settled step's batch table becomes step counts, emissions and per-request tallies."""

import numpy as np
import pandas as pd

from simharness import policy
from simharness.policy import Batch
from simharness.records import ARRIVAL_S, HOST_COLUMNS, REQUEST_COLUMNS, STEP_COLUMNS, SYNC_COLUMNS, Records, Step


def table(**rows: list[int]) -> np.ndarray:
    """A batch table from rows named as policy's row constants, in lower case."""
    t = np.zeros((policy.BATCH_ROWS, len(rows["req"])), dtype=np.int64)
    for name, values in rows.items():
        t[getattr(policy, name.upper())] = values
    return t


def step(id: int, table: np.ndarray) -> Step:
    return Step(id, Batch(table, table.shape[1], 0, 0, 0), in_flight=1)


def test_step_counts_emissions_and_request_tallies():
    records = Records(k=3, output_len=np.array([5, 5, 5]))
    records.request_times[ARRIVAL_S] = [0.0, 0.1, 0.2]
    # step 0: request 0's last prefill chunk (first token) after 5 prompt tokens, request 1's first chunk
    records.add_step(step(0, table(req=[0, 1], tokens=[7, 4], prefill=[1, 1], completes=[1, 0], emitted=[1, 0],
                                   start=[5, 0])), 1.0)
    # step 1: request 0 decodes (2 of 3 drafts accepted), request 1 finishes its prompt, request 2 had finished
    # and wastes its slots
    records.add_step(step(1, table(req=[0, 1, 2], tokens=[4, 2, 4], prefill=[0, 1, 0], completes=[0, 1, 0],
                                   slots=[3, 0, 3], verified=[3, 0, 2], drafts_valid=[3, 0, 0], accepted=[2, 0, 0],
                                   emitted=[3, 1, 0], wasted=[0, 0, 3], start=[0, 4, 0])), 2.0)
    steps = records.steps_frame()
    assert list(steps.columns) == STEP_COLUMNS + ["acc_pos_0", "acc_pos_1", "acc_pos_2"]
    assert steps[STEP_COLUMNS[1:11]].to_numpy().tolist() == [[2, 2, 11, 5, 0, 0, 0, 0, 1, 0],
                                                             [3, 1, 2, 4, 7, 6, 3, 2, 4, 3]]
    assert steps[["acc_pos_0", "acc_pos_1", "acc_pos_2"]].to_numpy().tolist() == [[0, 0, 0], [1, 1, 0]]
    assert steps[HOST_COLUMNS].iloc[1].tolist()[:2] == [1, 1]
    emissions = records.emissions_frame()
    assert emissions.to_numpy().tolist() == [[0, 0, 1.0, 1], [0, 1, 2.0, 3], [1, 1, 2.0, 1]]
    assert [str(t) for t in emissions.dtypes] == ["int64", "int64", "float64", "int64"]
    records.set_requests(np.array(["free"] * 3), np.array([7, 6, 9]), np.array([5, 5, 5]))
    requests = records.requests
    assert list(requests.columns) == REQUEST_COLUMNS
    np.testing.assert_array_equal(requests.first_token_s, [1.0, 2.0, np.nan])
    np.testing.assert_array_equal(requests.last_token_s, [2.0, 2.0, np.nan])
    assert requests[REQUEST_COLUMNS[7:]].to_numpy().tolist() == [[2, 1, 3, 2, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 3]]


def test_an_empty_run_has_typed_empty_emissions():
    emissions = Records(k=2, output_len=np.array([3])).emissions_frame()
    assert len(emissions) == 0
    assert [str(t) for t in emissions.dtypes] == ["int64", "int64", "float64", "int64"]


def test_steps_frame_types_each_host_column_from_its_values():
    """Host columns as the steps recorded them: ints, floats with NaN and inf, the measured phases as text; a run
    without steps gives the columns with no rows."""
    records = Records(k=1, output_len=np.array([5]))
    assert list(records.steps_frame().columns) == [*STEP_COLUMNS, "acc_pos_0"]
    for i in range(3):
        s = step(i, table(req=[0], tokens=[1], prefill=[0], completes=[0], emitted=[1]))
        s.gpu_end, s.measured = (np.inf if i == 2 else 0.5 * i), ("verify,sample" if i else "")
        s.set_device_phases([0.1, np.nan if i == 1 else 0.2, 0.3, 0.4, 0.5])
        records.add_step(s, float(i))
    frame = records.steps_frame()
    assert frame["step"].dtype == np.int64 and frame["in_flight"].dtype == np.int64
    assert frame["gpu_end"].tolist() == [0.0, 0.5, np.inf] and frame["gpu_verify_s"].isna().tolist() == [0, 1, 0]
    assert frame["measured"].dtype == "str" and frame["measured"].tolist() == ["", "verify,sample", "verify,sample"]
    assert frame["harness_s"].dtype == np.float64 and frame["harness_s"].isna().all()
    assert [c for c in frame.columns if c in HOST_COLUMNS] == HOST_COLUMNS


def test_syncs_frame_types_as_from_records():
    """The syncs table column by column types each column as `DataFrame.from_records` did: text (None where a sync
    waits for nothing), object columns for a run without syncs."""
    records = Records(k=1, output_len=np.array([5]))
    empty = pd.DataFrame.from_records([], columns=SYNC_COLUMNS)
    pd.testing.assert_frame_equal(records.syncs_frame(), empty)
    records.syncs += [(0, "a", "launch", None, 0.1, 0.2), (1, "b", "update", "all_launched", 0.3, 0.4)]
    expected = pd.DataFrame.from_records(records.syncs, columns=SYNC_COLUMNS)
    frame = records.syncs_frame()
    assert frame["waits_for"].dtype == "str" and frame["waits_for"].isna().tolist() == [True, False]
    pd.testing.assert_frame_equal(frame, expected)
    assert records.syncs_columns()["step"].tolist() == [0, 1]
