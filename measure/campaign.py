"""`ciera measure all`: a whole trace bundle in one command — for every topology, the collectives sweep and
the layer runs (each depth × system), plus one exponent-statistics run — then the bundle assembled.

Output directory (``--out DIR``):

- ``plan.json``: what is captured; a rerun with the same DIR must ask for the same plan (else one line).
- ``runs/<run_id>/``: one finished run each (its job, its result, every rank's events and logs). A run is
  captured in ``.partial/<run_id>/`` and renamed into ``runs/`` only when every rank has finished, so a
  rerun keeps finished runs and redoes an interrupted one (``.partial`` is cleared at the start).
- ``bundle/``: the trace bundle (`traces.write_bundle`: validated, written atomically).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .capture import SYSTEMS, LayersJob, train_config_for, write_text_atomic
from .launch import CaptureError, run_job

PLAN_SCHEMA = "ciera.measure.plan/1"
MAX_LAUNCHES = 16  # launches per run (`CapturePlan.launches`)


@dataclass(frozen=True)
class Topology:
    """`nodes` × `ranks_per_node` ranks; with a link rate the nodes are namespaces of the emulated cluster."""

    nodes: int = 1
    ranks_per_node: int = 2
    link_rate: str | None = None  # tc syntax, e.g. "200mbit"; None: plain local ranks, no shaping
    link_latency_s: float = 0.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def emulated(self) -> bool:
        return self.link_rate is not None

    @property
    def name(self) -> str:
        if not self.emulated:
            return (
                f"local-{self.world_size}"
                if self.nodes == 1
                else f"cluster-{self.nodes}x{self.ranks_per_node}"
            )
        latency = f"-{self.link_latency_s * 1e3:g}ms" if self.link_latency_s else ""
        return f"emulated-{self.nodes}x{self.ranks_per_node}-{self.link_rate}{latency}"


@dataclass(frozen=True)
class CapturePlan:
    model: str = "mixtral-8x7b"
    width_scale: int | None = 32
    layers: tuple[int, ...] = (2, 4, 6, 8)
    systems: tuple[str, ...] = ("zero3", "fsdp", "ciera")
    topologies: tuple[Topology, ...] = (Topology(),)
    iterations: int = 3
    warmup_iterations: int = 2
    # Each run times at least this long: more iterations where iterations are short, so that the median of
    # a short run spans the host's seconds-long slow phases as a long run's does (capture.timed_iterations).
    min_timed_s: float = 0.0
    # Each layer run is launched this many times, every launch fresh ranks, the launches of all runs in
    # rounds (`interleaved_order`); the bundle pools a run's launches' timed iterations. A launch's ranks
    # keep a speed of their own for the whole launch (docs/measurement.md, "Launches"), which no number of
    # iterations within one launch averages out.
    launches: int = 1
    # How the ranks' freed memory is handled (measure.launch.ALLOCATORS): "retain" keeps it in the process,
    # as a GPU rank's caching allocator does, instead of faulting large buffers in again every iteration.
    allocator: str = "retain"
    micro_batch_size: int = 2  # sequences per rank
    seq_len: int = 64
    seed: int = 0
    activation_checkpointing: bool = True
    select: bool = False  # CIERA's BSC: compress only the shards whose measured benefit pays (both engines)
    block_size: int = 64  # CIERA's B in every run (and one of the exponent run's block sizes)
    # Steps every run trains before its first iteration, with nothing recorded: a capture of mid-training
    # churn rather than of the first steps. Batches go on from step to step.
    warm_steps: int = 0
    # ZeRO-3 schedule, in blocks of the captured model (None: DeepSpeed's default in elements).
    prefetch_bucket_blocks: float | None = 1.0
    max_live_blocks: float | None = 1.0
    max_reuse_distance_blocks: float | None = 0.0
    # Gradients are reduce-scattered in buckets of this many blocks during backward, as in a model far larger
    # than DeepSpeed's default bucket (5e8 elements); the default would reduce the whole model at the end.
    reduce_bucket_blocks: float | None = 1.0
    collectives: bool = True
    collectives_max_bytes: int = 64 << 20
    collectives_repetitions: int = 5
    # Each size is timed until about this long was spent on it (at most 200 repetitions; measure.collectives).
    collectives_min_time_s: float = 0.5
    exponent_steps: int = 0  # 0: no exponent-statistics run
    exponent_warmup_steps: int = 10
    exponent_layers: int = 4
    timeout_s: float = 600.0
    kinds: tuple[str, ...] = ("collectives", "layers", "exponents")

    def check(self) -> None:
        from .zoo import scaled_shape

        for system in self.systems:
            if system not in SYSTEMS:
                raise CaptureError(f"--systems: {system!r} is not a system (expected {', '.join(SYSTEMS)})")
        if not self.layers or any(depth < 1 for depth in self.layers):
            raise CaptureError(f"--layers {','.join(map(str, self.layers))}: expected depths >= 1")
        for depth in self.layers:
            scaled_shape(self.model, self.width_scale, depth)  # unknown model or too deep: one line
        for name in ("iterations", "micro_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise CaptureError(f"--{name.replace('_', '-')} is {getattr(self, name)}: expected >= 1")
        from .train import block_size_problem

        problem = block_size_problem(self.block_size, "--block-size")
        if problem:
            raise CaptureError(problem)
        if isinstance(self.warm_steps, bool) or not isinstance(self.warm_steps, int) or self.warm_steps < 0:
            raise CaptureError(f"--warm-steps is {self.warm_steps!r}: expected an integer >= 0")
        if self.warmup_iterations < 1:
            raise CaptureError("--warmup must be >= 1 (the first iteration builds the engines' state)")
        launches = self.launches
        if isinstance(launches, bool) or not isinstance(launches, int) or not 1 <= launches <= MAX_LAUNCHES:
            raise CaptureError(f"--launches is {launches!r}: expected an integer from 1 to {MAX_LAUNCHES}")
        from .launch import ALLOCATORS

        if self.allocator not in ALLOCATORS:
            raise CaptureError(f"--allocator {self.allocator!r}: expected one of {', '.join(ALLOCATORS)}")
        timed_s = self.min_timed_s
        if (
            isinstance(timed_s, bool)
            or not isinstance(timed_s, int | float)
            or not 0.0 <= timed_s < float("inf")
        ):
            raise CaptureError(f"--min-timed-s is {timed_s!r}: expected a number of seconds >= 0")
        if self.exponent_steps and self.exponent_steps <= self.exponent_warmup_steps:
            raise CaptureError(
                f"--exponent-steps {self.exponent_steps}: must exceed the {self.exponent_warmup_steps} warm-up steps"
            )

    def to_json(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, **dataclasses.asdict(self)}


def model_label(key: str, width_scale: int) -> str:
    """The runs table's model name: the zoo key, with the width divisor when the model is scaled."""
    return key if width_scale == 1 else f"{key}-w{width_scale}"


def run_id_for(label: str, system: str, depth: int, topology: Topology) -> str:
    return f"{label}-{system}-L{depth}-{topology.name}"


def _blocks_to_elements(blocks: float | None, block_numel: int) -> int | None:
    return None if blocks is None else int(round(blocks * block_numel))


def layer_jobs(plan: CapturePlan) -> list[tuple[Topology, LayersJob]]:
    from .zoo import default_width_scale, model_reference, parameter_count, scaled_shape

    scale = plan.width_scale or default_width_scale(plan.model)
    key = scaled_shape(plan.model, scale, 1).key
    reference = model_reference(plan.model)  # what a rank builds: a file outside the zoo by its path
    one_block = parameter_count(scaled_shape(reference, scale, 2)) - parameter_count(
        scaled_shape(reference, scale, 1)
    )
    label = model_label(key, scale)
    jobs = []
    for topology in plan.topologies:
        for depth in plan.layers:
            for system in plan.systems:
                train = train_config_for(
                    system,
                    model=reference,
                    width_scale=scale,
                    layers=depth,
                    world_size=topology.world_size,
                    global_batch=plan.micro_batch_size * topology.world_size,
                    seq_len=plan.seq_len,
                    seed=plan.seed,
                    activation_checkpointing=plan.activation_checkpointing,
                    select=plan.select and SYSTEMS[system][1],
                    block_size=plan.block_size,
                    timeout_s=plan.timeout_s,
                    prefetch_bucket_size=_blocks_to_elements(plan.prefetch_bucket_blocks, one_block),
                    max_live_parameters=_blocks_to_elements(plan.max_live_blocks, one_block),
                    max_reuse_distance=_blocks_to_elements(plan.max_reuse_distance_blocks, one_block),
                    reduce_bucket_size=_blocks_to_elements(plan.reduce_bucket_blocks, one_block),
                )
                for launch in range(1, plan.launches + 1):
                    job = LayersJob(
                        run_id=run_id_for(label, system, depth, topology),
                        system=system,
                        train=train,
                        warmup_iterations=plan.warmup_iterations,
                        iterations=plan.iterations,
                        warm_steps=plan.warm_steps,
                        min_timed_s=plan.min_timed_s,
                        launch=launch,
                    )
                    jobs.append((topology, job))
    return jobs


def launch_name(run_id: str, launch: int) -> str:
    """The directory of one launch of a run under ``runs/``: the run's id for the first (a capture of one
    launch per run looks as it always did), ``<run_id>.launch<k>`` for the others."""
    return run_id if launch == 1 else f"{run_id}.launch{launch}"


@dataclass
class Step:
    """One unit of a capture: a job on one topology, and where its finished result lives."""

    kind: str
    name: str
    topology: Topology
    job: dict[str, Any]
    iterations: int


def plan_steps(plan: CapturePlan) -> list[Step]:
    from .zoo import default_width_scale, model_reference, scaled_shape

    scale = plan.width_scale or default_width_scale(plan.model)
    key = scaled_shape(plan.model, scale, 1).key
    reference = model_reference(plan.model)
    steps: list[Step] = []
    for topology in plan.topologies:
        if "collectives" in plan.kinds and plan.collectives:
            steps.append(
                Step(
                    "collectives",
                    f"collectives-{topology.name}",
                    topology,
                    {
                        "kind": "collectives",
                        "min_bytes": 1024,
                        "max_bytes": plan.collectives_max_bytes,
                        "warmup": 2,
                        "repetitions": plan.collectives_repetitions,
                        "min_time_s": plan.collectives_min_time_s,
                        "ranks_per_node": topology.ranks_per_node,
                        "timeout_s": plan.timeout_s,
                    },
                    1,
                )
            )
        if "layers" in plan.kinds:
            for job_topology, job in layer_jobs(plan):
                if job_topology == topology:
                    steps.append(
                        Step(
                            "layers",
                            launch_name(job.run_id, job.launch),
                            topology,
                            job.to_json() | {"timeout_s": plan.timeout_s},
                            job.warm_steps + job.warmup_iterations + job.iterations,
                        )
                    )
    if "exponents" in plan.kinds and plan.exponent_steps:
        topology = plan.topologies[0]
        train = train_config_for(
            "zero3",
            model=reference,
            width_scale=scale,
            layers=plan.exponent_layers,
            world_size=topology.world_size,
            global_batch=plan.micro_batch_size * topology.world_size,
            seq_len=plan.seq_len,
            seed=plan.seed,
            steps=plan.exponent_steps,
            activation_checkpointing=plan.activation_checkpointing,
            block_size=plan.block_size,
            timeout_s=plan.timeout_s,
        )
        run_id = f"{model_label(key, scale)}-exponents-L{plan.exponent_layers}-{topology.name}"
        steps.append(
            Step(
                "exponents",
                run_id,
                topology,
                {
                    "kind": "exponents",
                    "run_id": run_id,
                    "train": dataclasses.asdict(train),
                    "warmup_steps": plan.exponent_warmup_steps,
                    "warm_steps": plan.warm_steps,
                    "timeout_s": plan.timeout_s,
                },
                plan.warm_steps + plan.exponent_steps,
            )
        )
    return steps


def _with_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """A job document with the fields added since it was written filled in with their defaults (a run
    recorded before a field existed ran with that field's default)."""
    from .train import TrainConfig

    job = json.loads(json.dumps(job))
    if job.get("kind") == "layers":
        defaults = {
            f.name: f.default for f in dataclasses.fields(LayersJob) if f.default is not dataclasses.MISSING
        }
        job = defaults | job
    elif job.get("kind") == "exponents":
        job = {"warm_steps": 0} | job
    if isinstance(job.get("train"), dict):
        job["train"] = json.loads(json.dumps(dataclasses.asdict(TrainConfig()))) | job["train"]
    return job


def _same_job(finished: Path, job: dict[str, Any]) -> bool:
    try:
        return _with_defaults(json.loads((finished / "job.json").read_text())) == _with_defaults(job)
    except (OSError, ValueError):
        return False


def _finished(directory: Path, kind: str) -> bool:
    expected = {"layers": "run.json", "collectives": "collectives.json", "exponents": "run.json"}[kind]
    return (directory / expected).is_file()


# Plan fields a rerun may grow: a capture extended with more topologies, depths, systems or kinds of capture
# (a sweep, then `ciera measure all`) keeps every step it has (each only when its own job is unchanged) and
# adds the others.
EXTENSIBLE_PLAN_FIELDS = ("topologies", "layers", "systems", "kinds")
# Counts a rerun may raise: with more launches per run every run keeps the launches it has (their jobs are
# unchanged) and gains the new ones, pooled with them — a noisy capture steadied without retaking it.
RAISABLE_PLAN_COUNTS = ("launches",)
# What a plan recorded before a field existed ran with, where that is not the field's default now.
LEGACY_PLAN_DEFAULTS = {"allocator": "system"}


def prepare_out_dir(plan: CapturePlan, out_dir: Path) -> list[str]:
    """Check `plan`, create `out_dir`, and record the plan there — or refuse when it holds another plan.
    A plan that only adds topologies, depths, systems or kinds to the recorded one, or raises its launches
    per run, extends the capture: the recorded plan is replaced by it, and what it adds is returned (one
    line per field) for the console."""
    plan.check()
    if out_dir.exists() and not out_dir.is_dir():
        raise CaptureError(f"--out {out_dir}: is a file, expected a capture directory (new or earlier)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file on the way, no permission, a read-only file system
        raise CaptureError(f"--out {out_dir}: cannot create the directory ({error.strerror})") from None
    plan_path = out_dir / "plan.json"
    document = plan.to_json()
    current = json.loads(json.dumps(document))
    if not plan_path.exists():
        write_text_atomic(plan_path, json.dumps(document, indent=1))
        return []
    try:
        previous = json.loads(plan_path.read_text())
    except (OSError, ValueError) as error:
        raise CaptureError(
            f"--out {out_dir}: cannot read its plan.json ({error}); use a new --out directory"
        ) from None
    if not isinstance(previous, dict):
        raise CaptureError(
            f"--out {out_dir}: its plan.json holds {type(previous).__name__}, expected a JSON object"
        )
    # A plan recorded before a field existed ran with that field's default — but for the allocator, whose
    # default changed when the field came: those captures ran with the system's.
    defaults = json.loads(json.dumps(CapturePlan().to_json())) | LEGACY_PLAN_DEFAULTS
    changed = sorted(k for k in current if previous.get(k, defaults.get(k)) != current[k])
    extensions = [_extension(key, previous.get(key, defaults[key]), current[key], out_dir) for key in changed]
    if None in extensions:
        raise CaptureError(
            f"--out {out_dir}: holds a capture of another plan (differs in {', '.join(changed)}); "
            "use a new --out directory or the same options (a rerun may only add topologies, layers, systems or "
            "kinds, or raise --launches)"
        )
    if extensions:
        write_text_atomic(plan_path, json.dumps(document, indent=1))
    return extensions


def _extension(key: str, before: Any, after: Any, out_dir: Path) -> str | None:
    """The console line for plan field `key` grown from `before` to `after` by a rerun, or None where the
    change is not growth (another plan). A recorded count that is not an int (a hand-edited plan.json) is
    never raised from."""
    prefix = f"--out {out_dir}: extends the capture there with {key}"
    if key in RAISABLE_PLAN_COUNTS:
        if isinstance(before, bool) or not isinstance(before, int) or before >= after:
            return None
        first = before + 1
        numbers = str(first) if first == after else f"{first}-{after}"
        return f"{prefix} {numbers} of every run, pooled with the {before} it has"
    if key in EXTENSIBLE_PLAN_FIELDS and all(item in after for item in before):
        return f"{prefix} {', '.join(_plan_item_name(key, item) for item in after if item not in before)}"
    return None


def _plan_item_name(key: str, item: Any) -> str:
    if key == "topologies":
        return Topology(**item).name
    return str(item)


def capture_all(
    plan: CapturePlan,
    out_dir: Path,
    on_step: Callable[[str, Step, dict], None] | None = None,
    emulated_cluster_factory=None,
) -> dict[str, Any]:
    """Capture every step of `plan` not already finished in `out_dir`; returns what was done.

    Emulated topologies of one shape (nodes, ranks per node, latency) that differ only in link rate share
    one emulated cluster, re-shaped between runs (`EmulatedCluster.set_link_rate`), and their runs are
    interleaved (`interleaved_order`): every sweep first, then per depth every rate's systems in turn —
    so slow drift of the machine's speed hits every rate alike, as it hits every system alike."""
    extended = prepare_out_dir(plan, out_dir)
    partial = out_dir / ".partial"
    if partial.exists():
        shutil.rmtree(partial)  # an interrupted run: discarded, redone
    notify = on_step or (lambda event, step, info: None)
    done = {"captured": [], "kept": [], "links": {}, "extended": extended}
    for group in interleaved_order(plan_steps(plan)):
        todo = []
        for step in group:
            finished = out_dir / _kind_dir(step.kind) / step.name
            if _finished(finished, step.kind) and _same_job(finished, step.job):
                done["kept"].append(step.name)
                notify("kept", step, {})
            else:
                todo.append(step)
        if not todo:
            continue
        cluster = None
        try:
            for step in todo:
                topology = step.topology
                if topology.emulated:
                    if cluster is None:
                        cluster = (emulated_cluster_factory or _open_emulated)(topology, plan)
                    elif cluster.link_rate != topology.link_rate:
                        cluster.set_link_rate(topology.link_rate)
                    if topology.name not in done["links"]:
                        link = _link_record(topology, cluster, out_dir)
                        done["links"][topology.name] = link
                        notify("link", step, link)
                scratch = partial / step.name
                notify("start", step, {})
                run_job(
                    step.job,
                    scratch,
                    topology.world_size,
                    topology.ranks_per_node,
                    cluster=cluster if topology.emulated else None,
                    timeout_s=plan.timeout_s,
                    on_progress=lambda record, step=step: notify("progress", step, record),
                    allocator=plan.allocator,
                )
                _publish(scratch, out_dir / _kind_dir(step.kind) / step.name, topology, out_dir)
                done["captured"].append(step.name)
                notify("done", step, {})
        finally:
            if cluster is not None:
                cluster.close()
    if partial.exists():
        shutil.rmtree(partial, ignore_errors=True)
    return done


def _shape(topology: Topology) -> tuple:
    """What one emulated cluster can serve by re-shaping its link: all but the rate (plain ranks: itself)."""
    if not topology.emulated:
        return ("plain", topology)
    return ("emulated", topology.nodes, topology.ranks_per_node, topology.link_latency_s)


def interleaved_order(steps: list[Step]) -> list[list[Step]]:
    """`steps` in groups that share one cluster (`_shape`), in the order they run: a group's sweeps first
    (in topology order), then its layer runs by depth, and within a depth by topology (link rate), then
    system — each depth's runs of every rate back to back — then the rest (the exponent statistics run).
    The systems of one (launch, depth, rate) block start one further along the plan's list than the block
    before (a later launch one more), so a slow spell of the host at the end of a block does not always
    fall on the same system (a fixed order put both CIERA systems last in every block; docs/validation.md,
    "The whole plan again").
    With several launches per run, the layer runs go in rounds: every run's first launch in that order, then
    every run's second, and so on — a run's launches spread over the whole capture."""
    groups: dict[tuple, list[Step]] = {}
    for step in steps:
        groups.setdefault(_shape(step.topology), []).append(step)
    return [sorted(group, key=_run_order_key(group)) for group in groups.values()]


def _run_order_key(group: list[Step]) -> Callable[[Step], tuple]:
    """Sort key of `interleaved_order` within one group (ties keep the plan's order: sorted is stable)."""
    topologies = list(dict.fromkeys(step.topology for step in group))
    layer_steps = [step for step in group if step.kind == "layers"]
    systems = list(dict.fromkeys(str(step.job["system"]) for step in layer_steps))
    # Each block's offset: its place in the run order, and per launch one more, so that a run's launches
    # sit at other places in their blocks.
    offsets = {
        block: place + block[0] - 1
        for place, block in enumerate(sorted({_block(step, topologies) for step in layer_steps}))
    }

    def key(step: Step) -> tuple:
        if step.kind == "collectives":
            return (0, 0, 0, topologies.index(step.topology))
        if step.kind == "layers":
            block = _block(step, topologies)
            return (1, *block, (systems.index(str(step.job["system"])) - offsets[block]) % len(systems))
        return (2,)

    return key


def _block(step: Step, topologies: list[Topology]) -> tuple[int, int, int]:
    """(launch, depth, rate's place): the layer runs that go back to back, one per system."""
    return (int(step.job.get("launch", 1)), int(step.job["train"]["layers"]), topologies.index(step.topology))


def _publish(scratch: Path, target: Path, topology: Topology, out_dir: Path) -> None:
    """A finished step: its topology recorded, then its directory renamed into place in one step."""
    write_text_atomic(scratch / "topology.json", json.dumps(_topology_record(topology, out_dir)))
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    os.replace(scratch, target)


def _kind_dir(kind: str) -> str:
    return {"layers": "runs", "collectives": "collectives", "exponents": "exponents"}[kind]


def _open_emulated(topology: Topology, plan: CapturePlan):
    from .emulated import EmulatedCluster

    cluster = EmulatedCluster(
        topology.nodes, topology.ranks_per_node, topology.link_rate, link_latency_s=topology.link_latency_s
    )
    cluster.open()
    return cluster


def _link_record(topology: Topology, cluster, out_dir: Path) -> dict[str, Any]:
    """The inter-node rate gloo actually gets on this topology (measured once per topology, kept)."""
    from .emulated import parse_rate_Bps, probe_link

    path = out_dir / "links" / f"{topology.name}.json"
    if path.exists():
        return json.loads(path.read_text())
    probe = probe_link(cluster)
    record = {
        "topology": topology.name,
        "link_rate": topology.link_rate,
        "link_rate_Bps": parse_rate_Bps(topology.link_rate),
        "link_latency_s": topology.link_latency_s,
        **probe,
        "cluster": cluster.describe(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1))
    return record


def _topology_record(topology: Topology, out_dir: Path) -> dict[str, Any]:
    link = {}
    if topology.emulated:
        path = out_dir / "links" / f"{topology.name}.json"
        link = json.loads(path.read_text()) if path.exists() else {}
    return {
        "name": topology.name,
        "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node,
        "link_rate": topology.link_rate,
        "link_rate_Bps": link.get("link_rate_Bps", 0.0),
        "link_latency_s": topology.link_latency_s,
        "measured_link_Bps": link.get("measured_link_Bps", 0.0),
    }


# ---------------------------------------------------------------------------------------- under a launcher


def launched_topology() -> Topology:
    """The topology torchrun / the deepspeed launcher formed: WORLD_SIZE ranks, LOCAL_WORLD_SIZE per node."""
    world_size = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node:
        raise CaptureError(
            f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={per_node}: expected whole nodes of equal size"
        )
    return Topology(nodes=world_size // per_node, ranks_per_node=per_node)


def capture_launched(
    plan: CapturePlan, out_dir: Path, on_step: Callable[[str, Step, dict], None] | None = None
) -> dict[str, Any] | None:
    """This process is one rank started by torchrun or the deepspeed launcher (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE): every rank runs every step of `plan` in-process, in the
    same order, on the launcher's group; `out_dir` must be on a file system every rank sees. Rank 0 keeps
    the books (what is finished, the renames) and returns what was done; the others return None. A rank
    that does not join within `plan.timeout_s` makes the others fail with one line instead of waiting."""
    import torch.distributed as dist

    from .capture import run_collectives_rank, run_exponents_rank, run_layers_rank
    from .events import EventRecorder
    from .placement import init_group, place_rank

    rank = int(os.environ["RANK"])
    topology = launched_topology()
    plan = dataclasses.replace(plan, topologies=(topology,))
    if rank == 0:
        prepare_out_dir(plan, out_dir)
    EventRecorder.install()  # before any engine keeps a reference to the collectives
    os.environ.setdefault("LOCAL_RANK", str(rank % topology.ranks_per_node))
    placement = place_rank()  # cuda:<LOCAL_RANK> with NCCL when CUDA is available, else CPU with gloo
    try:
        init_group(placement, rank, topology.world_size, plan.timeout_s)
        dist.barrier()
    except Exception as error:  # noqa: BLE001 — a missing rank: one line, not a hang
        raise CaptureError(
            f"rank {rank}: the process group of {topology.world_size} ranks did not form within "
            f"{plan.timeout_s:.0f} s (a rank is missing?): {str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    notify = on_step or (lambda event, step, info: None)
    done: dict[str, Any] = {"captured": [], "kept": [], "links": {}}
    try:
        for step in plan_steps(plan):
            finished = out_dir / _kind_dir(step.kind) / step.name
            decision = (
                [_finished(finished, step.kind) and _same_job(finished, step.job)] if rank == 0 else [None]
            )
            dist.broadcast_object_list(decision, src=0)
            if decision[0]:
                done["kept"].append(step.name)
                notify("kept", step, {})
                continue
            scratch = out_dir / ".partial" / step.name
            if rank == 0:
                if scratch.exists():
                    shutil.rmtree(scratch)
                scratch.mkdir(parents=True)
                (scratch / "job.json").write_text(json.dumps(step.job, indent=1))
            dist.barrier()
            notify("start", step, {})
            progress = (
                (lambda record, step=step: notify("progress", step, record))
                if rank == 0
                else (lambda r: None)
            )
            if step.kind == "layers":
                run_layers_rank(LayersJob.from_json(step.job), scratch, rank, topology.world_size, progress)
            elif step.kind == "collectives":
                run_collectives_rank(step.job, scratch, rank, topology.world_size, progress)
            else:
                run_exponents_rank(step.job, scratch, rank, topology.world_size, progress)
            dist.barrier()
            if rank == 0:
                _publish(scratch, finished, topology, out_dir)
            done["captured"].append(step.name)
            notify("done", step, {})
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return done if rank == 0 else None
