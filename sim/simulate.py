"""The sweep: (model, dtype, world size, system) → one SimRecord, plus timelines and JSON output."""

from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import traces

from .cluster import ClusterPreset
from .collectives import CollectiveModel
from .engine import (
    BREAKDOWN_KEYS,
    STREAMS,
    OpGraph,
    Replay,
    busy_s,
    critical_path,
    nominal_iteration_s,
    replay,
    sample_durations,
    sample_iteration_s,
)
from .engine import timeline_events as engine_timeline_events
from .errors import SimInputError
from .profile import BundleIndex, ModelProfile, available_models, build_profile, compute_world_size_for
from .systems import (
    BSC_SYSTEMS,
    CIERA_SYSTEMS,
    FP16_ONLY_SYSTEMS,
    SENDER_CODEC_NAME,
    SYSTEMS,
    BuiltSystem,
    build_system,
    noise_slots,
)

SCHEMA = "ciera.simulate/1"
DEFAULT_GPUS = (4, 8, 16, 32, 64, 128)
# ciera and ciera-er-bsc p50s closer than this are "the same" for the note that says why CCP bought nothing.
CCP_SAME_REL = 0.001
MAX_GPUS = 65536  # beyond the largest training clusters; a typo (1000000) is refused, not simulated
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class SimRecord:
    model: str
    dtype: str
    gpus: int
    system: str
    source: str  # trace source: measured | analytic | mixed
    projected: bool  # world size or depth not traced: the numbers are projections
    iteration_s: dict[str, float]  # p5, p50, p95 over the Monte Carlo samples
    iteration_nominal_s: float  # the simpy replay at nominal (median) durations
    breakdown_s: dict[str, float]  # critical path of the nominal replay; sums to iteration_nominal_s
    codec_busy_s: float  # every codec kernel of the iteration (any stream), nominal
    codec_off_critical_path_s: float  # codec_busy_s − breakdown_s["codec_critical"]: hidden under other work
    codec_removal_saving_s: float  # nominal iteration − the same schedule with every codec kernel at 0 s
    allgather_bytes_per_iter: float  # Σ gathered tensor sizes (wire format), as every rank assembles them
    allgather_bytes_inter_node_per_iter: float  # received by one rank over the inter-node network
    allgather_bytes_intra_node_per_iter: float  # received by one rank over NVLink inside its node
    reduce_scatter_bytes_per_iter: float
    speedup_vs_zero3: float
    speedup_vs_zeropp: float | None
    shards_selected: int
    shards_total: int
    receiver_cache_bytes: float  # ExpCache the selected shards need on each receiving GPU
    within_cache_budget: bool  # receiver_cache_bytes <= ciera.cache_budget_bytes (True without a cache)
    payload_ratio: float  # this system's gathered bytes / zero3's
    bound_speedup: float | None  # this system's own bound (bound_basis); None where none applies
    bound_basis: str  # bytes | link | none: which bound model (docs/simulator.md)
    overlap_only_speedup: float | None
    speedup_parts: dict[str, float]  # bytes × overlap × other = speedup_vs_zero3
    fit_residual: float
    full_layers: int
    compute_world_size: int
    cluster: str
    simulated_events: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Outcome:
    built: BuiltSystem
    replay: Replay
    samples_s: np.ndarray


def _quantiles(samples: np.ndarray) -> dict[str, float]:
    p5, p50, p95 = np.percentile(samples, [5, 50, 95])
    return {"p5": float(p5), "p50": float(p50), "p95": float(p95)}


def _speedup_parts(speedup: float, bound: float | None, overlap_only: float | None) -> dict[str, float]:
    """Split a speedup multiplicatively: first what less link time (fewer bytes, or for ZeRO++ also hpZ's
    intra-node gathers) can explain (at most bound/overlap_only), then what overlap the baseline lacked can
    explain (at most overlap_only), the rest is `other` (above 1: unexplained gain; below 1: the system's
    own overheads). Without a bound everything is `other`."""
    if bound is None or overlap_only is None:
        return {"bytes": 1.0, "overlap": 1.0, "other": float(speedup)}
    bytes_ceiling = max(bound / overlap_only, 1.0)
    from_bytes = min(max(speedup, 1.0), bytes_ceiling)
    from_overlap = min(max(speedup / from_bytes, 1.0), max(overlap_only, 1.0))
    return {
        "bytes": float(from_bytes),
        "overlap": float(from_overlap),
        "other": float(speedup / (from_bytes * from_overlap)),
    }


def _bound_speedup(
    system: str,
    graph: OpGraph,
    zero3_nominal_s: float,
    compute_busy_s: float,
    allgather_busy_s: float,
    other_comm_busy_s: float,
    payload_ratio: float,
) -> tuple[float | None, str]:
    """(the most this system can gain over zero3, which model says so); docs/simulator.md.

    CIERA systems ("bytes", DESIGN.md): zero3's gathers shrunk to r of their link time, perfectly
    overlapped. The others ("link"): the time the system's own collectives hold the serial link — for ZeRO++
    its int8 forward gathers across W, hpZ gathers inside the node and int4 gradient scatters — perfectly
    overlapped. Both sides are zero3's compute, which no system here shortens. "none": zero3 has neither
    compute nor link time, so no ratio exists."""
    if system in CIERA_SYSTEMS:
        link_s = payload_ratio * allgather_busy_s + other_comm_busy_s
        basis = "bytes"
    else:
        link_s = sum(op.duration_s for op in graph.ops if op.uses_link)
        basis = "link"
    denominator = max(compute_busy_s, link_s)
    if denominator <= 0:
        return None, "none"
    return zero3_nominal_s / denominator, basis


def _codec_removal_saving_s(graph: OpGraph, nominal: Replay) -> float:
    """What the iteration would lose if every codec kernel took no time (same schedule, nominal)."""
    durations = [0.0 if op.category == "codec" else op.duration_s for op in graph.ops]
    return max(nominal.iteration_s - nominal_iteration_s(graph, durations), 0.0)


def _note_ccp_without_effect(records: list[SimRecord], outcomes: dict[str, _Outcome]) -> None:
    """Say why ciera ≈ ciera-er-bsc where CCP buys nothing: CCP takes the sender kernels (hash+compress)
    off the compute stream, which can save at most what removing them from ciera-er-bsc would save."""
    by_system = {record.system: record for record in records}
    ciera, bsc = by_system.get("ciera"), by_system.get("ciera-er-bsc")
    if ciera is None or bsc is None:
        return
    gap = abs(ciera.iteration_s["p50"] / bsc.iteration_s["p50"] - 1.0)
    if gap >= CCP_SAME_REL:
        return
    if ciera.shards_selected == 0 and bsc.shards_selected == 0:
        ciera.notes.append(
            f"ciera = ciera-er-bsc at W={ciera.gpus}: no shard is compressed, so CCP has no codec work to overlap"
        )
        return
    outcome = outcomes["ciera-er-bsc"]
    graph = outcome.built.graph
    is_sender = [op.category == "codec" and op.name.startswith(SENDER_CODEC_NAME) for op in graph.ops]
    sender_busy_s = sum(op.duration_s for op, sender in zip(graph.ops, is_sender, strict=True) if sender)
    without_sender_s = nominal_iteration_s(
        graph, [0.0 if sender else op.duration_s for op, sender in zip(graph.ops, is_sender, strict=True)]
    )
    sender_saving_s = max(outcome.replay.iteration_s - without_sender_s, 0.0)
    on_path = critical_path(graph, outcome.replay).ops
    receiver_on_path_s = sum(
        graph.ops[i].duration_s for i in on_path if graph.ops[i].category == "codec" and not is_sender[i]
    )
    ciera.notes.append(
        f"ciera ≈ ciera-er-bsc at W={ciera.gpus} (p50 {gap:.2%} apart): CCP overlaps hash+compress, but in "
        f"ciera-er-bsc those kernels ({sender_busy_s:.3g} s) cost the iteration only {sender_saving_s:.3g} s: "
        f"they run while compute waits on the link. Its critical path holds {receiver_on_path_s:.3g} s of "
        "decompress (each gather's decompress delays its layer and so the next gather's issue), which CCP "
        "leaves on the critical path"
    )


def _normal_draws(preset: ClusterPreset, profile: ModelProfile) -> np.ndarray:
    # Common random numbers: the same draws for every system and world size of a (model, dtype).
    seed = [preset.simulation.seed, zlib.crc32(profile.model.encode()), DTYPES.index(profile.dtype)]
    return np.random.default_rng(seed).standard_normal((noise_slots(profile), preset.simulation.samples))


def resolve_models(bundle: traces.TraceBundle, models: Sequence[str] | None) -> list[str]:
    known = available_models(bundle)
    if not known:
        raise SimInputError("bundle: table 'runs' is empty, nothing to simulate")
    if not models:
        return known
    lookup = {name.lower(): name for name in known}
    resolved: list[str] = []
    for name in models:
        canonical = lookup.get(name.lower()) or lookup.get(_shipped_model_name(name).lower())
        if canonical is None:
            raise SimInputError(
                f"--models: model {name!r} is not in the bundle, expected one of {known} "
                "(or a short name; `ciera models` lists them)"
            )
        if canonical in resolved:
            raise SimInputError(f"--models: {name!r} names {canonical} again; list each model once")
        resolved.append(canonical)
    return resolved


def _shipped_model_name(name: str) -> str:
    """The model name a key or alias of traces/data/models stands for (`olmoe` → `OLMoE-1B-7B`), else ''."""
    try:
        return traces.load_model_shape(name).name
    except (traces.ModelShapeError, OSError, ValueError):
        return ""


def check_request(systems: Sequence[str], gpus: Sequence[int], dtypes: Sequence[str]) -> None:
    for system in systems:
        if system not in SYSTEMS:
            raise SimInputError(f"--systems: unknown system {system!r}, expected one of {list(SYSTEMS)}")
    for world_size in gpus:
        if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 2:
            raise SimInputError(f"--gpus: value {world_size!r}, expected integers >= 2")
        if world_size > MAX_GPUS:
            raise SimInputError(
                f"--gpus: value {world_size}, expected at most {MAX_GPUS} (the largest world size simulated)"
            )
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise SimInputError(f"--dtype: value {dtype!r}, expected one of {list(DTYPES)}")


class Simulator:
    """Caches profiles and collective model for one bundle and preset."""

    def __init__(self, bundle: traces.TraceBundle, preset: ClusterPreset, layers: int | None = None) -> None:
        self.bundle = bundle
        self.layers = layers  # simulate this many blocks instead of the full model
        self.index = BundleIndex(bundle)
        self.preset = preset
        self.collectives = CollectiveModel.from_preset(preset, bundle.collectives)
        source = {
            "preset": "set in the preset",
            "measured": "fitted to the bundle's measured multi-node collectives",
            "calibration": "fitted to the preset's calibration points",
        }[self.collectives.inter_beta_source]
        self.calibration_note = (
            f"inter-node β {self.collectives.inter_beta_Bps / 1e9:.3g} GB/s of {preset.name}: {source}"
        )
        self._profiles: dict[tuple[str, str, int], ModelProfile] = {}
        self._draws: dict[tuple[str, str], np.ndarray] = {}
        self.simulated_events = 0
        self.simpy_seconds = 0.0
        self.simulated_runs = 0
        # (system, model, dtype, W) where selecting every shard or none replayed faster than BSC's choice.
        self.selection_overrides: dict[tuple[str, str, str, int], str] = {}
        self._plain_s: dict[tuple[str, str, int], float] = {}
        self._every_shard_s: dict[tuple[str, str, int], float] = {}

    def profile(self, model: str, dtype: str, world_size: int) -> ModelProfile:
        source_w = compute_world_size_for(self.index, model, dtype, world_size)
        key = (model, dtype, source_w)
        if key not in self._profiles:
            self._profiles[key] = build_profile(
                self.index, model, dtype, source_w, self.preset, target_layers=self.layers
            )
        return self._profiles[key]

    def run(self, system: str, model: str, dtype: str, world_size: int) -> _Outcome:
        profile = self.profile(model, dtype, world_size)
        built = build_system(system, profile, world_size, self.preset, self.collectives)
        started = time.perf_counter()
        nominal = replay(built.graph)
        if system in BSC_SYSTEMS:
            # The per-shard gain model cannot see the schedule (codec work on an idle compute stream costs
            # nothing when the link is the bottleneck). Selection must never lose to compressing every
            # shard or none, so those two plans are replayed too and the fastest is kept (and said).
            chosen, total = built.shards_selected, len(built.decisions) if built.decisions is not None else 0
            # Every shard is a candidate only when every shard's receiver cache fits the budget.
            every_shard_fits = built.decisions is not None and float(
                built.decisions["memory_bytes"].sum()
            ) <= float(self.preset.ciera.cache_budget_bytes)
            alternatives = [
                name
                for name, skip in (("all", chosen == total or not every_shard_fits), ("none", chosen == 0))
                if not skip
            ]
            for selection in alternatives:
                if selection == "none":
                    # No shard compressed is the plain engine's schedule: its time is zero3's.
                    plain_s = self._plain_iteration_s(profile, model, dtype, world_size)
                    if plain_s >= nominal.iteration_s * (1 - 1e-9):
                        continue
                known_all_s = self._every_shard_s.get((model, dtype, world_size))
                if selection == "all" and system == "ciera-er-bsc" and known_all_s is not None:
                    # Every shard without CCP is exactly ciera-er's plan, replayed already.
                    if known_all_s >= nominal.iteration_s * (1 - 1e-9):
                        continue
                candidate = build_system(
                    system, profile, world_size, self.preset, self.collectives, selection
                )
                candidate_replay = replay(candidate.graph)
                if candidate_replay.iteration_s < nominal.iteration_s * (1 - 1e-9):
                    built, nominal = candidate, candidate_replay
                    self.selection_overrides[(system, model, dtype, world_size)] = selection
        if system == "zero3":
            self._plain_s[(model, dtype, world_size)] = nominal.iteration_s
        if system == "ciera-er":
            self._every_shard_s[(model, dtype, world_size)] = nominal.iteration_s
        self.simpy_seconds += time.perf_counter() - started
        self.simulated_events += nominal.events
        self.simulated_runs += 1
        draws_key = (model, dtype)
        if draws_key not in self._draws:
            self._draws[draws_key] = _normal_draws(self.preset, profile)
        samples = sample_iteration_s(built.graph, sample_durations(built.graph, self._draws[draws_key]))
        return _Outcome(built, nominal, samples)

    def _plain_iteration_s(self, profile: ModelProfile, model: str, dtype: str, world_size: int) -> float:
        key = (model, dtype, world_size)
        if key not in self._plain_s:
            plain = build_system("zero3", profile, world_size, self.preset, self.collectives)
            self._plain_s[key] = replay(plain.graph).iteration_s
        return self._plain_s[key]

    def records_for(self, model: str, dtype: str, world_size: int, systems: Sequence[str]) -> list[SimRecord]:
        profile = self.profile(model, dtype, world_size)
        wanted = [s for s in systems if not (dtype == "bf16" and s in FP16_ONLY_SYSTEMS)]
        needed = list(dict.fromkeys(["zero3", *(["zeropp"] if dtype == "fp16" else []), *wanted]))
        outcomes = {system: self.run(system, model, dtype, world_size) for system in needed}
        baseline = outcomes["zero3"]
        base_graph = baseline.built.graph
        compute_busy = busy_s(base_graph, "compute")
        allgather_busy = busy_s(base_graph, "allgather", link_only=True)
        other_comm_busy = busy_s(base_graph, "reduce_scatter", link_only=True)
        base_p50 = float(np.median(baseline.samples_s))
        zeropp_p50 = float(np.median(outcomes["zeropp"].samples_s)) if "zeropp" in outcomes else None
        projected = (
            world_size not in profile.traced_world_sizes or profile.full_layers not in profile.traced_layers
        )
        records = []
        for system in wanted:
            outcome = outcomes[system]
            graph = outcome.built.graph
            p50 = float(np.median(outcome.samples_s))
            ratio = outcome.built.allgather_bytes_per_iter / max(baseline.built.allgather_bytes_per_iter, 1.0)
            base_nominal = baseline.replay.iteration_s
            bound, basis = _bound_speedup(
                system, graph, base_nominal, compute_busy, allgather_busy, other_comm_busy, ratio
            )
            overlap_denominator = max(compute_busy, allgather_busy + other_comm_busy)
            overlap_only = base_nominal / overlap_denominator if overlap_denominator > 0 else None
            speedup = base_p50 / p50
            path = critical_path(graph, outcome.replay)
            codec_busy = busy_s(graph, "codec")
            codec_saving = _codec_removal_saving_s(graph, outcome.replay) if codec_busy > 0 else 0.0
            scatter_bytes = sum(
                op.bytes for op in graph.ops if op.category == "reduce_scatter" and op.uses_link
            )
            decisions = outcome.built.decisions
            cache_bytes = (
                float(decisions.loc[decisions["selected"].astype(bool), "memory_bytes"].sum())
                if decisions is not None
                else 0.0
            )
            budget_bytes = float(self.preset.ciera.cache_budget_bytes)
            over_budget = (
                [
                    f"{system} at W={world_size}: every shard's receiver cache needs "
                    f"{cache_bytes / 2**30:.1f} GiB per GPU, over the {budget_bytes / 2**30:.0f} GiB "
                    "budget (ciera.cache_budget_bytes): an upper reference that does not fit, not a "
                    "deployable plan; ciera and ciera-er-bsc keep within the budget"
                ]
                if cache_bytes > budget_bytes
                else []
            )
            records.append(
                SimRecord(
                    model=model,
                    dtype=dtype,
                    gpus=world_size,
                    system=system,
                    source=profile.source,
                    projected=projected,
                    iteration_s=_quantiles(outcome.samples_s),
                    iteration_nominal_s=outcome.replay.iteration_s,
                    breakdown_s={key: path.parts_s[key] for key in BREAKDOWN_KEYS},
                    codec_busy_s=codec_busy,
                    codec_off_critical_path_s=max(codec_busy - path.parts_s["codec_critical"], 0.0),
                    codec_removal_saving_s=codec_saving,
                    allgather_bytes_per_iter=float(outcome.built.allgather_bytes_per_iter),
                    allgather_bytes_inter_node_per_iter=float(
                        outcome.built.allgather_bytes_inter_node_per_iter
                    ),
                    allgather_bytes_intra_node_per_iter=float(
                        outcome.built.allgather_bytes_intra_node_per_iter
                    ),
                    reduce_scatter_bytes_per_iter=float(scatter_bytes),
                    speedup_vs_zero3=speedup,
                    speedup_vs_zeropp=(zeropp_p50 / p50) if zeropp_p50 is not None else None,
                    shards_selected=outcome.built.shards_selected,
                    shards_total=len(decisions) if decisions is not None else 0,
                    receiver_cache_bytes=cache_bytes,
                    within_cache_budget=not over_budget,
                    payload_ratio=ratio,
                    bound_speedup=bound,
                    bound_basis=basis,
                    overlap_only_speedup=overlap_only,
                    speedup_parts=_speedup_parts(speedup, bound, overlap_only),
                    fit_residual=profile.fit_residual,
                    full_layers=profile.full_layers,
                    compute_world_size=profile.compute_world_size,
                    cluster=self.preset.name,
                    simulated_events=outcome.replay.events,
                    notes=[
                        *profile.notes,
                        self.calibration_note,
                        *(
                            [
                                f"{system} at W={world_size}: BSC's per-shard choice replayed slower than "
                                f"selecting {self.selection_overrides[(system, model, dtype, world_size)]} "
                                "shards; that plan is used"
                            ]
                            if (system, model, dtype, world_size) in self.selection_overrides
                            else []
                        ),
                        *over_budget,
                    ],
                )
            )
        _note_ccp_without_effect(records, outcomes)
        return records


def simulate(
    bundle: traces.TraceBundle,
    cluster: ClusterPreset,
    models: Sequence[str] | None = None,
    gpus: Sequence[int] = DEFAULT_GPUS,
    systems: Sequence[str] = SYSTEMS,
    dtypes: Sequence[str] = DTYPES,
    progress: Callable[[int, int], None] | None = None,
    layers: int | None = None,
) -> list[SimRecord]:
    """One record per (model, dtype, gpus, system); zeropp only for fp16 (as in DeepSpeed's evaluation).
    `layers`: simulate that many blocks instead of each model's full depth."""
    check_request(systems, gpus, dtypes)
    names = resolve_models(bundle, models)
    simulator = Simulator(bundle, cluster, layers=layers)
    jobs = [
        (model, dtype, world_size)
        for model in names
        for dtype in dtypes
        if _has_runs(bundle, model, dtype)
        for world_size in gpus
    ]
    if not jobs:
        raise SimInputError(f"bundle: no runs of {names} with dtype {list(dtypes)}")
    records: list[SimRecord] = []
    for done, (model, dtype, world_size) in enumerate(jobs, start=1):
        records.extend(simulator.records_for(model, dtype, world_size, systems))
        if progress is not None:
            progress(done, len(jobs))
    return records


def _has_runs(bundle: traces.TraceBundle, model: str, dtype: str) -> bool:
    runs = bundle.runs
    return bool(((runs["model"] == model) & (runs["dtype"] == dtype)).any())


def timeline(
    bundle: traces.TraceBundle,
    cluster: ClusterPreset,
    model: str,
    dtype: str,
    gpus: int,
    systems: Iterable[str] = SYSTEMS,
    layers: int | None = None,
) -> dict[str, Any]:
    """One simulated iteration per system as Chrome trace JSON (opens in Perfetto / chrome://tracing):
    one process per system, one thread per stream, complete events with µs timestamps."""
    check_request(list(systems), [gpus], [dtype])
    (model,) = resolve_models(bundle, [model])
    simulator = Simulator(bundle, cluster, layers=layers)
    events: list[dict[str, Any]] = []
    for pid, system in enumerate(systems, start=1):
        if dtype == "bf16" and system in FP16_ONLY_SYSTEMS:
            continue
        outcome = simulator.run(system, model, dtype, gpus)
        label = f"{system} — {model} {dtype} W={gpus}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        for tid, stream in enumerate(STREAMS, start=1):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}}
            )
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        tids = {stream: tid for tid, stream in enumerate(STREAMS, start=1)}
        for event in engine_timeline_events(outcome.built.graph, outcome.replay):
            duration_us = (event["end_s"] - event["start_s"]) * 1e6  # type: ignore[operator]
            if duration_us <= 0:
                continue
            events.append(
                {
                    "ph": "X",
                    "name": event["name"],
                    "cat": event["stream"],
                    "pid": pid,
                    "tid": tids[str(event["stream"])],
                    "ts": float(event["start_s"]) * 1e6,  # type: ignore[arg-type]
                    "dur": duration_us,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schema": "ciera.timeline/1"}}


def records_to_json(records: Sequence[SimRecord], cluster: ClusterPreset | None = None) -> dict[str, Any]:
    document: dict[str, Any] = {"schema": SCHEMA, "records": [record.to_dict() for record in records]}
    if cluster is not None:
        document["cluster"] = cluster.name
    return document


def check_output_path(path: str | os.PathLike[str], option: str) -> Path:
    """Fail before any work when `path` can never be written as a file (a directory, or under a file)."""
    target = Path(path)
    if target.is_dir():
        raise SimInputError(f"{option} {target}: is a directory, expected a file path")
    directory = target.parent
    if not directory.is_dir():
        # Never create directories on the way: a typo would otherwise leave a tree behind (as root, anywhere).
        raise SimInputError(f"{option} {target}: directory {directory} does not exist")
    return target


def write_json_atomic(document: dict[str, Any], path: str | os.PathLike[str], option: str = "output") -> Path:
    """Write JSON next to `path` and rename it into place: readers never see a partial file."""
    target = check_output_path(path, option)
    try:
        handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    except OSError as error:
        raise SimInputError(f"{option} {target}: cannot write ({error.strerror or error})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes it private; an output file should not be
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=1, allow_nan=False)
            stream.write("\n")
        os.replace(staging, target)
    except BaseException as error:
        Path(staging).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise SimInputError(f"{option} {target}: cannot write ({error.strerror or error})") from None
        raise
    return target
