"""How a point's engine behaves: effective queue depth, drafting and the sync points it implies.

Resolved once per point from its scenario and carried with it (the runner resolves it); every level
reads the same `Mode`, so the levels differ only in where time comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from simharness.scenario import Scenario, ScenarioError, SyncPoint

# The sync points the harness knows, with the mode in which each is present (docs/vllm-notes.md, "Sync points").
KNOWN_SYNC_POINTS: dict[str, SyncPoint] = {
    # pre-#32951 async: _update_states reads step N's accepted counts before preparing N+1
    "accepted_counts": SyncPoint(name="accepted_counts", phase="prep"),
    # V1 ngram_gpu: update_scheduler_for_invalid_drafts waits for the valid-draft count to trim
    "valid_draft_counts": SyncPoint(name="valid_draft_counts", phase="prep"),
    # what-ifs, absent by default: `.item()` / GPU boolean-mask indexing in metadata build (#38047)
    "metadata_item": SyncPoint(name="metadata_item", phase="prep"),
    "bool_mask_index": SyncPoint(name="bool_mask_index", phase="prep"),
}
# The what-ifs that run a device operation of their own (its kernels, their copy back to the host and the host's
# wake-up: `engine.host_work.SYNC_OPS` at the measured levels), which costs its round trip even where the step's
# data was read already; the others only wait for the data and read it back.
DEVICE_OP_SYNCS = frozenset({"metadata_item", "bool_mask_index"})
# Not a sync point one can remove: settling a step needs its output (engine core `get_output`).
OUTPUT_READBACK = "output_readback"
# The host phases a sync point can sit in, in loop order.
HOST_PHASES = ("schedule", "prep", "launch", "update")


@dataclass(frozen=True)
class Mode:
    """How a point's engine behaves, resolved from its scenario."""

    depth: int
    k: int
    optimistic: bool
    trim: bool  # host trims invalid drafts, so it must know the valid count before prep
    ngram_cpu: bool
    syncs: tuple[SyncPoint, ...]
    note: str = ""
    # `engine.speculation.k_schedule` sorted by batch size, as (batch size, k) pairs; empty: every step drafts k
    k_schedule: tuple[tuple[int, int], ...] = ()


def resolve_mode(sc: Scenario) -> Mode:
    """Effective depth, drafting and sync points of a point; raises ScenarioError on bad edits."""
    spec = sc.engine.speculation
    k = spec.k if spec.proposer != "none" else 0
    schedule = tuple(sorted(spec.k_schedule.items())) if spec.k_schedule is not None and k else ()
    depth, note = sc.scheduler.depth, ""
    if spec.proposer == "ngram_cpu" and depth > 1:
        # vLLM disables async scheduling for the CPU n-gram proposer (v1_async_sched_incompat)
        depth, note = 1, f"ngram_cpu is incompatible with async scheduling: depth {sc.scheduler.depth} -> 1"
    active = set()
    if depth > 1 and k > 0 and sc.scheduler.policy == "wait":
        active.add("accepted_counts")
    if depth > 1 and k > 0 and spec.proposer == "ngram_gpu" and spec.invalid_slots == "trim":
        active.add("valid_draft_counts")
    edits = sc.scheduler.sync_points
    for name in edits.remove:
        if name == OUTPUT_READBACK:
            raise ScenarioError(f"scheduler.sync_points.remove: {OUTPUT_READBACK} cannot be removed")
        if name not in KNOWN_SYNC_POINTS:
            raise ScenarioError(
                f"scheduler.sync_points.remove: unknown sync point {name!r}; known: {', '.join(KNOWN_SYNC_POINTS)}"
            )
        active.discard(name)
    syncs = [KNOWN_SYNC_POINTS[n] for n in KNOWN_SYNC_POINTS if n in active]
    for item in edits.add:
        if isinstance(item, str):
            if item not in KNOWN_SYNC_POINTS:
                raise ScenarioError(
                    f"scheduler.sync_points.add: unknown sync point {item!r}; known: "
                    f"{', '.join(KNOWN_SYNC_POINTS)} (or give {{name, phase, waits_for}})"
                )
            item = KNOWN_SYNC_POINTS[item]
        if item.name not in {s.name for s in syncs}:
            syncs.append(item)
    # Trimming needs the valid-draft count on the host; without its sync (or at depth 1, where the
    # host already holds the outputs) the engine can only verify every slot.
    trim = k > 0 and (
        spec.proposer == "ngram_cpu"
        or (spec.invalid_slots == "trim" and (depth == 1 or any(s.name == "valid_draft_counts" for s in syncs)))
    )
    optimistic = depth > 1 and k > 0 and sc.scheduler.policy == "optimistic"
    return Mode(depth, k, optimistic, trim, spec.proposer == "ngram_cpu", tuple(syncs), note, schedule)
