"""The one-call bucket passes (ciera_runtime/bucket_codec.py): the same rows, results and cache states as
the per-shard loop, gather for gather, over real gloo groups."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _bucket_workers as workers  # noqa: E402

from tests.ranks import spawn_ranks  # noqa: E402


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@pytest.mark.parametrize(
    "world_size, entropy, verify_every", [(2, "rans", 0), (3, "rans", 3), (2, "none", 0)]
)
def test_one_call_bucket_passes_send_the_per_shard_loops_bytes(world_size, entropy, verify_every) -> None:
    for rank, runs in spawn_ranks(workers.one_call_rows_worker, world_size, entropy, verify_every):
        (rows, mismatches, gathers, positions, batched, *counts), per_shard = runs
        assert mismatches == 0 and per_shard[1] == 0 and gathers == per_shard[2] == 10 * 3 * 8, rank
        assert batched == per_shard[4] == 2, rank  # (24, 20) holds a shard too large for the one-call passes
        assert len(rows) == len(per_shard[0]) and rows == per_shard[0], rank
        assert positions == per_shard[3], rank
        *counts, (encodes, rebuilds, handoffs) = counts
        assert tuple(counts) == per_shard[5:-1], (counts, per_shard[5:-1])
        overflow_rounds, seeds, raw_messages, _ = counts
        # Calls of the two one-call buckets: 10 iterations x 3 phases x 2; their rebuild in one call wherever
        # the outputs tile one buffer (phases 0 and 1), handing raw messages (shard 22) to the per-shard path.
        assert encodes == 60 and rebuilds == 40 and handoffs >= 20 * (world_size - 1), (
            encodes,
            rebuilds,
            handoffs,
        )
        assert per_shard[-1] == (0, 0, 0), per_shard[-1]
        assert overflow_rounds > 0 and raw_messages > 0, counts  # the burst overflows; shard 22 goes raw
        if entropy == "none":
            assert seeds > 0, counts
