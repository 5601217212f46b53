"""The sizes the decode loop captures CUDA graphs at: batch buckets of the decode step, token buckets of a prefill
chunk. A batch or chunk runs as the smallest bucket that holds it, so the device works on the bucket's size; the
sim's cost model and the profile's fit count a prefill chunk at its bucket (`prefill_bucket`). No torch here: the
sim imports it."""

from simharness.jit import njit


def batch_buckets(max_slots: int) -> list[int]:
    """The batch sizes captured as CUDA graphs (1, 2, 4, then multiples of 8, and max_slots): a batch replays the
    smallest that holds it, its extra rows padded onto the scratch slot."""
    return sorted({s for s in [1, 2, 4, *range(8, max_slots + 1, 8)] if s <= max_slots} | {max_slots})


def prefill_sizes(longest: int) -> list[int]:
    """The token buckets of the prefill graphs that cover chunks up to `longest` tokens: 16, 32, then steps of
    64 up to 1024 and of 256 beyond (a chunk pads to the next one: at most 63 tokens of extra device work up to
    1024, a quarter at most beyond). vLLM captures its piecewise graphs at such token-count buckets too."""
    sizes = [16, 32, *range(64, 1025, 64)]
    while sizes[-1] < longest:
        sizes.append(sizes[-1] + 256)
    return [s for s in sizes if s < longest] + [next(s for s in sizes if s >= longest)]


@njit
def prefill_bucket(tokens: int) -> int:
    """The token bucket a chunk of `tokens` replays (the last of `prefill_sizes(tokens)`), in closed form."""
    if tokens <= 32:
        return 16 if tokens <= 16 else 32
    if tokens <= 1024:
        return (tokens + 63) // 64 * 64
    return 1024 + (tokens - 1024 + 255) // 256 * 256
