"""A plan whose receiver cache does not fit the budget is said to not fit, on the record and in the notes,
and a summary never calls it the fastest system."""

from __future__ import annotations

import traces
from report.summary import summary_rows
from sim import load_cluster, simulate


def test_every_shard_over_the_budget_is_marked_and_left_out_of_the_summary() -> None:
    bundle = traces.read_bundle(traces.default_bundle_path())
    records = simulate(
        bundle, load_cluster("a100-hdr-testbed"), models=["mixtral"], gpus=[64], systems=["zero3", "ciera-er", "ciera"],
        dtypes=["bf16"],
    )  # fmt: skip
    by_system = {r.system: r for r in records}
    every_shard, ciera = by_system["ciera-er"], by_system["ciera"]
    budget = load_cluster("a100-hdr-testbed").ciera.cache_budget_bytes
    assert every_shard.receiver_cache_bytes > budget and not every_shard.within_cache_budget
    assert any("upper reference, not a deployable plan" in note for note in every_shard.details)
    assert 0 < ciera.receiver_cache_bytes <= budget and ciera.within_cache_budget
    assert by_system["zero3"].receiver_cache_bytes == 0 and by_system["zero3"].within_cache_budget
    (row,) = summary_rows([r.to_dict() for r in records], lambda record: "analytic projection")
    assert row.best_lossless[64][0] == "ciera" and row.over_budget == (("ciera-er", 64),)
