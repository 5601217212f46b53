"""A/B of the Triton rejection sampler on CUDA: OLD_FILE (another version of `simharness/kernels/rejection_triton.py`,
e.g. main's: `git show main:simharness/kernels/rejection_triton.py > /tmp/old_rejection.py`) against this tree's,
timed alternately in one process; every case also checks that both emit the same tokens (random rows too: same seed).

    python3 benchmarks/sampler_ab.py /tmp/old_rejection.py [--configs]

k = 4, V = 128,256, every row 4 random drafts, the seed a device tensor (as the decode step's graph passes it);
device µs by `bench.time_call` (25-call medians after an L2 flush), the median of 3 rounds with the lowest-highest
round; % of copy bandwidth for the logits read once, and at B <= 64 the time over that bandwidth floor. Default:
B = 256/64/16/1, bf16 and fp32, greedy / random / mixed rows, then the same-tokens check on drafts that are mostly
accepted (long chains). --configs: this tree's kernel under a few (BLOCK, warps, register cap) choices instead
(patching `rejection_triton._CONFIGS`), at B = 256 and 64 in both dtypes, the old kernel alongside; with a BLOCK
other than the old one's, random rows may differ where rounding moves the inverse-CDF sample (other tiles' sums).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
from collections.abc import Callable

import torch

from simharness.bench import measure_copy_bandwidth, time_rounds
from simharness.kernels import rejection_triton
from simharness.kernels.rejection_triton import rejection_sample_triton as new_sampler

K, VOCAB, ROUNDS, REPEATS = 4, 128256, 3, 25
# (BLOCK, num_warps, maxnreg) choices for --configs by logits element size; the first of each is the committed one.
CONFIGS = {
    2: [(512, 1, None), (512, 1, 128), (512, 2, 128), (512, 2, None), (512, 4, 128), (1024, 1, 128), (1024, 2, 128),
        (1024, 4, 128), (2048, 4, 128), (256, 1, 128)],
    4: [(2048, 4, 128), (2048, 4, None), (2048, 8, 128), (1024, 4, 128), (1024, 2, 128), (4096, 8, 128)],
}  # fmt: skip
Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def load_sampler(path: str) -> Sampler:
    spec = importlib.util.spec_from_file_location("old_rejection_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rejection_sample_triton


def configured(size: int, config: tuple[int, int, int | None], *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """This tree's sampler with `config` as its (BLOCK, warps, register cap) for logits of `size` bytes."""
    rejection_triton._CONFIGS[size] = config
    return new_sampler(*args, **kwargs)


def compiled_kernels() -> set:
    """This tree's compiled kernels so far (Triton's per-device caches: kernel cache first)."""
    kernels = (rejection_triton._rejection_tile_kernel, rejection_triton._rejection_walk_kernel)
    return {compiled for kernel in kernels for cache in kernel.device_caches.values() for compiled in cache[0].values()}


def registers(before: set) -> str:
    """Registers and spilled bytes of the kernels compiled since `before`."""
    kernels = compiled_kernels() - before  # n_regs and n_spills are set at a kernel's first launch
    text = [f"{getattr(k, 'n_regs', '?')} regs, {getattr(k, 'n_spills', '?')} B spilled a thread" for k in kernels]
    return ", ".join(text) or "cached"


def inputs(batch: int, dtype: torch.dtype, generator: torch.Generator, chains: bool) -> tuple[torch.Tensor, ...]:
    """Logits, drafts, num_drafts: random drafts (rejected at once by random rows), or with `chains` peaked logits
    whose argmax is mostly the draft (some random, some -1) and a random number of drafts."""
    device = generator.device
    logits = torch.randn((batch, K + 1, VOCAB), generator=generator, device=device) * (8 if chains else 1)
    logits = logits.to(dtype)
    drafts = torch.randint(0, VOCAB, (batch, K), generator=generator, device=device)
    num_drafts = torch.full((batch,), K, device=device)
    if chains:
        choice = torch.rand(batch, K, generator=generator, device=device)
        argmax = logits.float().argmax(dim=-1)[:, :K]
        drafts = torch.where(choice < 0.8, argmax, torch.where(choice < 0.9, drafts, -1))
        num_drafts = torch.randint(0, K + 1, (batch,), generator=generator, device=device)
    return logits, drafts, num_drafts


def temperatures(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "greedy": torch.zeros(batch, device=device),
        "random": torch.ones(batch, device=device),
        "mixed": torch.arange(batch, device=device).remainder(2).float(),
    }


def compare(old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], greedy: torch.Tensor,
            drafts: torch.Tensor, num_drafts: torch.Tensor) -> str:  # fmt: skip
    """'same tokens', or what differs (loudly where it must not), and any malformed output of the new kernel."""
    same = torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
    same_greedy = torch.equal(old[0][greedy], new[0][greedy]) and torch.equal(old[1][greedy], new[1][greedy])
    rows = int(((old[0] != new[0]).any(dim=1) | (old[1] != new[1])).sum())
    differ = f"{rows} of {len(greedy)} rows differ"
    verdict = (
        "same tokens" if same else f"MISMATCH, RANDOM ROWS: {differ}" if same_greedy else f"GREEDY MISMATCH: {differ}"
    )
    last = (new[1] - 1).long()
    final = new[0].gather(1, last[:, None]).squeeze(1)
    draft = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], dim=1).gather(1, last[:, None]).squeeze(1)
    rejected = torch.where(last < num_drafts, draft, -1)  # the bonus position replaces no draft
    if not ((new[1] >= 1) & (last <= num_drafts) & (final >= 0) & (final < VOCAB) & (final != rejected)).all():
        verdict += "  MALFORMED: AN EMITTED TOKEN OUT OF RANGE OR EQUAL TO THE REJECTED DRAFT"
    return verdict


def timed(calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, list[float]]:
    """µs of each call, `ROUNDS` rounds, the calls alternating within a round (`bench.time_rounds`)."""
    return {name: [ms * 1e3 for ms in times] for name, times in time_rounds(calls, device, REPEATS, ROUNDS).items()}


def cell(us: list[float], read_bytes: int, copy_gbps: float, batch: int) -> str:
    median = statistics.median(us)
    floor_us = read_bytes / (copy_gbps * 1e9) * 1e6
    text = f"{median:7.1f} ({min(us):.1f}-{max(us):.1f}) {100 * floor_us / median:5.1f}%"
    return text + (f" {median / floor_us:4.2f}x" if batch <= 64 else "      ")


def ab(old_sampler: Sampler, device: torch.device, copy_gbps: float) -> int:
    """The timing table, old against new; returns the number of cases whose tokens differ."""
    mismatches = 0
    columns = "µs (min-max) % floor-ratio"
    print(f"{'dtype':8} {'B':>4} {'mode':7} {'old ' + columns:>36} {'new ' + columns:>36}")
    generator = torch.Generator(device=device).manual_seed(0)
    seed = torch.ones(1, dtype=torch.int64, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        before = compiled_kernels()
        for batch in (256, 64, 16, 1):
            logits, drafts, num_drafts = inputs(batch, dtype, generator, chains=False)
            read_bytes = logits.numel() * logits.element_size()
            for mode, temperature in temperatures(batch, device).items():
                calls = {name: functools.partial(sampler, logits, drafts, num_drafts, temperature, seed=seed)
                         for name, sampler in (("old", old_sampler), ("new", new_sampler))}  # fmt: skip
                times = timed(calls, device)
                verdict = compare(calls["old"](), calls["new"](), temperature == 0, drafts, num_drafts)
                mismatches += verdict != "same tokens"
                print(f"{str(dtype).removeprefix('torch.'):8} {batch:4} {mode:7} "
                      f"{cell(times['old'], read_bytes, copy_gbps, batch):>36} "
                      f"{cell(times['new'], read_bytes, copy_gbps, batch):>36}  {verdict}", flush=True)  # fmt: skip
        print(f"new kernel, {str(dtype).removeprefix('torch.')}: {registers(before)}")
    return mismatches


def chains(old_sampler: Sampler, device: torch.device) -> int:
    """Same tokens on long accept chains (peaked logits, drafts mostly the argmax), temperatures 0, 0.7 and 1.3,
    several seeds; returns the number of cases whose tokens differ."""
    mismatches = 0
    generator = torch.Generator(device=device).manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (256, 64, 16, 1):
            logits, drafts, num_drafts = inputs(batch, dtype, generator, chains=True)
            temperature = torch.tensor([0.0, 0.7, 1.3], device=device).repeat(batch)[:batch]
            for seed in range(3):
                args = (logits, drafts, num_drafts, temperature)
                new = new_sampler(*args, seed=seed)
                verdict = compare(old_sampler(*args, seed=seed), new, temperature == 0, drafts, num_drafts)
                mismatches += verdict != "same tokens"
                emitted = new[1].float().mean()
                print(f"chains {str(dtype).removeprefix('torch.'):8} B={batch:<4} seed {seed}: {verdict} "
                      f"(new: {emitted:.2f} tokens a row)")  # fmt: skip
    return mismatches


def configs(old_sampler: Sampler, device: torch.device, copy_gbps: float) -> None:
    """This tree's kernel under each of CONFIGS, the old kernel alongside, B = 256 and 64."""
    committed = dict(rejection_triton._CONFIGS)
    generator = torch.Generator(device=device).manual_seed(0)
    seed = torch.ones(1, dtype=torch.int64, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        for batch in (256, 64):
            logits, drafts, num_drafts = inputs(batch, dtype, generator, chains=False)
            read_bytes = logits.numel() * logits.element_size()
            for mode, temperature in temperatures(batch, device).items():
                args = (logits, drafts, num_drafts, temperature)
                calls: dict[str, Callable[[], object]] = {"old": functools.partial(old_sampler, *args, seed=seed)}
                notes = {"old": ""}
                for config in CONFIGS[size]:
                    before = compiled_kernels()
                    verdict = compare(old_sampler(*args, seed=seed), configured(size, config, *args, seed=seed),
                                      temperature == 0, drafts, num_drafts)  # fmt: skip
                    notes[str(config)] = f"{verdict}; {registers(before)}"
                    calls[str(config)] = functools.partial(configured, size, config, *args, seed=seed)
                times = timed(calls, device)
                rejection_triton._CONFIGS.update(committed)
                for name, us in times.items():
                    print(f"{str(dtype).removeprefix('torch.'):8} {batch:4} {mode:7} {name:18} "
                          f"{cell(us, read_bytes, copy_gbps, batch)}  {notes[name]}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_file", help="another version of simharness/kernels/rejection_triton.py")
    parser.add_argument("--configs", action="store_true", help="time (BLOCK, warps, register cap) choices instead")
    args = parser.parse_args()
    device = torch.device("cuda")
    old_sampler = load_sampler(args.old_file)
    copy_gbps = measure_copy_bandwidth(device, False)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy_gbps:.0f} GB/s; K={K}, V={VOCAB}; device µs "
          f"by time_call ({REPEATS}-call medians, L2 flushed), median of {ROUNDS} rounds (lowest-highest round), % of "
          "copy bandwidth for the logits read once, and at B <= 64 the time over that floor")  # fmt: skip
    if args.configs:
        configs(old_sampler, device, copy_gbps)
        return
    mismatches = ab(old_sampler, device, copy_gbps) + chains(old_sampler, device)
    print("all cases: same tokens" if mismatches == 0 else f"MISMATCH: {mismatches} CASES DIFFER FROM THE OLD KERNEL")


if __name__ == "__main__":
    main()
