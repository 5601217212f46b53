"""GPU benchmark of the rejection sampler: OLD_FILE (the committed kernel, e.g. from
`git show main:simharness/kernels/rejection_triton.py > /tmp/old_rejection.py`) against this tree's, timed
alternately; then a distribution check of the new kernel's random rows on CUDA.

    python3 scratch/sampler_bench.py /tmp/old_rejection.py
"""

import functools
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_rejection import position_pvalues  # noqa: E402

from simharness.bench import measure_copy_bandwidth, time_call  # noqa: E402
from simharness.kernels.rejection_triton import rejection_sample_triton as new_sampler  # noqa: E402

K, VOCAB, ROUNDS, REPEATS = 4, 128256, 3, 25


def load_sampler(path: str):
    spec = importlib.util.spec_from_file_location("old_rejection_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rejection_sample_triton


def timing(old_sampler, device: torch.device, copy_gbps: float) -> None:
    print(f"{'dtype':6} {'B':>4} {'mode':7} {'old µs median (min-max)':>26} {'old %':>6} "
          f"{'new µs median (min-max)':>26} {'new %':>6}")  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (256, 64, 16):
            logits = torch.randn((batch, K + 1, VOCAB), generator=generator, device=device).to(dtype)
            drafts = torch.randint(0, VOCAB, (batch, K), generator=generator, device=device)
            num_drafts = torch.full((batch,), K, device=device)
            seed = torch.ones(1, dtype=torch.int64, device=device)
            read_bytes = logits.numel() * logits.element_size()
            temperatures = {
                "greedy": torch.zeros(batch, device=device),
                "random": torch.ones(batch, device=device),
                "mixed": torch.arange(batch, device=device).remainder(2).float(),
            }
            for mode, temperature in temperatures.items():
                calls = {name: functools.partial(sampler, logits, drafts, num_drafts, temperature, seed=seed)
                         for name, sampler in (("old", old_sampler), ("new", new_sampler))}  # fmt: skip
                times: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(ROUNDS):
                    for name, call in calls.items():
                        times[name].append(time_call(call, device, REPEATS)[0] * 1e3)
                line = f"{str(dtype).removeprefix('torch.'):6} {batch:4} {mode:7}"
                for name in ("old", "new"):
                    us = statistics.median(times[name])
                    pct = 100 * read_bytes / (us * 1e-6) / 1e9 / copy_gbps
                    line += f" {f'{us:.1f} ({min(times[name]):.1f}-{max(times[name]):.1f})':>26} {pct:6.1f}"
                (old_output, old_emitted), (new_output, new_emitted) = calls["old"](), calls["new"]()
                greedy = temperature == 0
                if not (torch.equal(old_output[greedy], new_output[greedy]) and
                        torch.equal(old_emitted[greedy], new_emitted[greedy])):  # fmt: skip
                    line += "  GREEDY ROWS DIFFER"
                last = (new_emitted - 1).long()[:, None]
                final = new_output.gather(1, last).squeeze(1)
                rejected = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1).gather(1, last).squeeze(1)
                if not ((final >= 0) & (final < VOCAB) & (final != rejected)).all():
                    line += "  NEW: AN EMITTED TOKEN OUT OF RANGE OR EQUAL TO THE REJECTED DRAFT"
                print(line, flush=True)
            del logits


def distribution(device: torch.device) -> None:
    """One target row repeated (mass on 8 columns over V = 1000, the rest at -30; bf16: two tiles of 512, fp32:
    one), drafts drawn from q (mostly the argmax): at each position the (accepted, token) joint given that the
    position is reached must be q p / p (1 - q), and the bonus p. Chi-squared p-values, one per position."""
    rows, vocab, temperature = 20_000, 1000, 0.8
    generator = torch.Generator().manual_seed(7)
    hot = torch.tensor([2, 130, 400, 511, 512, 600, 871, 999])
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.full((K + 1, vocab), -30.0)
        logits[:, hot] = torch.randn(K + 1, len(hot), generator=generator) * 1.5
        logits = logits.to(dtype)
        p = torch.softmax(logits.double() / temperature, dim=-1)
        q = torch.zeros(K, vocab, dtype=torch.float64)
        q[:, hot] = 0.3 / len(hot)
        q[torch.arange(K), p[:K].argmax(dim=-1)] += 0.7
        drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T.contiguous()
        output, num_emitted = new_sampler(
            logits.to(device).expand(rows, -1, -1), drafts.to(device), torch.full((rows,), K, device=device),
            torch.full((rows,), temperature, device=device), seed=123,
        )  # fmt: skip
        pvalues = position_pvalues(output.cpu(), num_emitted.cpu(), p, q)
        print(f"random rows, {str(dtype).removeprefix('torch.')}, {rows} rows, V={vocab}: chi-squared p-value per "
              f"position {', '.join(f'{v:.3g}' for v in pvalues)} (correct: < 1e-4 once in 10,000)")  # fmt: skip


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python3 scratch/sampler_bench.py OLD_FILE")
    device = torch.device("cuda")
    old_sampler = load_sampler(sys.argv[1])
    copy_gbps = measure_copy_bandwidth(device, False)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy_gbps:.0f} GB/s; K={K}, V={VOCAB}, every row "
          f"{K} drafts; device µs by time_call ({REPEATS}-call medians, L2 flushed), median of {ROUNDS} rounds "
          "with the lowest-highest round; % of copy bandwidth for the logits read once")  # fmt: skip
    timing(old_sampler, device, copy_gbps)
    distribution(device)


if __name__ == "__main__":
    main()
