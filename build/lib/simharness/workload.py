"""The workload: requests with real token streams, their lengths, kinds and arrival times.

N-gram acceptance depends on how much a request's output repeats its history, so every request
carries a prompt and a reference continuation cut from the stdlib corpus (`simharness.corpus`).
Three kinds differ in how much the output copies the prompt:
- `code_edit` (high copy): an instruction line + a code passage; the output is that passage with
  one identifier renamed and a few lines replaced, so long spans repeat;
- `summarize` (medium copy): an instruction line + a documentation passage; the output alternates
  spans quoted from the passage (in order, skipping material) with novel prose;
- `free` (low copy): an instruction line + a passage; the output is an unrelated passage of the
  same genre from another file (it repeats only what the genre repeats: idioms, indentation).

Everything is decided by the seed: kinds, arrivals and each request's content draw from separate
children of one `np.random.SeedSequence`, so changing the arrival process leaves the token streams
unchanged, and request i's content does not depend on the other requests. The engine's own random draws
come from streams of the same seed, each named below.
"""

from __future__ import annotations

import functools
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simharness.corpus import Corpus, Stream, load_corpus
from simharness.scenario import LengthDist, Workload

# The engine's random streams, each `SeedSequence([seed, id])` beside the workload's `SeedSequence(seed)`: the
# acceptance draws of the sim level, its GC pauses, and where CPython's allocation count starts for the modelled
# collections. The ids are fixed (a changed id changes every sim result).
ACCEPTANCE_STREAM, GC_STREAM, HEAP_STREAM = 1, 2, 3

KINDS = ("code_edit", "summarize", "free")

# Modelling constants (token counts are means of geometric draws).
EDIT_LINE_PROB = 0.05  # code_edit: chance that a line of the passage is rewritten (at least one is)
QUOTE_MEAN = 16  # summarize: tokens quoted from the passage per span
SKIP_MEAN = 24  # summarize: passage tokens skipped between quotes
NOVEL_MEAN = 12  # summarize: novel tokens between quotes
SUMMARY_RATIO = 3  # summarize: natural output length = passage length // SUMMARY_RATIO

SUMMARIZE_INSTRUCTION = "Summarize the following documentation, quoting its key phrases.\n\n"
FREE_INSTRUCTION = "Here is an example. Write a different one, on another subject.\n\n"


@dataclass(frozen=True, eq=False)
class Requests:
    """Per-request arrays indexed by request id (the simulator fancy-indexes them every step)."""

    kind: np.ndarray  # int8 [N], index into kind_names
    prompt_len: np.ndarray  # int64 [N]
    output_len: np.ndarray  # int64 [N]
    prompt_tokens: list[np.ndarray]  # int32, prompt_len[i] tokens each
    output_tokens: list[np.ndarray]  # int32, output_len[i] tokens each: the reference continuation
    arrival_s: np.ndarray | None  # float64 [N], open loop; None: closed loop (submit on completion)
    vocab_size: int  # every token id is below this
    kind_names: tuple[str, ...] = KINDS
    random: np.ndarray | None = None  # bool [N]: sampled at temperature 1 (None: every request greedy)

    def __len__(self) -> int:
        return len(self.kind)


def build_requests(cfg: Workload, seed: int, checkpoint: Path | None = None) -> Requests:
    """`cfg.total_requests` requests, deterministic for `seed`; their text is cut into tokens by the built-in
    tokenizer or, given a checkpoint directory, by the checkpoint's (lengths are then in its tokens)."""
    corpus = load_corpus(checkpoint=checkpoint)
    tables = _tables(corpus)
    n = cfg.total_requests
    kind_seed, arrival_seed, content_seed, sampling_seed = np.random.SeedSequence(seed).spawn(4)
    kind = _draw_kinds(cfg.kinds, n, np.random.default_rng(kind_seed))
    builders = {"code_edit": _code_edit, "summarize": _summarize, "free": _free}
    prompts, outputs = [], []
    for i, child in enumerate(content_seed.spawn(n)):
        build = builders[KINDS[kind[i]]]
        prompt, output = build(tables, cfg.prompt_len, cfg.output_len, np.random.default_rng(child))
        prompts.append(prompt)
        outputs.append(output)
    return Requests(
        kind=kind,
        prompt_len=np.array([len(p) for p in prompts], dtype=np.int64),
        output_len=np.array([len(o) for o in outputs], dtype=np.int64),
        prompt_tokens=prompts,
        output_tokens=outputs,
        arrival_s=arrival_times(cfg, n, np.random.default_rng(arrival_seed)),
        vocab_size=corpus.tokenizer.vocab_size,
        random=_draw_random(cfg.random_fraction, n, np.random.default_rng(sampling_seed)),
    )


def _draw_random(fraction: float, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """Which requests sample at temperature 1: round(fraction * n) of them, chosen at random (None for none)."""
    if fraction == 0:
        return None
    random = np.zeros(n, dtype=bool)
    random[rng.permutation(n)[: round(fraction * n)]] = True
    return random


def arrival_times(cfg: Workload, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """Send times as `vllm bench serve`: gamma gaps (shape = burstiness, scale = 1/(rate * shape);
    Poisson is shape 1), cumulated, then rescaled so the last request goes out at n / rate."""
    if cfg.arrival == "closed":
        return None
    shape = 1.0 if cfg.arrival == "poisson" else cfg.burstiness
    times = np.cumsum(rng.gamma(shape, 1.0 / (cfg.rate * shape), size=n))
    # vllm/benchmarks/serve.py get_request: the raw sum misses n / rate by 1-2%; vLLM rescales to
    # "stabilize the throughput data from different random seeds".
    return times * (n / cfg.rate / times[-1])


def _draw_kinds(weights: dict[str, float], n: int, rng: np.random.Generator) -> np.ndarray:
    p = np.array([weights.get(k, 0.0) for k in KINDS])
    return rng.choice(len(KINDS), size=n, p=p / p.sum()).astype(np.int8)


def draw_length(dist: LengthDist, natural: int, rng: np.random.Generator) -> int:
    """One length: fixed, uniform [min, max], normal clipped, or the passage's natural length clipped."""
    if dist.dist == "fixed":
        return dist.value
    if dist.dist == "uniform":
        value = int(rng.integers(dist.min, dist.max + 1))
    elif dist.dist == "normal":
        value = round(rng.normal(dist.mean, dist.std))
    else:
        value = natural
    return min(max(value, dist.min), dist.max)


# --------------------------------------------------------------------------------------------
# token-level tables derived from the corpus vocabulary


@dataclass(frozen=True, eq=False)
class _Tables:
    corpus: Corpus
    words: tuple[str, ...]  # identifiers that are single tokens (with or without a leading space)
    word_ids: dict[str, tuple[int, int]]  # identifier -> (id of "name", id of " name"), -1 if absent
    word_of: np.ndarray  # int64 [vocab]: index into `words` of an identifier token, else -1
    new_names: np.ndarray  # int64: indices into `words` of rename targets (both variants, >= 4 letters)
    has_newline: np.ndarray  # bool [vocab]
    code_line_ends: np.ndarray  # positions of newline tokens in corpus.code.tokens
    summarize: np.ndarray  # the instructions' tokens
    free: np.ndarray


_IDENTIFIER = re.compile(r" ?([A-Za-z]+)")
# Not worth renaming: keywords and the names every method repeats.
_RESERVED = frozenset(keyword.kwlist) | {"self", "cls"}


@functools.lru_cache(maxsize=4)
def _tables(corpus: Corpus) -> _Tables:
    tok = corpus.tokenizer
    ids: dict[str, list[int]] = {}
    has_newline = np.zeros(tok.vocab_size, dtype=bool)
    has_newline[tok.encode("\n")] = True
    for i, piece in tok.vocabulary():
        has_newline[i] = "\n" in piece
        m = _IDENTIFIER.fullmatch(piece)
        if m and m.group(1) not in _RESERVED:
            ids.setdefault(m.group(1), [-1, -1])[piece.startswith(" ")] = i
    words = tuple(sorted(ids))
    word_of = np.full(tok.vocab_size, -1, dtype=np.int64)
    for w, name in enumerate(words):
        word_of[[i for i in ids[name] if i >= 0]] = w
    return _Tables(
        corpus=corpus,
        words=words,
        word_ids={w: (v[0], v[1]) for w, v in ids.items()},
        word_of=word_of,
        new_names=np.array([w for w, name in enumerate(words) if min(ids[name]) >= 0 and len(name) >= 4]),
        has_newline=has_newline,
        code_line_ends=np.flatnonzero(has_newline[corpus.code.tokens]),
        summarize=tok.encode(SUMMARIZE_INSTRUCTION),
        free=tok.encode(FREE_INSTRUCTION),
    )


# --------------------------------------------------------------------------------------------
# request kinds: each returns (prompt tokens, output tokens)


def _split(instruction: np.ndarray, prompt_len: int) -> tuple[np.ndarray, int]:
    """The instruction and the passage length that remains; a prompt too short for the instruction
    keeps half of each."""
    head = instruction if len(instruction) < prompt_len else instruction[: prompt_len // 2]
    return head, prompt_len - len(head)


def _disjoint(a: int, a_len: int, b: int, b_len: int, size: int) -> bool:
    """Whether the windows [a, a + a_len) and [b, b + b_len) of a circular stream do not overlap."""
    return (b - a) % size >= a_len and (a - b) % size >= b_len


def _unrelated(
    stream: Stream, p: int, body_len: int, length_of: Callable[[int], int], rng: np.random.Generator
) -> tuple[int, int]:
    """(start, length) of a passage q from another file than passage p, length_of(q) tokens long,
    that does not overlap the prompt's window. Gives up after 100 draws if the windows cannot fit."""
    start = int(stream.start[p])
    for _ in range(100):
        q = int(rng.integers(len(stream.start)))
        length = length_of(q)
        if stream.doc[q] != stream.doc[p] and _disjoint(
            start, body_len, int(stream.start[q]), length, len(stream.tokens)
        ):
            break
    return int(stream.start[q]), length


def _code_edit(
    t: _Tables, prompt_dist: LengthDist, output_dist: LengthDist, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    code = t.corpus.code
    p = int(rng.integers(len(code.start)))
    start, natural = int(code.start[p]), int(code.length[p])
    # The instruction names the rename, so pick it on the passage before cutting the prompt to length.
    rename = _pick_rename(t, code.window(start, natural), rng)
    if rename:
        old, new = rename
        instruction = f"Rewrite this code: rename `{old}` to `{new}` and fix the lines that need it.\n\n"
    else:
        instruction = "Rewrite this code and fix the lines that need it.\n\n"
    instruction_ids = t.corpus.tokenizer.encode(instruction)
    prompt_len = draw_length(prompt_dist, len(instruction_ids) + natural, rng)
    output_len = draw_length(output_dist, natural, rng)
    head, body_len = _split(instruction_ids, prompt_len)
    body = code.window(start, body_len)
    edited = _edit_lines(t, body, rng)
    if rename:
        edited = _rename(t, edited, *rename)
    # Past the edited passage the output runs on into the code that follows, which the prompt lacks.
    tail = code.window(start + body_len, max(output_len - len(edited), 0))
    return np.concatenate([head, body]), np.concatenate([edited, tail])[:output_len]


def _pick_rename(t: _Tables, tokens: np.ndarray, rng: np.random.Generator) -> tuple[str, str] | None:
    """An identifier used at least twice in `tokens`, and a new name that does not occur there."""
    w = t.word_of[tokens]
    counts = np.bincount(w[w >= 0], minlength=len(t.words))
    used = np.flatnonzero(counts >= 2)
    if used.size == 0:
        return None
    old = t.words[int(used[rng.integers(used.size)])]
    while counts[new := int(t.new_names[rng.integers(t.new_names.size)])]:
        pass
    return old, t.words[new]


def _rename(t: _Tables, tokens: np.ndarray, old: str, new: str) -> np.ndarray:
    """Replace the identifier token `old` by `new`, with and without its leading space."""
    out = tokens.copy()
    for old_id, new_id in zip(t.word_ids[old], t.word_ids[new], strict=True):
        if old_id >= 0:
            out[tokens == old_id] = new_id
    return out


def _edit_lines(t: _Tables, body: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Replace a few lines of `body` (the tokens after one newline token up to the next) by lines
    drawn from anywhere in the code stream; at least one line changes if the body has one."""
    ends = np.flatnonzero(t.has_newline[body])
    if ends.size < 2:
        return body.copy()
    change = rng.random(ends.size - 1) < EDIT_LINE_PROB
    if not change.any():
        change[rng.integers(change.size)] = True
    code, line_ends = t.corpus.code.tokens, t.code_line_ends
    parts, pos = [], 0
    for i in np.flatnonzero(change):
        q = int(rng.integers(line_ends.size - 1))
        parts += [body[pos : ends[i] + 1], code[line_ends[q] + 1 : line_ends[q + 1] + 1]]
        pos = ends[i + 1] + 1
    parts.append(body[pos:])
    return np.concatenate(parts)


def _summarize(
    t: _Tables, prompt_dist: LengthDist, output_dist: LengthDist, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    prose = t.corpus.prose
    p = int(rng.integers(len(prose.start)))
    natural = int(prose.length[p])
    prompt_len = draw_length(prompt_dist, len(t.summarize) + natural, rng)
    head, body_len = _split(t.summarize, prompt_len)
    body = prose.window(int(prose.start[p]), body_len)
    output_len = draw_length(output_dist, max(natural // SUMMARY_RATIO, 1), rng)
    novel_start, _ = _unrelated(prose, p, body_len, lambda q: output_len, rng)
    novel = prose.window(novel_start, output_len)
    # Alternate novel text and quotes; quotes follow the passage in order, skipping material.
    parts, size, cursor, novel_pos, quote = [], 0, 0, 0, False
    while size < output_len:
        if quote and body_len:
            n = int(rng.geometric(1 / QUOTE_MEAN))
            parts.append(np.take(body, np.arange(cursor, cursor + n), mode="wrap"))
            cursor += n + int(rng.geometric(1 / SKIP_MEAN))
        else:
            n = int(rng.geometric(1 / NOVEL_MEAN))
            parts.append(novel[novel_pos : novel_pos + n])
            novel_pos += n
        size += len(parts[-1])
        quote = not quote
    return np.concatenate([head, body]), np.concatenate(parts)[:output_len]


def _free(
    t: _Tables, prompt_dist: LengthDist, output_dist: LengthDist, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    stream = t.corpus.code if rng.random() < 0.5 else t.corpus.prose  # either genre, even odds
    p = int(rng.integers(len(stream.start)))
    prompt_len = draw_length(prompt_dist, len(t.free) + int(stream.length[p]), rng)
    head, body_len = _split(t.free, prompt_len)
    out_start, output_len = _unrelated(
        stream, p, body_len, lambda q: draw_length(output_dist, int(stream.length[q]), rng), rng
    )
    body = stream.window(int(stream.start[p]), body_len)
    return np.concatenate([head, body]), stream.window(out_start, output_len)
