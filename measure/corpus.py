"""Real text for measurement runs, without downloads: the documentation topics that ship with CPython
(`pydoc_data.topics`), tokenized locally as bytes (token = byte value, 0..255; byte 0, which the text never
contains, ends every document).

Split: documents in sorted-key order, every 16th (index % 16 == 15) held out. Which text this is depends on
the Python version; `corpus_info()` gives the version and a SHA-256 of each split to record with a run.

Batches: the split's token stream cut into windows of seq_len + 1 tokens (window j starts at j·seq_len);
sample i of a run is window perm_e[i mod n] of epoch e = i div n, perm_e a permutation keyed by (seed, e)
from SplitMix64 (no numpy or torch RNG, so it is the same on every version and machine). Step s of a run
always gets samples s·batch_size .. (s+1)·batch_size − 1, in that order: `batch(s, ...)` needs no state.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SOURCE = "pydoc_data.topics"
VOCAB_SIZE = 256
DOCUMENT_END = 0
HELDOUT_EVERY = 16
SPLITS = ("train", "heldout")


class CorpusError(ValueError):
    """A batch that cannot be cut from the corpus (split, sequence length, batch size): one line."""


@functools.cache
def _documents() -> tuple[bytes, ...]:
    from pydoc_data import topics

    return tuple(topics.topics[key].encode("utf-8") for key in sorted(topics.topics))


@functools.cache
def corpus_tokens(split: str = "train") -> np.ndarray:
    """The split's token stream (uint8, read-only): its documents, each followed by DOCUMENT_END."""
    if split not in SPLITS:
        raise CorpusError(f"split is {split!r}, expected one of {', '.join(SPLITS)}")
    held = split == "heldout"
    chosen = [doc for i, doc in enumerate(_documents()) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == held]
    stream = np.frombuffer(b"".join(doc + bytes([DOCUMENT_END]) for doc in chosen), dtype=np.uint8)
    stream.flags.writeable = False
    return stream


def corpus_info() -> dict[str, object]:
    """What to record with a run: source, Python version, tokens and SHA-256 per split."""
    info: dict[str, object] = {
        "source": SOURCE,
        "python": platform.python_version(),
        "vocab_size": VOCAB_SIZE,
    }
    for split in SPLITS:
        tokens = corpus_tokens(split)
        info[f"{split}_tokens"] = int(tokens.size)
        info[f"{split}_sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    return info


def num_windows(seq_len: int, split: str = "train") -> int:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise CorpusError(f"seq_len is {seq_len!r}, expected a positive integer")
    tokens = corpus_tokens(split)
    count = (tokens.size - 1) // seq_len
    if count < 1:
        raise CorpusError(f"seq_len {seq_len} is longer than the {split} split ({tokens.size} tokens)")
    return count


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=64)
def _permutation(seed: int, epoch: int, count: int) -> np.ndarray:
    key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    scores = _splitmix64(np.arange(count, dtype=np.uint64) ^ key)
    order = np.argsort(scores, kind="stable")
    order.flags.writeable = False
    return order


def sample_windows(
    step: int, seq_len: int, batch_size: int, seed: int = 0, split: str = "train"
) -> np.ndarray:
    """(batch_size, seq_len + 1) int64 tokens of step `step`: inputs are [:, :-1], targets [:, 1:]."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise CorpusError(f"batch_size is {batch_size!r}, expected a positive integer")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorpusError(f"step is {step!r}, expected a non-negative integer")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise CorpusError(f"seed is {seed!r}, expected an integer")
    count = num_windows(seq_len, split)
    tokens = corpus_tokens(split)
    rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    for row, sample in enumerate(range(step * batch_size, (step + 1) * batch_size)):
        epoch, position = divmod(sample, count)
        start = int(_permutation(seed, epoch, count)[position]) * seq_len
        rows[row] = tokens[start : start + seq_len + 1]
    return rows


def batch(
    step: int, seq_len: int, batch_size: int, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`, each (batch_size, seq_len) int64 torch tensors."""
    import torch

    rows = torch.from_numpy(sample_windows(step, seq_len, batch_size, seed, split))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def batches(
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    split: str = "train",
    steps: int | None = None,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`batch(s, ...)` for s = start, start + 1, ... (`steps` of them, or without end)."""
    num_windows(seq_len, split)  # fail before the first step, not at it
    step = start
    while steps is None or step < start + steps:
        yield batch(step, seq_len, batch_size, seed, split)
        step += 1
