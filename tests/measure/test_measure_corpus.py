"""The corpus: byte-level tokens of the CPython documentation topics, deterministic batches per step."""

from __future__ import annotations

import numpy as np
import pytest

from measure import corpus


def test_corpus_ships_with_python_and_is_split_by_document() -> None:
    import pydoc_data.topics

    assert pydoc_data.topics.topics
    info = corpus.corpus_info()
    train, heldout = corpus.corpus_tokens("train"), corpus.corpus_tokens("heldout")
    assert info["train_tokens"] == train.size > 100_000 and info["heldout_tokens"] == heldout.size > 10_000
    total = sum(len(text.encode()) + 1 for text in pydoc_data.topics.topics.values())
    assert train.size + heldout.size == total
    assert train.max() < corpus.VOCAB_SIZE and (train == corpus.DOCUMENT_END).sum() > 50
    assert info["train_sha256"] != info["heldout_sha256"]


def test_batches_are_fixed_per_step_and_seed() -> None:
    first = corpus.sample_windows(5, 128, 4, seed=7)
    assert first.shape == (4, 129) and first.dtype == np.int64
    assert np.array_equal(first, corpus.sample_windows(5, 128, 4, seed=7))
    assert not np.array_equal(first, corpus.sample_windows(5, 128, 4, seed=8))
    assert not np.array_equal(first, corpus.sample_windows(5, 128, 4, seed=7, split="heldout"))
    # Step s of batch size 4 is samples 4s..4s+3: the same rows as two steps of batch size 2.
    assert np.array_equal(first[2:], corpus.sample_windows(11, 128, 2, seed=7))


def test_torch_batches_match_the_windows_and_shift_by_one() -> None:
    torch = pytest.importorskip("torch")
    steps = list(corpus.batches(64, 3, seed=1, steps=3, start=2))
    assert len(steps) == 3
    for step, (inputs, targets) in enumerate(steps, start=2):
        again_in, again_out = corpus.batch(step, 64, 3, seed=1)
        assert torch.equal(inputs, again_in) and torch.equal(targets, again_out)
        assert inputs.shape == targets.shape == (3, 64) and inputs.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_every_window_once_per_epoch() -> None:
    count = corpus.num_windows(4096, "heldout")
    rows = corpus.sample_windows(0, 4096, count, seed=3, split="heldout")
    tokens = corpus.corpus_tokens("heldout")
    starts = sorted(
        next(s for s in range(0, tokens.size, 4096) if np.array_equal(tokens[s : s + 4097], r)) for r in rows
    )
    assert starts == list(range(0, count * 4096, 4096))


def test_bad_requests_are_one_line_errors() -> None:
    with pytest.raises(corpus.CorpusError, match=r"seq_len 10000000 is longer than the heldout split"):
        corpus.sample_windows(0, 10_000_000, 1, split="heldout")
    with pytest.raises(corpus.CorpusError, match=r"batch_size is 0, expected a positive integer"):
        corpus.sample_windows(0, 16, 0)
    with pytest.raises(corpus.CorpusError, match=r"split is 'test', expected one of train, heldout"):
        corpus.sample_windows(0, 16, 1, split="test")
