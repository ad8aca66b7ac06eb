"""The system rewrite "turn CIERA on": a plain engine's traced graph (ZeRO-3 or FSDP2) rewritten into the
graph the CIERA runtime of this build runs, from the plain run, the bundle's exponent statistics and the
codec figures of a few CIERA runs — never from the CIERA run being predicted.

What the runtime does per engine all-gather (ciera_runtime/bucket.py, zero3.py, fsdp2.py;
docs/runtime.md): the engine's call — DeepSpeed's coalesced fetch of a bucket, FSDP2's parameter-group
gather — becomes **one** compressed all-gather, issued where the engine issues its own:

- at the issue point, on the main thread: encode the rank's shards of the call (one codec call per
  shard), then issue the one all-gather, asynchronous like the engine's;
- at the engine's wait, on the main thread: decode what every other rank sent, blocked on the gather;
  when a rank's message did not fit the replicated area, an **overflow round** (one more all-gather)
  comes between the gather and the decode (here: its measured time added to the gather's).

The placement is the one CIERA rule of both rewrites (`system_rewrite.insert_codec`, without overlap):
each decode runs before the op that uses the gather. The runtime also finishes every call up to m − 4
when it starts call m (bucket.py's CALL_LAG); in the codec run every forward call had arrived by then
(5 ms of slack at the median), so those decodes cost only their own main-thread time, which the model
spends at the use instead. Forcing them in the graph ties each rank's main thread to the
other's traced compute, whose per-rank noise the model draws independently from the plain run, and
over-predicted the captured runs by 6–9 % (docs/validation.md).

Sizes: a call's wire bytes are ρ·raw + W·h·n, with n its shards (a ZeRO-3 bucket split into the run of
parameters whose sizes add up to it; an FSDP2 group's parameters), h the per-shard row overhead and ρ
the payload ratio of its phase class, fitted to the codec runs' bytes: the first gather after the
optimizer step (the forward: the sign and mantissa plane plus the changed blocks' exponents) or a repeat
gather (recompute, backward: nothing changed since, so the area's floor). The exponent statistics' block
change rate q only expresses the difference as coded bits per changed value; a run predicted at another
churn than the codec runs' (a warm start) would need ρ_first rescaled by its q, which is not done. Costs: encode a + b·n + c·(raw/W), decode a' + b'·n·(W−1) + c'·raw·(W−1)/W (each source's part of each shard is rebuilt on its own),
plus the main-thread time the runtime adds or saves per call beyond the codec (CIERA's compute minus the
plain run's, per call — signed: the engine's own gather work on the main thread is replaced).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import traces

from .errors import SimInputError
from .graph_edit import EditableOp, editable_ops, relink_main, to_graph
from .opgraph import MAIN_THREAD_STREAMS, OpGraph, iteration_graphs
from .rewrite import compute_scale, main_work_s, run_transport_s, traced_cluster, transport_scale
from .system_rewrite import AnchorTime, insert_codec, rescaled_durations

SIGN_MANTISSA_FRACTION = {"bf16": 0.5, "fp16": 11 / 16}
COMPUTE_STREAMS = ("compute", "optim")
FIRST_PHASES = ("fwd",)  # the first gather of a parameter after the optimizer step
PLAIN_ENGINE = {"ciera": "zero3", "ciera-fsdp": "fsdp"}  # a CIERA system → the engine it runs in
# The runtime's default pipelining threshold (ciera_runtime.bucket: a call of at least 2 × part_bytes
# per rank, part_bytes = 2 MiB, travels as several buckets). Such calls are not split here: counted.
PIPELINED_CALL_BYTES_PER_RANK = 4 << 20


@dataclass(frozen=True)
class CodecFigures:
    """What CIERA costs, fitted to the events of the given CIERA runs."""

    encode_s: tuple[float, float, float]  # per call, per shard, per byte of the rank's own shard (S / W)
    # per call, per shard and source rank (the runtime rebuilds each source's part of each shard), per byte
    # received ((W − 1)/W · S)
    decode_s: tuple[float, float, float]
    glue_s_per_gather: float  # main-thread time beyond the codec per call (work and lag), CIERA minus plain
    shard_overhead_bytes: float  # h: per shard and source rank of a call's row
    first_ratio: float  # ρ of a first gather after the optimizer step
    repeat_ratio: float  # ρ of a repeat gather (recompute, backward)
    block_change_rate: float  # q, of the exponent statistics at the runs' block size
    overflow_rate: float  # overflow rounds per first gather
    overflow_s: float  # in-run time of one overflow round (the median of the codec runs')
    runs: tuple[str, ...] = field(default=())
    # Measured directly where the runs record the engine's gather path (the `gather_host` stream): CIERA's
    # host time per call inside the engine's gather calls, beyond the codec. The rewrite then replaces the
    # plain run's own gather path by it and glue_s_per_gather is only the lag's difference (see the fit).
    # None: not recorded (glue by difference).
    gather_host_s_per_call: float | None = None
    world_sizes: tuple[int, ...] = ()  # the codec runs' W
    shards_per_call: int = 1  # the median over the codec runs' calls

    def decode_sources_note(self, world_size: int, shards: int | None = None) -> str | None:
        """What the rewrite assumes of decode at a W its codec runs did not have (None at theirs, or when
        they span several). At one W, (W − 1) is a constant: the fit cannot tell a cost per shard and
        source from one per shard, so how decode's fixed part grows with the sources is the form's
        assumption (per shard and source, as the runtime rebuilds each source's part of each shard), not
        a measurement; the bytes received grow with (W − 1)/W either way."""
        if len(self.world_sizes) != 1 or world_size in self.world_sizes:
            return None
        (fitted_world,) = self.world_sizes
        shards = self.shards_per_call if shards is None else shards
        per_call, per_item, _ = self.decode_s
        fitted = per_call + per_item * shards * (fitted_world - 1)  # what the runs measured, at their W
        growing = fitted * (world_size - 1) / max(fitted_world - 1, 1)
        used = per_call + per_item * shards * (world_size - 1)
        return (
            f"decode at W = {world_size}, fitted at W = {fitted_world} only: how its fixed part grows with the "
            f"sources is assumed, not measured — a {shards}-shard call's (the codec runs' median) is {fitted * 1e6:.0f} µs at W = "
            f"{fitted_world}, at W = {world_size} {fitted * 1e6:.0f} µs if it does not grow and "
            f"{growing * 1e6:.0f} µs if all of it does; the rewrite counts {used * 1e6:.0f} µs (the fit's split)"
        )

    @property
    def changed_exponent_bits(self) -> float:
        """Coded bits per value of a changed block: what the forward gathers carry beyond the repeat ones,
        (ρ_first − ρ_repeat) · 16 / q (16 raw bits per value)."""
        return max(self.first_ratio - self.repeat_ratio, 0.0) * 16 / max(self.block_change_rate, 1e-9)

    def describe(self) -> str:
        encode, decode = self.encode_s, self.decode_s
        return (
            f"encode {encode[0] * 1e3:.2f} ms + {encode[1] * 1e3:.3f} ms/shard + {encode[2] * 1e9:.1f} ns/B, "
            f"decode {decode[0] * 1e3:.2f} ms + {decode[1] * 1e3:.3f} ms/shard/source + {decode[2] * 1e9:.1f} ns/B, "
            + (
                f"the engine's gather path replaced by CIERA's, {self.gather_host_s_per_call * 1e3:.2f} ms per call "
                f"(measured), lag {self.glue_s_per_gather * 1e3:+.2f} ms per call (minus the plain run's)"
                if self.gather_host_s_per_call is not None
                else f"glue {self.glue_s_per_gather * 1e3:+.2f} ms per call (compute and lag minus the plain run's)"
            )
            + f", payload ratio {self.first_ratio:.3f} "
            f"(first) / {self.repeat_ratio:.3f} (repeat) + {self.shard_overhead_bytes:.0f} B per shard and "
            f"rank, {self.overflow_rate:.1%} overflow rounds (fitted to {', '.join(self.runs)})"
        )


def _nonnegative_fit(columns: list[np.ndarray], y: np.ndarray) -> list[float]:
    """Least squares y ≈ Σ x_k·columns_k with every x_k ≥ 0: a column whose coefficient comes out negative
    is dropped (0) and the rest refitted."""
    active = list(range(len(columns)))
    while active:
        design = np.column_stack([columns[k] for k in active])
        solution = np.linalg.lstsq(design, y, rcond=None)[0]
        if (solution >= 0).all():
            out = [0.0] * len(columns)
            for k, value in zip(active, solution, strict=True):
                out[k] = float(value)
            return out
        active.pop(int(np.argmin(solution)))
    return [0.0] * len(columns)


def mean_block_change_rate(bundle: traces.TraceBundle, block_size: int) -> float:
    """The parameter-weighted block change rate of the bundle's exponent statistics at `block_size`."""
    stats = bundle.exponents[bundle.exponents["block_size"] == block_size]
    if stats.empty:
        known = sorted(set(bundle.exponents["block_size"].astype(int)))
        raise SimInputError(
            f"bundle: no exponent statistics at block size {block_size} (it has {known or 'none'}; "
            "capture them with `ciera measure exponents --block-size B`)"
        )
    return float(np.average(stats["block_change_rate"], weights=stats["numel"]))


def shards_per_call(engine: str, raw: float, layer: int, parameters: dict[int, list[float]]) -> int:
    """How many shards one engine call gathers (`ParameterLayout.shards`, for a single call)."""
    return ParameterLayout(parameters).shards(engine, raw, layer)


def _calls(
    events: pd.DataFrame, run_id: str
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A CIERA run's calls, rank by rank and iteration by iteration: each rank-iteration's calls' rows
    (raw > 0, in issue order), its encodes (the k-th precedes the k-th row's issue), its decodes (calls
    finish in start order: the k-th decode is the k-th row's) and its overflow rounds (raw 0) — so the
    k-th encode and decode of the whole run belong to its k-th row."""
    ordered = events.sort_values(["iteration", "rank", "issued_s", "start_s"], kind="stable")
    stream = ordered["stream"].to_numpy(dtype=object)
    raw = ordered["raw_bytes"].to_numpy(dtype=float)
    kinds = {
        "rows": (stream == "allgather") & (raw > 0),
        "encodes": stream == "codec_send",
        "decodes": stream == "codec_recv",
        "overflow": (stream == "allgather") & (raw == 0),
    }
    keys = ordered[["iteration", "rank"]]
    counts = (
        pd.DataFrame({name: chosen for name, chosen in kinds.items()})
        .groupby([keys["iteration"].to_numpy(), keys["rank"].to_numpy()], sort=True)
        .sum()
    )
    unequal = counts[(counts["encodes"] != counts["rows"]) | (counts["decodes"] != counts["rows"])]
    if len(unequal):
        bad = unequal.iloc[0]
        raise SimInputError(
            f"codec run {run_id!r}: {bad['encodes']} encodes, {bad['decodes']} decodes and {bad['rows']} "
            "gathers per rank; expected one of each per engine call (a capture of the bucket runtime)"
        )
    return tuple(ordered[chosen] for chosen in kinds.values())


def fit_codec_figures(
    bundle: traces.TraceBundle,
    codec_runs: list[str],
    plain_runs: dict[str, str],
    parameters: dict[str, dict[int, list[float]]],
    change_rate: float,
) -> CodecFigures:
    """Fit the figures to `codec_runs` (CIERA runs of one engine); `plain_runs` maps each to the plain
    engine's run of the same configuration (the glue is measured against its main-thread time);
    `parameters` gives each run's parameter sizes per layer (`parameter_sizes`)."""
    encode_rows, decode_rows, wire_rows, glue, lag_glue, gather_host = [], [], [], [], [], []
    world_sizes: set[int] = set()
    decode_worlds: list[np.ndarray] = []  # each decode row's W
    plain_paths: list[bool] = []  # per plain twin: whether it records the engine's gather path
    first_calls, overflows, overflow_s = 0, 0, []
    for run_id in codec_runs:
        run = bundle.runs[bundle.runs["run_id"] == run_id].iloc[0]
        world, engine = int(run["world_size"]), PLAIN_ENGINE[str(run["system"])]
        world_sizes.add(world)
        layout = ParameterLayout(parameters[run_id])
        events, lag_s = _main_thread_of(bundle, run)
        rows, encodes, decodes, overflow = _calls(events, run_id)
        raw = rows["raw_bytes"].to_numpy(dtype=float)
        shards = np.array(
            [layout.shards(engine, r, int(layer)) for r, layer in zip(raw, rows["layer"], strict=True)],
            dtype=float,
        )  # fmt: skip
        first = rows["phase"].isin(FIRST_PHASES).to_numpy()
        encode_rows.append(np.column_stack([np.ones_like(raw), shards, raw / world,
                                            encodes["work_s"].to_numpy()]))  # fmt: skip
        decode_rows.append(np.column_stack([np.ones_like(raw), shards * (world - 1), raw * (world - 1) / world,
                                            decodes["work_s"].to_numpy()]))  # fmt: skip
        decode_worlds.append(np.full(len(raw), world))
        wire_rows.append(np.column_stack([raw * first, raw * ~first, world * shards,
                                          rows["wire_bytes"].to_numpy(dtype=float)]))  # fmt: skip
        first_calls += int(first.sum())
        overflows += len(overflow)
        overflow_s += (overflow["end_s"] - overflow["start_s"]).tolist()
        calls = len(rows) / _per_rank_iteration(events)
        if (events["stream"] == "gather_host").any():
            gather_host.append(_work_s(events, ("gather_host",)) / max(calls, 1.0))
        plain_id = plain_runs.get(run_id)
        if plain_id is not None:
            plain_run = bundle.runs[bundle.runs["run_id"] == plain_id].iloc[0]
            plain, plain_lag_s = _main_thread_of(bundle, plain_run)
            # Compute and optimizer segments: the work outside the codec (and outside a recorded gather path),
            # and the main thread's time between its segments that no collective held it for (Python
            # between hooks: the graph's lag), which CIERA's calls add to as well.
            work = _work_s(events, COMPUTE_STREAMS) - _work_s(plain, COMPUTE_STREAMS)
            lag_glue.append((lag_s - plain_lag_s) / max(calls, 1.0))
            glue.append(work / max(calls, 1.0) + lag_glue[-1])
            plain_paths.append(bool((plain["stream"] == "gather_host").any()))
    if not encode_rows:
        raise SimInputError("codec runs: no CIERA gathers to fit the codec figures to")
    encode, decode, wire = (np.vstack(rows) for rows in (encode_rows, decode_rows, wire_rows))
    decode_world = np.concatenate(decode_worlds)
    dtype = str(bundle.runs[bundle.runs["run_id"] == codec_runs[0]].iloc[0]["dtype"])
    # Every payload carries the whole sign+mantissa plane: the ratios are fitted as what lies above that
    # floor, so the fit cannot trade a ratio below the format's minimum for a larger per-shard overhead.
    floor = SIGN_MANTISSA_FRACTION[dtype]
    first_excess, repeat_excess, overhead = _nonnegative_fit(
        [wire[:, 0], wire[:, 1], wire[:, 2]], wire[:, 3] - floor * (wire[:, 0] + wire[:, 1])
    )
    first_ratio, repeat_ratio = floor + first_excess, floor + repeat_excess
    # Every codec run records the engine's gather path, or the glue is read by difference (older bundles).
    measured_path = len(gather_host) == len(codec_runs) and all(plain_paths)

    return CodecFigures(
        encode_s=tuple(_nonnegative_fit([encode[:, k] for k in range(3)], encode[:, 3])),
        decode_s=tuple(_nonnegative_fit([decode[:, k] for k in range(3)], decode[:, 3])),
        # With the path measured, the glue is the lag alone: CIERA's calls leave the main thread idle
        # between its segments longer than the engine's own do.
        glue_s_per_gather=float(np.median(lag_glue if measured_path else glue)) if glue else 0.0,
        gather_host_s_per_call=float(np.median(gather_host)) if measured_path else None,
        shard_overhead_bytes=overhead,
        first_ratio=max(first_ratio, repeat_ratio),
        repeat_ratio=repeat_ratio,
        block_change_rate=change_rate,
        overflow_rate=overflows / max(first_calls, 1),
        overflow_s=float(np.median(overflow_s)) if overflow_s else 0.0,
        runs=tuple(codec_runs),
        world_sizes=tuple(sorted(world_sizes)),
        shards_per_call=max(int(round(float(np.median(decode[:, 1] / np.maximum(decode_world - 1, 1))))), 1),
    )


def fit_system_figures(
    bundle: traces.TraceBundle,
    system: str,
    codec_runs: list[str],
    plain_runs: pd.DataFrame,
    statistics: traces.TraceBundle | None = None,
) -> CodecFigures:
    """The codec figures of `system` (a key of PLAIN_ENGINE) fitted to `codec_runs` — the one fit behind
    both `ciera validate sim` and the projections of `ciera simulate --cluster MEASURED`. Each codec run is
    paired with the run of its plain engine in `plain_runs` on the same cluster and depth (the glue is
    measured against it; a run without one adds no glue); parameter sizes and the change rate come from
    `statistics`' exponent statistics (default: `bundle`'s)."""
    statistics = bundle if statistics is None else statistics
    runs = bundle.runs.set_index("run_id")
    plain = PLAIN_ENGINE[system]
    pairs = {}
    for run_id in codec_runs:
        run = runs.loc[run_id]
        twin = plain_runs[
            (plain_runs["system"] == plain) & (plain_runs["cluster"] == run["cluster"])
            & (plain_runs["layers"] == run["layers"])
        ]  # fmt: skip
        if len(twin):
            pairs[run_id] = str(twin.iloc[0]["run_id"])
    block_sizes = {int(runs.loc[r, "block_size"]) for r in codec_runs}
    if len(block_sizes) != 1:
        raise SimInputError(
            f"the codec runs of {system} use block sizes {sorted(block_sizes)}; expected one (the "
            "rewrite's change rate is the statistics' at that size)"
        )
    parameters = {r: parameter_sizes(statistics, int(runs.loc[r, "layers"])) for r in codec_runs}
    change_rate = mean_block_change_rate(statistics, block_sizes.pop())
    return fit_codec_figures(bundle, codec_runs, pairs, parameters, change_rate)


def _work_s(frame: pd.DataFrame, streams: tuple[str, ...]) -> float:
    """Main-thread work on `streams` per rank and iteration (`work_s`, at a full core)."""
    chosen = frame[frame["stream"].isin(streams)]
    return float(chosen["work_s"].sum()) / _per_rank_iteration(frame)


def _per_rank_iteration(events: pd.DataFrame) -> int:
    return max(events.groupby(["iteration", "rank"]).ngroups, 1)


def _lag_s(events: pd.DataFrame, graphs: dict[int, OpGraph]) -> float:
    total = sum(float(graph.lag_s[graph.is_main].sum()) for graph in graphs.values())
    return total / _per_rank_iteration(events)


def main_thread_lag_s(events: pd.DataFrame) -> float:
    """The main thread's lag per rank and iteration (`OpGraph.lag_s` of its ops): time between its
    recorded segments that no collective's end explains."""
    return _lag_s(events, iteration_graphs(events))


def _main_thread_of(bundle: traces.TraceBundle, run: pd.Series) -> tuple[pd.DataFrame, float]:
    """A run's events with their main-thread work (`work_s`) and its main-thread lag: what the codec fit
    reads of each run, from one build of its iteration graphs."""
    events = bundle.events[bundle.events["run_id"] == run["run_id"]]
    graphs = iteration_graphs(events)
    return events.assign(work_s=_work_at_full_core(bundle, run, events, graphs)), _lag_s(events, graphs)


def main_thread_work_s(bundle: traces.TraceBundle, run: pd.Series) -> pd.Series:
    """Per event of `run`, what its main-thread op would take at a full core (`rewrite.main_work_s`: its
    measured duration times the core share its rank had beside the other ranks and the collectives'
    transport on the run's own cluster); NaN for collectives. The codec figures are fitted to this, not to
    the measured durations: the rewritten graph's codec ops run on the evaluator's shared cores, which
    slow them by the sharing their measurement already held (in sample, ZeRO-3 + CIERA's encodes and
    decodes came out 2.1× their measured time and its iteration +3.9 %)."""
    events = bundle.events[bundle.events["run_id"] == run["run_id"]]
    return _work_at_full_core(bundle, run, events, iteration_graphs(events))


def _work_at_full_core(
    bundle: traces.TraceBundle, run: pd.Series, events: pd.DataFrame, graphs: dict[int, OpGraph]
) -> pd.Series:
    """`main_thread_work_s` of the run's `events`, whose iteration graphs are `graphs`."""
    cluster = traced_cluster(bundle.collectives, run)
    scale = transport_scale(run, list(graphs.values()), cluster)[0]
    work_scale = compute_scale(list(graphs.values()), cluster, scale)
    iteration_of = events["iteration"].to_numpy(dtype=int)
    rank_of = events["rank"].to_numpy(dtype=int)
    stream_of = events["stream"].to_numpy(dtype=object)
    start_of, end_of = events["start_s"].to_numpy(dtype=float), events["end_s"].to_numpy(dtype=float)
    work = np.full(len(events), np.nan)
    for iteration, graph in graphs.items():
        per_op = main_work_s(graph, cluster, run_transport_s(graph, cluster, scale)) * work_scale
        rows_of_iteration = np.flatnonzero(iteration_of == iteration)
        for rank in np.unique(rank_of[rows_of_iteration]).tolist():
            of_rank = rows_of_iteration[rank_of[rows_of_iteration] == rank]
            for stream in MAIN_THREAD_STREAMS:
                rows = of_rank[stream_of[of_rank] == stream]
                if not len(rows):
                    continue
                rows = rows[np.lexsort((end_of[rows], start_of[rows]))]
                ops = np.flatnonzero((graph.rank == rank) & (graph.stream == stream))
                # An op cut at an issue point (`opgraph._split_at_issues`) adds its parts back to its event.
                owner = np.searchsorted(start_of[rows], graph.measured_start_s[ops] + 1e-9, side="right") - 1
                work[rows] = np.bincount(owner, weights=per_op[ops], minlength=len(rows))
    return pd.Series(work, index=events.index)


def parameter_sizes(bundle: traces.TraceBundle, traced_layers: int) -> dict[int, list[float]]:
    """Per layer of a model traced at `traced_layers` blocks: its parameters' raw BF16 bytes in module order,
    from the exponent statistics (blocks map onto the statistics run's blocks in turn)."""
    stats = bundle.exponents
    first = stats[
        (stats["iteration"] == stats["iteration"].min()) & (stats["block_size"] == stats["block_size"].min())
    ]
    stats_layers = int(first["layer"].max()) - 1
    by_layer = {
        int(layer): list(2.0 * rows["numel"].to_numpy(dtype=float))
        for layer, rows in first.groupby("layer", sort=True)
    }
    sizes: dict[int, list[float]] = {
        0: by_layer.get(0, []),
        traced_layers + 1: by_layer.get(stats_layers + 1, []),
    }
    for layer in range(1, traced_layers + 1):
        sizes[layer] = by_layer.get((layer - 1) % stats_layers + 1, [])
    return sizes


class ParameterLayout:
    """A model's parameters (raw bytes per layer, `parameter_sizes`) laid out for the question the rewrite
    asks of every gather: which parameters a gathered bucket holds. The running sums are built once and
    each answer is kept: an iteration asks the same few bucket sizes hundreds of times."""

    def __init__(self, parameters: dict[int, list[float]]) -> None:
        self.parameters = parameters
        sequence = [(owner, size) for owner in sorted(parameters) for size in parameters[owner]]
        self._orders = []
        for ordered in (sequence, sequence[::-1]):  # module order, and reverse (backward fetches)
            sizes = np.array([size for _, size in ordered])
            prefix = np.concatenate([[0.0], np.cumsum(sizes)])
            where = {round(value): i for i, value in enumerate(prefix)}
            self._orders.append((sizes, np.array([owner for owner, _ in ordered]), prefix, where))
        self._known: dict[tuple[float, int], tuple[list[float], bool]] = {}

    def split(self, size_bytes: float, layer: int) -> tuple[list[float], bool]:
        """The parameters one gathered bucket holds: a run of consecutive parameters, in module order or in
        reverse, whose sizes add up to the bucket's — preferring a run of the layer the bucket is attributed
        to (the layer holding most of its elements) — and whether any run matched (if none did, the bucket
        stays one shard)."""
        key = (size_bytes, layer)
        if key not in self._known:
            self._known[key] = self._split(size_bytes, layer)
        return self._known[key]

    def _split(self, size_bytes: float, layer: int) -> tuple[list[float], bool]:
        best: list[float] | None = None
        for sizes, layers, prefix, where in self._orders:
            for end in range(1, len(prefix)):
                start = where.get(round(prefix[end] - size_bytes))
                if start is None or start >= end:
                    continue
                values, counts = np.unique(layers[start:end], return_counts=True)
                if values[np.argmax(counts)] == layer:
                    return list(sizes[start:end]), True
                best = best or list(sizes[start:end])
        return (best, True) if best else ([size_bytes], False)

    def shards(self, engine: str, raw: float, layer: int) -> int:
        """How many shards one engine call gathers: a ZeRO-3 bucket's parameters (`split`), an FSDP2
        group's (the root group at layer 0 holds the embedding's and the head's)."""
        if engine == "zero3":
            return len(self.split(raw, layer)[0])
        if layer == 0:
            return max(
                len(self.parameters.get(0, [])) + len(self.parameters.get(max(self.parameters), [])), 1
            )
        return max(len(self.parameters.get(layer, [])), 1)


def split_bucket(size_bytes: float, layer: int, parameters: dict[int, list[float]]) -> list[float]:
    """The parameters one gathered bucket holds (`ParameterLayout.split`, for a single bucket)."""
    return ParameterLayout(parameters).split(size_bytes, layer)[0]


def payload_bytes(raw: float, first: bool, shards: int, world: int, figures: CodecFigures) -> float:
    """Wire bytes of one CIERA call (all W rows): ρ·raw + W·h·n."""
    ratio = figures.first_ratio if first else figures.repeat_ratio
    return ratio * raw + world * figures.shard_overhead_bytes * shards


def _add_gather_host(edited: list[EditableOp], done: list, host_s: float) -> list[EditableOp]:
    """CIERA's host path per call (`gather_host_s_per_call`), half as a `gather_host` op just before each
    encode and half just after each decode: where a measured CIERA run records that work (the engine's
    gather call, beyond the codec), so the predicted critical path counts it where the measured one does
    (`sim.evaluate.critical_path`: compute, not codec)."""
    if host_s <= 0.0:
        return edited
    before = {id(i.send): i.send for i in done if i.send is not None}  # encode → run its host op first
    after = {id(i.receive): i.receive for i in done if i.receive is not None}  # decode → its host op next
    with_host: list[EditableOp] = []
    for op in edited:
        if id(op) in before:
            with_host.append(EditableOp(op.rank, "gather_host", op.layer, op.phase, host_s))
        with_host.append(op)
        if id(op) in after:
            with_host.append(EditableOp(op.rank, "gather_host", op.layer, op.phase, host_s))
    relink_main(with_host)
    return with_host


def ciera_graph(
    plain: OpGraph,
    engine: str,
    figures: CodecFigures,
    parameters: dict[int, list[float]] | ParameterLayout,
    anchor_time_s: AnchorTime,
    counts: dict[str, int] | None = None,
    world_size: int | None = None,
    work_scale: float = 1.0,
) -> OpGraph:
    """The CIERA graph of `plain` (a ZeRO-3 or FSDP2 iteration). Each engine gather becomes one CIERA call
    at its payload, its traced duration rescaled by the anchor curve; `counts` collects what was done
    (per iteration, as one rank sees it). `world_size`: the W the graph will be re-costed at (default the
    traced W) — a call's rows, its own shard (raw/W) and the sources it rebuilds (W − 1) are those of that
    W, while the gather's traced duration is still rescaled on the traced cluster's curve. `work_scale`:
    the anchor's compute calibration, which `rewrite_costs` applies to every main op — the codec ops are
    written at their figures' (already calibrated) work over it, so they come out at their figures.
    `parameters`: the sizes (`parameter_sizes`), or their layout where the caller rewrites several
    iterations (it keeps the answers it has found)."""
    counts = counts if counts is not None else {}
    world = world_size if world_size is not None else plain.world_size
    layout = parameters if isinstance(parameters, ParameterLayout) else ParameterLayout(parameters)
    ranks = sorted(set(plain.rank.tolist()))
    # Counted on the first rank: every rank rewrites the same calls.
    ops_by_rank = {
        rank: _rewrite_rank(
            editable_ops(plain, rank), engine, figures, layout, anchor_time_s, world,
            counts if rank == ranks[0] else {}, work_scale,
        )
        for rank in ranks
    }  # fmt: skip
    return to_graph(ops_by_rank, plain.world_size)


def _rewrite_rank(
    ops: list[EditableOp],
    engine: str,
    figures: CodecFigures,
    layout: ParameterLayout,
    anchor_time_s: AnchorTime,
    world: int,
    counts: dict[str, int],
    work_scale: float = 1.0,
) -> list[EditableOp]:
    glue = figures.glue_s_per_gather / 2
    replace_path = figures.gather_host_s_per_call is not None
    if replace_path:
        # The engine's own gather path (recorded as gather_host) is what CIERA replaces: the plain run's
        # is dropped; CIERA's, measured per call, runs half at the encode and half at the decode as
        # gather_host ops of their own (`_add_gather_host`), and its extra lag with the codec ops.
        replaced = 0
        for op in ops:
            if op.stream == "gather_host":
                op.duration_s = 0.0
                replaced += 1
        if not replaced and any(op.stream == "allgather" for op in ops):
            raise SimInputError(
                "CIERA rewrite: the anchor run records no engine gather path (gather_host events: captured "
                "before they were recorded) while the codec figures replace it; capture the plain and the "
                "CIERA runs with the same `ciera measure`"
            )
    shards: dict[int, int] = {}  # gather (by identity) → its shards

    def kernel_s(op: EditableOp) -> tuple[float, float]:
        n = shards[id(op)] = layout.shards(engine, op.raw_bytes, op.layer)
        a, b, c = figures.encode_s
        d, e, f = figures.decode_s
        # A kernel of 0 s is not inserted; a tiny floor keeps every call's encode and decode in the graph.
        encode = max(a + b * n + c * op.raw_bytes / world + glue, 1e-9)
        decode = max(d + e * n * (world - 1) + f * op.raw_bytes * (world - 1) / world + glue, 1e-9)
        return encode / work_scale, decode / work_scale

    edited, done = insert_codec(ops, overlap=False, kernel_s=kernel_s)
    if replace_path:
        edited = _add_gather_host(edited, done, figures.gather_host_s_per_call / 2 / work_scale)
    # Overflow rounds: every 1/rate-th first gather of the iteration, the same ones on every rank (the
    # runtime decides from the rows every rank received). The round runs between the gather and its
    # decode; its measured in-run time is added to the gather's (a round of its own would couple the
    # ranks again at each decode point, where a traced graph's ranks are further apart than the runtime's).
    gathers = [insertion.gather for insertion in done]
    firsts = [gather.phase in FIRST_PHASES for gather in gathers]
    new_wires = np.array(
        [
            payload_bytes(g.raw_bytes, first, shards[id(g)], world, figures)
            for g, first in zip(gathers, firsts, strict=True)
        ]
    )
    # Every gather's duration at once: one curve lookup per rank, not two per gather.
    durations = rescaled_durations(
        np.array([g.duration_s for g in gathers]), np.array([g.wire_bytes for g in gathers], dtype=float),
        "all_gather", "all_gather", new_wires, anchor_time_s,
    )  # fmt: skip
    credit = 0.5
    for insertion, first, new_wire, duration_s in zip(
        done, firsts, new_wires.tolist(), durations.tolist(), strict=True
    ):
        gather = insertion.gather
        gather.duration_s = duration_s
        gather.wire_bytes = new_wire
        counts["ciera_gathers"] = counts.get("ciera_gathers", 0) + 1
        if insertion.receive is None:  # no op after it uses it: its decode has nowhere to go
            counts["calls_not_decoded"] = counts.get("calls_not_decoded", 0) + 1
        if gather.raw_bytes / world >= PIPELINED_CALL_BYTES_PER_RANK:
            counts["pipelined_calls"] = counts.get("pipelined_calls", 0) + 1
        if engine == "zero3" and not layout.split(gather.raw_bytes, gather.layer)[1]:
            counts["buckets_not_split"] = counts.get("buckets_not_split", 0) + 1
        if first and figures.overflow_rate > 0:
            credit += figures.overflow_rate
            if credit >= 1.0:
                credit -= 1.0
                gather.duration_s += figures.overflow_s
                counts["overflow_rounds"] = counts.get("overflow_rounds", 0) + 1
    return edited
