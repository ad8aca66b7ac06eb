"""The report's Validation section: what `ciera validate lossless`, `ciera validate divergence` and
`ciera validate sim` measured, read from their `--json` files.

Each file is recognised by its `schema` field and checked field by field (`load_validation`), so a bad
file is one line naming the file, the field, the value and what was expected. The schema strings are the
validation package's own (a test checks that they match); the report does not import that package, so
rendering a saved file never loads the training stack.
"""

from __future__ import annotations

import math
import os
import shlex
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sim import BREAKDOWN_KEYS as PATH_PARTS  # a critical path's parts (sim.evaluate.critical_path)

from .errors import ReportInputError
from .inputs import read_json

LOSSLESS_SCHEMA = "ciera.validate.lossless/1"
DIVERGENCE_SCHEMA = "ciera.validate.divergence/1"
SIM_SCHEMA = "ciera.validate.sim/1"
SCHEMAS = {LOSSLESS_SCHEMA: "lossless", DIVERGENCE_SCHEMA: "divergence", SIM_SCHEMA: "sim"}
# Files of the report's other options, named in the error when given here by mistake.
OTHER_OPTIONS = {"ciera.simulate/1": "--records", "ciera.simulate.sweep/1": "--sensitivity"}
# What makes each kind of file, shown whenever a kind is missing from the section.
PRODUCERS = {
    "lossless": "ciera validate lossless --engine zero3 --json lossless.json",
    "divergence": "ciera validate divergence --engine zero3 --json divergence.json",
    "sim": "ciera validate sim --json validate-sim.json",
}
DIVERGENCE_METRICS = ("kl", "routing_differ", "top1_agreement")
VS_SEED_FIELDS = ("kl_vs_seed", "routing_differ_vs_seed", "top1_disagreement_vs_seed")
SEED_ARM = "seed"  # the yardstick: "as different as a new seed"
HELD_OUT_WINDOW_TOKENS = 64  # `ciera validate divergence --held-out-sequences` counts windows of 64 tokens
REPLAY_TARGET = 0.01  # `ciera validate sim`: the replay of the seen runs must be within 1 %


# What the report shows when no --validation file is given: the simulator's own check of the shipped
# measured bundle, written by `ciera validate sim --held-out traces/data/measured.held-out.toml --json
# report/data/validate-sim-measured.json` (a heavy test checks it still matches what that command computes).
SHIPPED_SIM_VALIDATION = Path(__file__).resolve().parent / "data" / "validate-sim-measured.json"


@dataclass(frozen=True)
class ValidationFile:
    kind: str  # lossless, divergence or sim (SCHEMAS' values)
    origin: str  # the file it was read from
    document: dict[str, Any]
    shipped: bool = False  # the package's own result, shown when the user gave none


@dataclass(frozen=True)
class ValidationResults:
    files: tuple[ValidationFile, ...] = field(default_factory=tuple)

    def of_kind(self, kind: str) -> list[ValidationFile]:
        return [f for f in self.files if f.kind == kind]

    @property
    def missing_kinds(self) -> list[str]:
        return [kind for kind in PRODUCERS if not self.of_kind(kind)]


# ------------------------------------------------------------------------------------------- checking


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Typed access to a document's fields; every failure is one ReportInputError naming origin and path."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, path: str, value: object, expected: str) -> ReportInputError:
        return ReportInputError(f"{self.origin}: field '{path}': {value!r}, expected {expected}")

    def get(self, node: Mapping[str, Any], path: str, key: str, expected: str) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in node:
            raise ReportInputError(f"{self.origin}: field '{full}': missing, expected {expected}")
        return node[key]

    def _checked(
        self, node: Mapping[str, Any], path: str, key: str, expected: str, ok: Callable[[Any], bool]
    ) -> Any:
        value = self.get(node, path, key, expected)
        if not ok(value):
            raise self.fail(f"{path}.{key}" if path else key, value, expected)
        return value

    def number(
        self,
        node: Mapping[str, Any],
        key: str,
        path: str = "",
        low: float | None = None,
        high: float | None = None,
        nullable: bool = False,
    ) -> float | None:
        bounds = [f">= {low:g}"] if low is not None else []
        bounds += [f"<= {high:g}"] if high is not None else []
        expected = (
            "a finite number" + (f" {' and '.join(bounds)}" if bounds else "") + (" or null" * nullable)
        )

        def ok(value: Any) -> bool:
            if value is None:
                return nullable
            return _is_number(value) and (low is None or value >= low) and (high is None or value <= high)

        return self._checked(node, path, key, expected, ok)

    def integer(
        self, node: Mapping[str, Any], key: str, path: str = "", low: int | None = 0, nullable: bool = False
    ) -> int | None:
        expected = "an integer" + (f" >= {low}" if low is not None else "") + (" or null" * nullable)
        return self._checked(
            node,
            path,
            key,
            expected,
            lambda v: (v is None and nullable) or (_is_integer(v) and (low is None or v >= low)),
        )

    def string(self, node: Mapping[str, Any], key: str, path: str = "") -> str:
        return self._checked(node, path, key, "a non-empty string", lambda v: isinstance(v, str) and v != "")

    def boolean(self, node: Mapping[str, Any], key: str, path: str = "") -> bool:
        return self._checked(node, path, key, "true or false", lambda v: isinstance(v, bool))

    def mapping(self, node: Mapping[str, Any], key: str, path: str = "") -> Mapping[str, Any]:
        return self._checked(node, path, key, "a JSON object", lambda v: isinstance(v, Mapping))

    def array(self, node: Mapping[str, Any], key: str, path: str = "", non_empty: bool = True) -> list:
        expected = "a non-empty list" if non_empty else "a list"
        return self._checked(
            node, path, key, expected, lambda v: isinstance(v, list) and (v or not non_empty)
        )

    def items(self, values: list, path: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
        """Each element of a list of objects, with its path, e.g. `arms[2]`."""
        for index, item in enumerate(values):
            where = f"{path}[{index}]"
            if not isinstance(item, Mapping):
                raise self.fail(where, item, "a JSON object")
            yield where, item


def _check_lossless(document: Mapping[str, Any], fields: _Fields) -> None:
    for key in ("engine", "model"):
        fields.string(document, key)
    fields.integer(document, "layers", nullable=True)
    fields.integer(document, "world_size", low=1)
    fields.integer(document, "steps", low=1)
    fields.integer(document, "resume_at")
    fields.integer(document, "seed", low=None)
    for key in (
        "steps_compared",
        "tensors_compared",
        "steps_with_different_loss",
        "steps_with_different_state",
    ):
        fields.integer(document, key)
    for key in ("max_abs_difference", "max_abs_loss_difference"):
        fields.number(document, key, low=0)
    snapshots = fields.mapping(document, "max_abs_difference_at_snapshots")
    for step in snapshots:
        if not str(step).isdigit():
            raise fields.fail("max_abs_difference_at_snapshots", step, "step numbers as keys")
        fields.number(snapshots, step, "max_abs_difference_at_snapshots", low=0)
    fields.integer(document, "first_difference_step", nullable=True)
    tensors = fields.array(document, "first_difference_tensors", non_empty=False)
    if not all(isinstance(name, str) for name in tensors):
        raise fields.fail("first_difference_tensors", tensors, "a list of tensor names")
    fields.integer(document, "bytes_raw")
    fields.integer(document, "bytes_sent")
    fields.number(document, "bytes_saved_fraction", high=1)
    control = fields.mapping(document, "control")
    fields.string(control, "kind", "control")
    fields.integer(control, "steps", "control", low=1)
    fields.boolean(control, "flagged", "control")
    fields.integer(control, "first_difference_step", "control", nullable=True)
    fields.integer(control, "first_difference_tensor_count", "control")
    fields.number(control, "max_abs_difference", "control", low=0)
    fields.number(control, "max_abs_loss_difference", "control", low=0)
    fields.boolean(document, "bit_identical")
    fields.boolean(document, "passed")


def _check_divergence(document: Mapping[str, Any], fields: _Fields) -> None:
    for key in ("engine", "model"):
        fields.string(document, key)
    fields.integer(document, "layers", nullable=True)
    fields.integer(document, "world_size", low=1)
    fields.integer(document, "steps", low=1)
    fields.integer(document, "seed", low=None)
    fields.integer(document, "other_seed", low=None)
    fields.number(document, "lr", low=0)
    fields.integer(document, "held_out_tokens", low=1)
    fields.number(document, "near_tie_margin", low=0, high=1)
    checkpoints = fields.array(document, "checkpoints")
    if not all(_is_integer(step) and step >= 0 for step in checkpoints) or checkpoints != sorted(
        set(checkpoints)
    ):
        raise fields.fail("checkpoints", checkpoints, "ascending distinct step numbers")
    arms = fields.array(document, "arms")
    names: list[str] = []
    for where, arm in fields.items(arms, "arms"):
        name = fields.string(arm, "name", where)
        if name in names:
            raise fields.fail(f"{where}.name", name, "a name no other arm has")
        names.append(name)
        fields.string(arm, "label", where)
        points = fields.array(arm, "points", where)
        steps = []
        for point_where, point in fields.items(points, f"{where}.points"):
            steps.append(fields.integer(point, "step", point_where))
            # KL can round to a hair below 0 for identical inputs (the producer keeps values under -1e-12).
            fields.number(point, "kl", point_where)
            for key in ("top1_agreement", "routing_differ", "near_tie_share"):
                fields.number(point, key, point_where, low=0, high=1)
            fields.number(point, "flip_margin_auc", point_where, low=0, high=1, nullable=True)
            fields.integer(point, "decisions", point_where, low=1)
            for key in VS_SEED_FIELDS:
                fields.number(point, key, point_where, nullable=True)
        if steps != checkpoints:
            raise fields.fail(f"{where}.points[*].step", steps, f"the checkpoints {checkpoints}")
    if SEED_ARM not in names:
        raise fields.fail(
            "arms[*].name", names, f"an arm named '{SEED_ARM}' (the yardstick every arm is compared with)"
        )
    # The near-tie share is the reference run's: every arm must carry the same value at each checkpoint.
    first = arms[0]["points"]
    for index, arm in enumerate(arms[1:], start=1):
        for point_index, (point, reference) in enumerate(zip(arm["points"], first, strict=True)):
            if point["near_tie_share"] != reference["near_tie_share"]:
                raise fields.fail(
                    f"arms[{index}].points[{point_index}].near_tie_share",
                    point["near_tie_share"],
                    f"{reference['near_tie_share']!r} as in arms[0] (it is the reference run's, one per step)",
                )


def _check_sim(document: Mapping[str, Any], fields: _Fields) -> None:
    fields.number(document, "tolerance", low=0, high=1)
    fields.string(document, "held_out_file")
    for where, row in fields.items(fields.array(document, "replay", non_empty=False), "replay"):
        fields.number(row, "error", where)
    for where, row in fields.items(fields.array(document, "held_out"), "held_out"):
        for key in ("cluster", "system", "category"):
            fields.string(row, key, where)
        fields.integer(row, "layers", where, low=1)
        fields.number(row, "measured_s", where, low=0)
        fields.number(row, "predicted_s", where, low=0, nullable=True)  # null: not predicted (basis says why)
        fields.number(row, "error", where, nullable=True)
        fields.number(row, "speedup_error", where, nullable=True)
        if "own_depth_line_miss" in row:  # from 2026-12-06 on
            fields.number(row, "own_depth_line_miss", where, low=0, nullable=True)
        if row.get("critical_path_s") is not None:  # from 2026-12-06 on (null: not predicted)
            paths = fields.mapping(row, "critical_path_s", where)
            for side in ("measured", "predicted"):
                parts = fields.mapping(paths, side, f"{where}.critical_path_s")
                for key in PATH_PARTS:
                    fields.number(parts, key, f"{where}.critical_path_s.{side}", low=0)
    for key in ("replay_mean_abs_error", "replay_max_abs_error"):
        fields.number(document, key, low=0, nullable=True)
    for key in ("held_out_mean_abs_error", "held_out_max_abs_error"):
        fields.number(document, key, low=0, nullable=True)
    by_category = fields.mapping(document, "held_out_mean_abs_error_by_category")
    categories = {row["category"] for row in document["held_out"] if row["error"] is not None}
    for category in sorted(categories):
        fields.number(by_category, category, "held_out_mean_abs_error_by_category", low=0)
    noise = fields.mapping(document, "measurement_noise")
    fields.integer(noise, "timed_iterations_per_run", "measurement_noise", low=1)
    for key in ("iteration_spread_mean", "iteration_spread_max"):
        fields.number(noise, key, "measurement_noise", low=0)
    for key in ("depth_line_residual_mean", "depth_line_residual_max"):
        fields.number(noise, key, "measurement_noise", low=0, nullable=True)
    if "held_out_path_miss_by_category" in document:  # from 2026-12-06 on
        misses = fields.mapping(document, "held_out_path_miss_by_category")
        for category in sorted(misses):
            parts = fields.mapping(misses, category, "held_out_path_miss_by_category")
            for key in PATH_PARTS:
                fields.number(parts, key, f"held_out_path_miss_by_category.{category}")
    if "ciera_verdicts" in document:  # from 2026-12-05 on
        verdicts = fields.array(document, "ciera_verdicts", non_empty=False)
        for where, row in fields.items(verdicts, "ciera_verdicts"):
            for key in ("cluster", "system"):
                fields.string(row, key, where)
            fields.integer(row, "layers", where, low=1)
            for key in ("measured_speedup", "predicted_speedup"):
                fields.number(row, key, where, low=0)
            fields.boolean(row, "same_side", where)
    fields.boolean(document, "passed")


CHECKS = {"lossless": _check_lossless, "divergence": _check_divergence, "sim": _check_sim}


def validate_validation_document(document: object, origin: str) -> ValidationFile:
    """Recognise a `ciera validate … --json` document by its schema and check every field the report
    reads."""
    if not isinstance(document, Mapping):
        raise ReportInputError(f"{origin}: top level is {type(document).__name__}, expected a JSON object")
    schema = document.get("schema")
    if schema not in SCHEMAS:
        hint = f" (a file for {OTHER_OPTIONS[schema]})" if schema in OTHER_OPTIONS else ""
        expected = ", ".join(repr(s) for s in SCHEMAS)
        raise ReportInputError(f"{origin}: field 'schema': {schema!r}, expected one of {expected}{hint}")
    kind = SCHEMAS[schema]
    CHECKS[kind](document, _Fields(origin))
    return ValidationFile(kind, origin, dict(document))


def validate_results(results: ValidationResults) -> ValidationResults:
    """The same checks for results built in Python as for files."""
    return ValidationResults(
        tuple(
            replace(validate_validation_document(f.document, f.origin), shipped=f.shipped)
            for f in results.files
        )
    )


def split_paths(values: Sequence[str] | None) -> list[Path]:
    """`--validation a.json,b.json` and `--validation a.json --validation b.json` alike."""
    return [Path(item.strip()) for value in values or [] for item in value.split(",") if item.strip()]


def shipped_validation() -> ValidationResults:
    """The simulator's check of the shipped measured bundle (SHIPPED_SIM_VALIDATION)."""
    origin = f"{SHIPPED_SIM_VALIDATION.parent.parent.name}/data/{SHIPPED_SIM_VALIDATION.name}"
    checked = validate_validation_document(read_json(SHIPPED_SIM_VALIDATION), origin)
    return ValidationResults((replace(checked, shipped=True),))


def load_validation(paths: Sequence[str | os.PathLike[str]]) -> ValidationResults:
    files = []
    seen: set[Path] = set()
    for path in map(Path, paths):
        resolved = path.resolve()
        if resolved in seen:
            raise ReportInputError(f"--validation: {path} given twice")
        seen.add(resolved)
        files.append(validate_validation_document(read_json(path), str(path)))
    return ValidationResults(tuple(files))


# ---------------------------------------------------------------------------------- what produced it


def _command(words: list[str], options: list[tuple[str, Any]], origin: str) -> str:
    parts = list(words)
    for option, value in options:
        parts += [option, str(value)]
    return shlex.join([*parts, "--json", origin])


def producing_command(result: ValidationFile) -> str:
    """The command line equivalent to the run that wrote this file, from the fields it records."""
    d = result.document
    if result.kind == "lossless":
        return _command(
            ["ciera", "validate", "lossless"],
            [
                ("--engine", d["engine"]),
                ("--steps", d["steps"]),
                ("--world-size", d["world_size"]),
                ("--model", d["model"]),
                ("--layers", d["layers"] or 0),
                ("--seed", d["seed"]),
            ],
            result.origin,
        )
    if result.kind == "divergence":
        return _command(
            ["ciera", "validate", "divergence"],
            [
                ("--engine", d["engine"]),
                ("--steps", d["steps"]),
                ("--checkpoints", len(d["checkpoints"]) - 1 or 1),  # step 0 is always evaluated
                ("--world-size", d["world_size"]),
                ("--model", d["model"]),
                ("--layers", d["layers"] or 0),
                ("--held-out-sequences", d["held_out_tokens"] // HELD_OUT_WINDOW_TOKENS),
                ("--seed", d["seed"]),
            ],
            result.origin,
        )
    return _command(
        ["ciera", "validate", "sim"],
        [
            *([("--bundle", d["bundle"])] if isinstance(d.get("bundle"), str) else []),
            ("--held-out", d["held_out_file"]),
            ("--tolerance", f"{d['tolerance']:g}"),
        ],
        result.origin,
    )


# ------------------------------------------------------------------------------------ derived views


def exactly_zero(arm: Mapping[str, Any], metric: str) -> bool:
    """Every checkpoint of this arm has the metric at exactly 0 (CIERA's expected result)."""
    return all(point[metric] == 0 for point in arm["points"])


def auc_undefined_reason(arm: Mapping[str, Any]) -> str | None:
    """Why an arm has no flip-margin AUC at any checkpoint: the AUC needs both flipped and kept decisions."""
    if any(point["flip_margin_auc"] is not None for point in arm["points"]):
        return None
    if all(point["routing_differ"] == 0 for point in arm["points"]):
        return "no routing decision flipped"
    if all(point["routing_differ"] == 1 for point in arm["points"]):
        return "every routing decision flipped"
    return "never both flipped and kept decisions at one checkpoint"


@dataclass(frozen=True)
class CategoryRow:
    name: str  # what was held out (depth, link, topology), "replay" or "all held-out runs"
    runs: int
    mean_abs_error: float | None
    max_abs_error: float | None
    low_error: float | None  # signed range
    high_error: float | None
    mean_target: float
    max_target: float | None
    not_predicted: int = 0  # held-out runs the simulator could not predict: the category fails

    @property
    def passed(self) -> bool | None:
        if self.not_predicted:
            return False
        if self.mean_abs_error is None:
            return None
        within_mean = self.mean_abs_error <= self.mean_target
        return within_mean and (self.max_target is None or (self.max_abs_error or 0.0) <= self.max_target)


def sim_category_rows(document: Mapping[str, Any]) -> list[CategoryRow]:
    """The replay, each held-out category and all held-out runs: runs, mean and max |error|, the signed
    range, and pass/fail against `ciera validate sim`'s targets (replay 2 %; held out: mean within the
    tolerance, max within twice it)."""
    tolerance = float(document["tolerance"])
    replay_errors = [row["error"] for row in document["replay"]]
    rows = [
        CategoryRow(
            "replay of the seen runs",
            len(replay_errors),
            document.get("replay_mean_abs_error"),
            document.get("replay_max_abs_error"),
            min(replay_errors, default=None),
            max(replay_errors, default=None),
            REPLAY_TARGET,
            None,
        )
    ]
    errors: dict[str, list[float]] = defaultdict(list)
    unpredicted: dict[str, int] = defaultdict(int)
    for row in document["held_out"]:
        if row["error"] is None:
            unpredicted[row["category"]] += 1
        else:
            errors[row["category"]].append(row["error"])
    by_category = document["held_out_mean_abs_error_by_category"]
    for category in dict.fromkeys(row["category"] for row in document["held_out"]):
        values = errors.get(category, [])
        missing = unpredicted.get(category, 0)
        rows.append(
            CategoryRow(
                category + (f" ({missing} not predicted)" if missing else ""),
                len(values) + missing,
                by_category.get(category) if values else None,
                max((abs(v) for v in values), default=None),
                min(values, default=None),
                max(values, default=None),
                tolerance,
                2 * tolerance,
                not_predicted=missing,
            )
        )
    every = [row["error"] for row in document["held_out"] if row["error"] is not None]
    missing = sum(unpredicted.values())
    rows.append(
        CategoryRow(
            "all held-out runs" + (f" ({missing} not predicted)" if missing else ""),
            len(every) + missing,
            document["held_out_mean_abs_error"],
            document["held_out_max_abs_error"],
            min(every, default=None),
            max(every, default=None),
            tolerance,
            2 * tolerance,
            not_predicted=missing,
        )
    )
    return rows
