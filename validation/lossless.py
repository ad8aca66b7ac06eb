"""`ciera validate lossless`: train with the engine + CIERA and with the plain engine, from the same seed on
the same data order, in spawned ranks, and compare the loss and every parameter and optimizer state at
every step. Three arms:

- **reference**: the plain engine, N steps straight through.
- **ciera**: the engine + CIERA, stopped after N/2 steps with a checkpoint, restarted in new processes
  from it and continued to N (the exponent caches start empty again after the restart).
- **control**: the plain engine with one gather made lossy (one shard of step 0's first gather
  int8-quantised, `measure.arms.LossyGather`), which the check must flag.

Every step: the global loss (float32 bits) and a SHA-256 per tensor of every parameter (fp32 master) and
Adam state (`measure.train`'s `record_state`). At the checkpoint step and the last step both arms also save
the full state, and the largest absolute difference is computed from the values. CIERA passes when every
step is bit-identical (so the difference is exactly 0 everywhere) and the control is flagged.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

from .arm_runs import ArmProgress, ProgressCallback, host_description

SCHEMA = "ciera.validate.lossless/1"
CONTROL_STEPS = 3  # enough to show the lossy gather changes the state and the loss that follows


@dataclasses.dataclass(frozen=True)
class LosslessPlan:
    engine: str = "zero3"
    steps: int = 20
    world_size: int = 2
    model: str = "small-moe"
    layers: int | None = None  # None: every block of the model
    width_scale: int | None = None  # None: the zoo's default small scale
    block_size: int = 64  # CIERA's B (a power of two), as `ciera train --block-size`
    seed: int = 0
    lr: float = 1e-4
    timeout_s: float = 300.0

    @property
    def resume_at(self) -> int:
        return max(1, self.steps // 2)


def _compare_steps(reference: dict, other: dict) -> dict[str, Any]:
    """Per-step comparison of two train documents over the steps both recorded."""
    names = reference["state_names"] or []
    if other["state_names"] != names:
        raise ValueError("the two arms recorded different tensors; they are not the same model")
    ref_steps = {record["step"]: record for record in reference["steps"]}
    ref_state = {entry["step"]: entry for entry in reference["state_digests"]}
    compared, first_step, first_tensors, loss_steps_differing, state_steps_differing = 0, None, [], 0, 0
    max_loss_difference = 0.0
    other_state = {entry["step"]: entry for entry in other["state_digests"]}
    for record in other["steps"]:
        step = record["step"]
        if step not in ref_steps or step + 1 not in ref_state or step + 1 not in other_state:
            continue
        compared += 1
        loss_differs = record["loss_bits"] != ref_steps[step]["loss_bits"]
        a, b = other_state[step + 1], ref_state[step + 1]
        state_differs = a["all"] != b["all"]
        max_loss_difference = max(max_loss_difference, abs(record["loss"] - ref_steps[step]["loss"]))
        loss_steps_differing += loss_differs
        state_steps_differing += state_differs
        if (loss_differs or state_differs) and first_step is None:
            first_step = step
            first_tensors = [
                name for name, x, y in zip(names, a["tensors"], b["tensors"], strict=True) if x != y
            ]
    return {
        "steps_compared": compared,
        "tensors_compared": len(names),
        "steps_with_different_loss": loss_steps_differing,
        "steps_with_different_state": state_steps_differing,
        "first_difference_step": first_step,
        "first_difference_tensors": first_tensors[:20],
        "first_difference_tensor_count": len(first_tensors),
        "max_abs_loss_difference": max_loss_difference,
    }


def max_abs_difference(first: Path, second: Path) -> float:
    """Largest |a − b| over every tensor of two saved states (NaN-safe: a NaN on one side is infinite)."""
    import torch

    from measure.arms import load_state

    a, b = load_state(first), load_state(second)
    if a.keys() != b.keys():
        raise ValueError(f"{first} and {second} hold different tensors")
    worst = 0.0
    for name, tensor in a.items():
        difference = (tensor.double() - b[name].double()).abs()
        value = float(torch.nan_to_num(difference, nan=math.inf).max()) if difference.numel() else 0.0
        worst = max(worst, value)
    return worst


def run_lossless(
    plan: LosslessPlan,
    on_progress: ProgressCallback | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Run the three arms and return the `ciera.validate.lossless/1` document."""
    from measure.train import TrainConfig, train

    progress = ArmProgress(plan.steps * 2 + min(CONTROL_STEPS, plan.steps), on_progress)

    with tempfile.TemporaryDirectory(prefix="ciera-lossless-", dir=work_dir) as scratch:
        root = Path(scratch)
        base = TrainConfig(
            model=plan.model,
            engine=plan.engine,
            ciera=False,
            world_size=plan.world_size,
            steps=plan.steps,
            layers=plan.layers,
            width_scale=plan.width_scale,
            block_size=plan.block_size,
            seed=plan.seed,
            lr=plan.lr,
            timeout_s=plan.timeout_s,
            record_state=True,
        )
        half, last = plan.resume_at, plan.steps
        control_steps = min(CONTROL_STEPS, plan.steps)
        reference = train(
            dataclasses.replace(
                base,
                snapshot_dir=str(root / "reference"),
                snapshot_steps=tuple(sorted({control_steps, half, last})),
            ),
            progress.arm("reference"),
        )
        checkpoint = str(root / "checkpoint")
        ciera_first = train(
            dataclasses.replace(
                base,
                ciera=True,
                steps=half,
                save_at=half,
                checkpoint_dir=checkpoint,
                snapshot_dir=str(root / "ciera"),
                snapshot_steps=(half,),
            ),
            progress.arm("ciera"),
        )
        ciera_resumed = (
            train(
                dataclasses.replace(
                    base,
                    ciera=True,
                    resume=True,
                    checkpoint_dir=checkpoint,
                    snapshot_dir=str(root / "ciera"),
                    snapshot_steps=(last,),
                ),
                progress.arm("ciera, resumed"),
            )
            if last > half
            else None
        )
        control = train(
            dataclasses.replace(
                base,
                steps=control_steps,
                lossy_gather="once",
                snapshot_dir=str(root / "control"),
                snapshot_steps=(control_steps,),
            ),
            progress.arm("control (one lossy gather)"),
        )
        control_reference = root / "reference" / f"state-{control_steps}.pt"
        ciera_document = _merge(ciera_first, ciera_resumed)
        ciera_steps = _compare_steps(reference, ciera_document)
        snapshot_differences = {
            step: max_abs_difference(
                root / "reference" / f"state-{step}.pt", root / "ciera" / f"state-{step}.pt"
            )
            for step in sorted({half, last})
        }
        control_steps_compared = _compare_steps(reference, control)
        control_difference = max_abs_difference(
            control_reference, root / "control" / f"state-{control_steps}.pt"
        )

    sent = sum(record["allgather_bytes_sent"] for record in ciera_document["steps"])
    raw = sum(record["raw_bytes"] for record in ciera_document["steps"])
    bit_identical = (
        ciera_steps["steps_compared"] == plan.steps
        and ciera_steps["first_difference_step"] is None
        and all(value == 0.0 for value in snapshot_differences.values())
    )
    flagged = control_steps_compared["first_difference_step"] is not None and control_difference > 0
    return {
        "schema": SCHEMA,
        "engine": plan.engine,
        "model": plan.model,
        "layers": plan.layers,
        "width_scale": plan.width_scale,
        # What CIERA's engine ran with (its CodecConfig), as the CIERA arm reported it.
        "block_size": (ciera_document.get("ciera") or {}).get("block_size"),
        "world_size": plan.world_size,
        "steps": plan.steps,
        "resume_at": half,
        "seed": plan.seed,
        "host": host_description(),
        "steps_compared": ciera_steps["steps_compared"],
        "tensors_compared": ciera_steps["tensors_compared"],
        "max_abs_difference": max(*snapshot_differences.values(), ciera_steps["max_abs_loss_difference"]),
        "max_abs_difference_at_snapshots": {str(step): value for step, value in snapshot_differences.items()},
        "max_abs_loss_difference": ciera_steps["max_abs_loss_difference"],
        "steps_with_different_loss": ciera_steps["steps_with_different_loss"],
        "steps_with_different_state": ciera_steps["steps_with_different_state"],
        "first_difference_step": ciera_steps["first_difference_step"],
        "first_difference_tensors": ciera_steps["first_difference_tensors"],
        "bytes_raw": raw,
        "bytes_sent": sent,
        "bytes_saved_fraction": (1.0 - sent / raw) if raw else 0.0,
        "final_parameter_digest": {
            "reference": reference["parameter_digest"],
            "ciera": ciera_document["parameter_digest"],
        },
        "control": {
            "kind": "plain engine, one shard of step 0's first parameter gather int8-quantised on rank 0",
            "steps": control_steps,
            "flagged": flagged,
            "first_difference_step": control_steps_compared["first_difference_step"],
            "first_difference_tensor_count": control_steps_compared["first_difference_tensor_count"],
            "max_abs_difference": control_difference,
            "max_abs_loss_difference": control_steps_compared["max_abs_loss_difference"],
        },
        "bit_identical": bit_identical,
        "passed": bool(bit_identical and flagged),
    }


def _merge(first: dict, resumed: dict | None) -> dict:
    """One train document for a run that was checkpointed and resumed."""
    if resumed is None:
        return first
    merged = dict(resumed)
    merged["steps"] = first["steps"] + resumed["steps"]
    merged["state_digests"] = first["state_digests"] + resumed["state_digests"]
    return merged
