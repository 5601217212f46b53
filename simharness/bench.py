"""Kernel benchmark: n-gram proposer and rejection sampler (reference / torch / Triton), with the achieved
bandwidth of the sampler next to the device's measured copy bandwidth, and the model verify step next to
its memory and compute floors. Writes kernels.csv and kernels.md. Above the engine: it builds the
target model.

`run_kernel_bench` = the `*_rows` functions (measure) + `write_tables` (render); other benchmarks append their rows
(same columns, their own `kernel` name) before `write_tables`, which renders one table per kernel.
"""

import datetime
import functools
import gc
import math
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from simharness.engine.decode import DecodeLoop
from simharness.engine.model import Transformer, get_config, model_sizes
from simharness.kernels.ngram import propose_ngram_reference, propose_ngram_torch
from simharness.kernels.rejection import rejection_sample_reference

Row = dict[str, object]

MIN_N, MAX_N, K = 2, 5, 4
NGRAM_VOCAB = 1024  # small enough that 2- to 5-gram matches occur in random histories
REFERENCE_NGRAM_MAX_TOKENS = 16 * 2048  # B * L above this: the pure-Python reference is skipped
# Read before every timed CUDA repeat, so inputs come from HBM. A read, not a write: a written buffer leaves L2 full
# of dirty lines whose write-back the timed call then pays (6-8 us a call on an H100: a copy of 82 MB took 58.4 us
# after a write flush and 52.4 us after a read; results/kernels/sampler-variants/NOTES.md).
L2_FLUSH_BYTES = 256 * 2**20
HOST_AHEAD_CYCLES = 4_000_000  # ~2 ms of GPU sleep: the host queues the whole call before it starts
MATMUL_SIZE = 8192  # square bf16 matrix product that measures the peak dense FLOP rate
# The verify step and the whole decode step: (preset, batch sizes) per run, the 8B shape only in a full CUDA run;
# every row after VERIFY_CONTEXT tokens.
STEP_CUDA = [("llama-3.2-1b", [1, 8, 16, 32, 64]), ("llama-3-8b", [1, 16])]
STEP_QUICK = [("llama-3.2-1b", [1, 16])]
STEP_CPU = [("tiny", [1, 8])]
VERIFY_CONTEXT = 512
# Rendered after the columns that describe a row.
MEASURED_COLUMNS = [
    "device_ms", "wall_ms", "speedup_vs_torch", "logits_gb_per_s", "pct_of_copy_bw",
    "weights_floor_ms", "x_weights_floor", "weights_kv_floor_ms", "compute_floor_ms", "best_floor_x_weights",
    "x_best_floor", "launch_us", "launch_p10_us", "launch_p90_us", "device_p10_ms", "device_p90_ms", "step_event_ms",
]  # fmt: skip


def run_kernel_bench(device: str, out_dir: Path, quick: bool = False,
                     progress: Callable[[str], None] = lambda what: None) -> pd.DataFrame:
    """Measure every kernel row on `device` and write kernels.csv / kernels.md to out_dir; `progress(what)` is
    called as each group of rows starts (minutes apart on CPU)."""
    dev = torch.device(device)
    progress("copy bandwidth and matmul peak")
    copy_gbps = measure_copy_bandwidth(dev, quick)
    peak_tflops = measure_matmul_tflops(dev)
    rows = ngram_rows(dev, quick, progress) + rejection_rows(dev, quick, copy_gbps, progress)
    rows += verify_rows(dev, quick, copy_gbps, peak_tflops, progress)
    frame = pd.DataFrame(rows + decode_rows(dev, quick, copy_gbps, peak_tflops, progress))
    write_tables(frame, dev, Path(out_dir), copy_gbps, quick, peak_tflops)
    return frame


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median device time, median wall time) of fn in ms. On CUDA the device time is taken with events
    after an L2 flush (a read of L2_FLUSH_BYTES) while the host is ahead (so launch gaps are excluded); the wall
    time is one call plus a synchronize from an idle GPU (launch overhead included). On CPU both are wall times."""
    for _ in range(3):
        fn()  # warm-up: Triton compilation, allocator
    _sync(device)
    wall = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        wall.append((time.perf_counter() - start) * 1e3)
    if device.type != "cuda":
        return statistics.median(wall), statistics.median(wall)
    flush = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    gpu = []
    for _ in range(repeats):
        flush.sum()
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        fn()
        end_event.record()
        end_event.synchronize()
        gpu.append(start_event.elapsed_time(end_event))
    return statistics.median(gpu), statistics.median(wall)


def time_rounds(calls: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                rounds: int) -> dict[str, list[float]]:
    """Each call's device time (`time_call`, ms) in each of `rounds` rounds, the calls alternating within a round, so
    that a drift of the machine lands on every call alike (the A/B benchmarks take the median and the round spread)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(time_call(call, device, repeats)[0])
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, quick: bool) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    size = (64 if quick or device.type != "cuda" else 1024) * 2**20
    src = torch.randint(0, 127, (size,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    device_ms, _ = time_call(lambda: dst.copy_(src), device, repeats=20)
    return 2 * size / (device_ms * 1e-3) / 1e9


def measure_matmul_tflops(device: torch.device) -> float:
    """TFLOP/s of a square matrix product (bf16 on CUDA, fp32 elsewhere; smaller on CPU)."""
    size, dtype = (MATMUL_SIZE, torch.bfloat16) if device.type == "cuda" else (MATMUL_SIZE // 8, torch.float32)
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    out = torch.empty_like(a)
    device_ms, _ = time_call(lambda: torch.mm(a, b, out=out), device, repeats=10)
    return 2 * size**3 / (device_ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------------
# N-gram proposer
# --------------------------------------------------------------------------------------------------


def ngram_rows(device: torch.device, quick: bool, progress: Callable[[str], None]) -> list[Row]:
    batches = [16, 64] if quick else [16, 64, 256]
    widths = [2048, 8192] if quick else [2048, 8192, 32768]
    repeats = 5 if quick or device.type != "cuda" else 25
    generator = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    for batch in batches:
        for width in widths:
            progress(f"n-gram proposer: batch {batch}, width {width}")
            token_ids = torch.randint(0, NGRAM_VOCAB, (batch, width), generator=generator, device=device)
            token_ids = token_ids.to(torch.int32)
            # Lengths: uniform in [L/8, L/2], and a short-context case with every length <= 4k.
            profiles = {
                f"U[{width // 8},{width // 2}]": (width // 8, width // 2),
                f"U[256,{min(width, 4096)}]": (256, min(width, 4096)),
            }
            for lengths, (low, high) in profiles.items():
                seq_lens = torch.randint(low, high + 1, (batch,), generator=generator, device=device)
                impls: dict[str, Callable] = {"torch": propose_ngram_torch}
                if device.type == "cuda":
                    from simharness.kernels.ngram_triton import propose_ngram_triton  # Triton: only on CUDA

                    impls["triton"] = propose_ngram_triton
                if batch * width <= REFERENCE_NGRAM_MAX_TOKENS:
                    impls["reference"] = propose_ngram_reference
                for impl_name, impl in impls.items():
                    call = functools.partial(impl, token_ids, seq_lens, min_n=MIN_N, max_n=MAX_N, k=K)
                    device_ms, wall_ms = time_call(call, device, 3 if impl_name == "reference" else repeats)
                    rows.append(
                        {"kernel": "ngram", "impl": impl_name, "dtype": "int32", "batch": batch, "width": width,
                         "lengths": lengths, "device_ms": device_ms, "wall_ms": wall_ms}
                    )  # fmt: skip
    torch_ms = {(r["batch"], r["width"], r["lengths"]): r["device_ms"] for r in rows if r["impl"] == "torch"}
    for row in rows:
        row["speedup_vs_torch"] = torch_ms[(row["batch"], row["width"], row["lengths"])] / row["device_ms"]
    return rows


# --------------------------------------------------------------------------------------------------
# Rejection sampler
# --------------------------------------------------------------------------------------------------


def rejection_rows(device: torch.device, quick: bool, copy_gbps: float, progress: Callable[[str], None]) -> list[Row]:
    batches = [16, 64] if quick else [16, 64, 256]
    vocab = 32000 if quick else 128256
    repeats = 5 if quick or device.type != "cuda" else 25
    impls: dict[str, Callable] = {"reference": rejection_sample_reference}
    if device.type == "cuda":
        from simharness.kernels.rejection_triton import rejection_sample_triton  # Triton: only on CUDA

        impls["triton"] = rejection_sample_triton
    generator = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch in batches:
            progress(f"rejection sampler: {str(dtype).removeprefix('torch.')}, batch {batch}")
            logits = torch.randn((batch, K + 1, vocab), generator=generator, device=device).to(dtype)
            drafts = torch.randint(0, vocab, (batch, K), generator=generator, device=device)
            num_drafts = torch.full((batch,), K, device=device)
            temperatures = {
                "greedy": torch.zeros(batch, device=device),
                "random": torch.ones(batch, device=device),
                "mixed": torch.arange(batch, device=device).remainder(2).float(),
            }
            read_bytes = logits.numel() * logits.element_size()  # every position <= num_drafts is read
            # The Triton sampler reads its seed from device memory, as the decode step's graph gives it (an int
            # seed would add a fill kernel to every call); the reference seeds a torch.Generator.
            seeds = {"reference": 1, "triton": torch.ones(1, dtype=torch.int64, device=device)}
            for mode, temperature in temperatures.items():
                for impl_name, impl in impls.items():
                    call = functools.partial(impl, logits, drafts, num_drafts, temperature, seed=seeds[impl_name])
                    device_ms, wall_ms = time_call(call, device, repeats)
                    gbps = read_bytes / (device_ms * 1e-3) / 1e9
                    rows.append(
                        {"kernel": "rejection", "impl": impl_name, "dtype": str(dtype).removeprefix("torch."),
                         "batch": batch, "k": K, "vocab": vocab, "mode": mode, "device_ms": device_ms,
                         "wall_ms": wall_ms, "logits_gb_per_s": gbps, "pct_of_copy_bw": 100 * gbps / copy_gbps}
                    )  # fmt: skip
            del logits
    return rows


# --------------------------------------------------------------------------------------------------
# Verify step
# --------------------------------------------------------------------------------------------------


def verify_rows(device: torch.device, quick: bool, copy_gbps: float, peak_tflops: float,
                progress: Callable[[str], None]) -> list[Row]:
    """The model verify step (k drafts + 1 per row, after VERIFY_CONTEXT cached tokens; CUDA graphs on CUDA)
    next to three floors: weights / copy bandwidth, (weights + K/V read) / copy bandwidth, FLOPs / peak."""
    return _step_rows("verify", bench_verify_step, device, quick, copy_gbps, peak_tflops, progress)


def _step_rows(what: str, bench: Callable[..., list[Row]], device: torch.device, quick: bool, copy_gbps: float,
               peak_tflops: float, progress: Callable[[str], None]) -> list[Row]:
    """`bench`'s rows for each preset of the run's size, one model at a time."""
    runs = STEP_CPU if device.type != "cuda" else STEP_QUICK if quick else STEP_CUDA
    repeats = 5 if quick or device.type != "cuda" else 50
    rows: list[Row] = []
    for preset, batches in runs:
        progress(f"{what} step: {preset}, batches {', '.join(map(str, batches))}")
        rows += bench(preset, batches, K, device, repeats, bandwidth=copy_gbps * 1e9, peak_flops=peak_tflops * 1e12)
        gc.collect()  # the model is freed before the next preset is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def write_tables(
    frame: pd.DataFrame, device: torch.device, out_dir: Path, copy_gbps: float, quick: bool, peak_tflops: float
) -> None:
    """kernels.csv (all rows) and kernels.md (a header with device, date and versions; a table per kernel)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out_dir / "kernels.csv", index=False)
    timing = (
        "CUDA events around each call after a 256 MiB L2 flush (a read: no dirty lines left to write back), with the "
        "host queued ahead (device_ms); "
        "one call + synchronize from an idle GPU (wall_ms, includes launch overhead)"
        if device.type == "cuda"
        else "time.perf_counter around each call (device_ms = wall_ms)"
    )
    matmul = f"{MATMUL_SIZE} bf16" if device.type == "cuda" else f"{MATMUL_SIZE // 8} fp32"
    lines = [
        "# Kernel benchmark",
        "",
        f"- device: {device_name(device)} ({device.type})",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- torch {torch.__version__}, triton {_installed('triton')}, python {platform.python_version()}",
        f"- produced by simharness.bench.run_kernel_bench(device={str(device)!r}, quick={quick})",
        f"- measured copy bandwidth: {copy_gbps:.0f} GB/s (device-to-device copy, bytes read + written)",
        f"- measured matrix-product peak: {peak_tflops:.3g} TFLOP/s (torch.mm of two square {matmul} matrices)",
        f"- timing: {timing}; medians of 25 repeats (5 when quick or on CPU; 3 for the n-gram reference)",
        f"- sizes: {'quick' if quick else 'full'}; n-gram min_n={MIN_N} max_n={MAX_N} k={K}, int32 histories of "
        f"random tokens from a {NGRAM_VOCAB}-token vocabulary; the pure-Python n-gram reference runs only for "
        f"B*L <= {REFERENCE_NGRAM_MAX_TOKENS} (too slow above); Triton rows need CUDA",
        "- rejection: every row has k drafts (all k+1 positions are read); logits_gb_per_s = logits bytes / "
        "device_ms (the Triton sampler's two kernels, its seed in device memory as the decode step gives it); "
        "pct_of_copy_bw compares it with the measured copy bandwidth",
        f"- verify: one model verify step, B rows x (k+1) tokens after {VERIFY_CONTEXT} cached tokens per row, "
        "random weights, CUDA-graph replay on CUDA; device_ms = median of CUDA events around 50 back-to-back steps "
        "(5 when quick or on CPU, wall clock on CPU). Floors: weights_floor_ms = bytes of weights a step reads "
        "(every matrix and norm once; an untied embedding table is only gathered) / copy bandwidth; "
        "weights_kv_floor_ms adds the K/V cache bytes the rows read (context + k+1 positions x layers x "
        "2 x kv_heads x head_dim x element bytes); compute_floor_ms = (2 x matmul params + attention FLOPs) x tokens / "
        "the measured matrix-product peak; x_weights_floor = device_ms / weights_floor_ms; best floor = "
        "max(weights_kv_floor_ms, compute_floor_ms) (memory and compute overlap at best), best_floor_x_weights = "
        "best floor / weights_floor_ms (what no implementation can beat, in units of the weight-read floor), "
        "x_best_floor = device_ms / best floor",
        f"- decode_step: the whole decode step (verify, rejection sampler, commit, n-gram proposer, the copy of the "
        f"results to pinned host memory), B greedy requests after {VERIFY_CONTEXT}-token random prompts, k={K}; impl "
        "eager = the step's ops enqueued one by one around the verify's CUDA graph (the engine before the step "
        "graphs), step_graph = the whole step replayed as one CUDA graph (staged = the same staging on the CPU, "
        "nothing captured); launch_us = host time of `DecodeLoop.step` from an idle device (median, p10, p90 of 50; "
        "5 when quick or on CPU); device_ms = sum of the step's part times with the host queued ahead (CUDA events "
        "eager; step_graph: the graph's %globaltimer stamps, its first part taking in the input and output copies "
        "from events around the step); step_event_ms = CUDA events around the whole step, "
        "input and output copies included; x_best_floor = device_ms / the verify's best floor (as for verify)",
    ]
    for kernel, table in kernel_tables(frame):
        lines += ["", f"## {kernel}", "", *markdown_table(table)]
    (out_dir / "kernels.md").write_text("\n".join(lines) + "\n")


def kernel_tables(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One table per kernel with only the columns it fills: what describes a row, then what was measured."""
    tables = []
    for kernel, table in frame.groupby("kernel", sort=False):
        table = table.dropna(axis=1, how="all").drop(columns="kernel")
        whole = [c for c in table.columns if table[c].dtype.kind == "f" and (table[c].dropna() % 1 == 0).all()
                 and c not in MEASURED_COLUMNS]
        table = table.astype(dict.fromkeys(whole, "Int64"))  # a size column, float only for the other kernels' NaN
        measured = [column for column in MEASURED_COLUMNS if column in table.columns]
        tables.append((str(kernel), table[[column for column in table.columns if column not in measured] + measured]))
    return tables


def _installed(package: str) -> str:
    """A package's installed version, without importing it (Triton is absent from a CPU-only install)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def markdown_table(table: pd.DataFrame) -> list[str]:
    def cell(value: object) -> str:
        if value is pd.NA:
            return ""
        if isinstance(value, float):
            return "" if math.isnan(value) else f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return lines


def bench_verify_step(preset: str, batch_sizes: list[int], k: int, device: torch.device, repeats: int, *,
                      bandwidth: float, peak_flops: float) -> list[Row]:
    """Median time of the model verify step (B rows x (1+k) tokens, each row after VERIFY_CONTEXT cached tokens)
    next to its floors (`verify_floors`; `bandwidth` in bytes/s and `peak_flops` in FLOP/s, measured by the caller).

    Every slot is first prefilled with random tokens so attention reads real K/V. CUDA: event timing of
    back-to-back launches after warm-up (and graph capture); CPU: wall clock.
    """
    config = get_config(preset)
    model = Transformer(config, max_slots=max(batch_sizes), max_len=VERIFY_CONTEXT + k + 1, device=device,
                        cuda_graphs=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    for slot in range(model.max_slots):
        model.prefill(slot, torch.randint(config.vocab_size, (VERIFY_CONTEXT,), generator=gen, device=device))
    rows: list[Row] = []
    for batch in batch_sizes:
        tokens = torch.randint(config.vocab_size, (batch, k + 1), generator=gen, device=device)
        slots = model.slot_ids[:batch]
        start_pos = torch.full((batch,), VERIFY_CONTEXT, dtype=torch.int64, device=device)
        for _ in range(3):
            model.verify(tokens, slots, start_pos)
        if device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]  # fmt: skip
            for begin, end in events:
                begin.record()
                model.verify(tokens, slots, start_pos)
                end.record()
            torch.cuda.synchronize(device)
            times = [begin.elapsed_time(end) for begin, end in events]
        else:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.verify(tokens, slots, start_pos)
                times.append((time.perf_counter() - t0) * 1e3)
        device_ms = statistics.median(times)
        floors = verify_floors(model, batch, k, VERIFY_CONTEXT, bandwidth, peak_flops)
        weights, best = floors["weights_floor_ms"], max(floors["weights_kv_floor_ms"], floors["compute_floor_ms"])
        rows.append(
            {"kernel": "verify", "impl": "cuda_graphs" if model.cuda_graphs else "eager",
             "dtype": "bfloat16" if device.type == "cuda" else "float32", "model": preset, "batch": batch, "k": k,
             "context": VERIFY_CONTEXT, "device_ms": device_ms, "weights_floor_ms": weights,
             "x_weights_floor": device_ms / weights, "weights_kv_floor_ms": floors["weights_kv_floor_ms"],
             "compute_floor_ms": floors["compute_floor_ms"], "best_floor_x_weights": best / weights,
             "x_best_floor": device_ms / best}
        )  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------
# Decode step: host launch time next to device time
# --------------------------------------------------------------------------------------------------


def decode_rows(device: torch.device, quick: bool, copy_gbps: float, peak_tflops: float,
                progress: Callable[[str], None]) -> list[Row]:
    """The whole decode step (verify, sample, commit, propose, the copy back) per batch size: eager (ops enqueued one
    by one around the verify graph on CUDA) and through the step graphs. launch_us is the host time of
    `DecodeLoop.step` from an idle device; device_ms the sum of its parts' device times (events, or the graphs'
    timestamps) with the host queued ahead; step_event_ms CUDA events around the whole step, copies included."""
    return _step_rows("decode", bench_decode_step, device, quick, copy_gbps, peak_tflops, progress)


def verify_floors(model: Transformer, batch: int, k: int, context: int, bandwidth: float,
                  peak_flops: float) -> dict[str, float]:
    """A verify step's floors in ms, B rows of k + 1 tokens after `context` cached ones: the weights a forward reads
    / bandwidth (bytes/s); that plus the rows' K/V over context + k + 1 positions; and (2 x matmul params +
    attention FLOPs: q.k and p.v, 2 per multiply-add, over those positions) x tokens / peak_flops (FLOP/s)."""
    config, n_tokens = model.config, k + 1
    kv_read = model_sizes(config, dtype=model.k_cache.dtype)["kv_bytes_per_token"] * (context + n_tokens) * batch
    matmul_params = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2) + model.output.numel()
    attention = 4 * config.n_layers * config.n_heads * config.head_dim * (context + n_tokens)
    flops = (2 * matmul_params + attention) * batch * n_tokens
    return {"weights_floor_ms": model.weight_bytes() / bandwidth * 1e3,
            "weights_kv_floor_ms": (model.weight_bytes() + kv_read) / bandwidth * 1e3, "kv_read_bytes": kv_read,
            "flops": flops, "compute_floor_ms": flops / peak_flops * 1e3}  # fmt: skip


def bench_decode_step(preset: str, batch_sizes: list[int], k: int, device: torch.device, repeats: int, *,
                      bandwidth: float, peak_flops: float) -> list[Row]:
    """Per batch size and step mode: launch host time (median, p10, p90 in us) from an idle device, device time of
    the step's parts with the host queued ahead (median, p10, p90 in ms), events around the whole step (median ms).
    Every request is a random prompt of VERIFY_CONTEXT tokens, greedy and unsteered; the verify's floors as
    `verify_floors`."""
    config = get_config(preset)
    cuda = device.type == "cuda"
    warmup = 3
    max_len = VERIFY_CONTEXT + 1 + (warmup + 2 * repeats) * (k + 1) + k + 1
    model = Transformer(config, max_slots=max(batch_sizes), max_len=max_len, device=device, cuda_graphs=cuda)
    gen = torch.Generator(device="cpu").manual_seed(1)
    rows = []
    for step_graphs in (False, True):
        loop = DecodeLoop(model, k=k, min_n=2, max_n=5, step_graphs=step_graphs)
        for batch in batch_sizes:
            for slot in range(batch):
                loop.add_request(slot, torch.randint(config.vocab_size, (VERIFY_CONTEXT,), generator=gen))
            slots = np.arange(batch)
            for _ in range(warmup):
                result = loop.step(slots)
                loop.wait(result)
                loop.readback(result)
            launch, device_ms, event_ms = [], [], []
            for _ in range(repeats):  # from an idle device: the host's launch alone
                t0 = time.perf_counter()
                result = loop.step(slots)
                launch.append((time.perf_counter() - t0) * 1e6)
                loop.wait(result)
                loop.readback(result)
            for _ in range(repeats):  # the host queued ahead: the device's own time
                if cuda:
                    torch.cuda._sleep(HOST_AHEAD_CYCLES)
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                result = loop.step(slots)
                if cuda:
                    end.record()
                loop.wait(result)
                out = loop.readback(result)
                device_ms.append(sum(out.parts_s) * 1e3)
                if cuda:
                    end.synchronize()
                    event_ms.append(begin.elapsed_time(end))
            floors = verify_floors(model, batch, k, VERIFY_CONTEXT, bandwidth, peak_flops)
            device_median = statistics.median(device_ms)
            best = max(floors["weights_kv_floor_ms"], floors["compute_floor_ms"])
            rows.append({
                "kernel": "decode_step", "model": preset, "k": k, "context": VERIFY_CONTEXT,
                "impl": ("step_graph" if cuda else "staged") if step_graphs else "eager",
                "dtype": str(model.k_cache.dtype).removeprefix("torch."), "batch": batch,
                "launch_us": statistics.median(launch), "launch_p10_us": _quantile(launch, 0.1),
                "launch_p90_us": _quantile(launch, 0.9), "device_ms": device_median,
                "device_p10_ms": _quantile(device_ms, 0.1), "device_p90_ms": _quantile(device_ms, 0.9),
                "step_event_ms": statistics.median(event_ms) if event_ms else math.nan,
                **{key: floors[key] for key in ("weights_kv_floor_ms", "compute_floor_ms")},
                "x_best_floor": device_median / best,
            })  # fmt: skip
            for slot in range(batch):
                loop.remove_request(slot)
        del loop
    return rows


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q))
