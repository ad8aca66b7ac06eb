"""`ciera validate divergence`: how far each kind of gather pushes a top-k MoE off the path of a reference
run (reference/layout-study-method.txt: KL of next-token distributions on held-out tokens, top-1
agreement, routing decisions that differ, near-ties, and whether flipped decisions had small margins).

Arms, each trained from the same data order as the reference (the plain engine, seed `seed`):

- `ciera`: the engine + CIERA (expected: exactly the reference, every metric 0);
- `ulp`: the plain engine with one router weight moved by one BF16 ULP before step 0;
- `int8`: the plain engine with every parameter gather int8 block-quantised (ZeRO++'s qwZ, lossy);
- `seed`: the plain engine with weights drawn from another seed — the yardstick: "as different as a
  new seed" is KL / KL(seed) = 1.

At each checkpoint every arm's weights (BF16, as the engines compute with them) are saved; afterwards both
models run on the same held-out tokens in float32 on CPU (deterministic), and the metrics compare them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .arm_runs import ArmProgress, ProgressCallback, host_description

SCHEMA = "ciera.validate.divergence/1"
NEAR_TIE_MARGIN = 0.01  # of the token's score spread (the method's definition)
ARMS = {
    "ciera": "engine + CIERA (lossless)",
    "ulp": "one router weight moved by 1 BF16 ULP at step 0",
    "int8": "every weight gather int8 block-quantised (ZeRO++ qwZ style, lossy)",
    "seed": "weights from another seed (the yardstick)",
}


@dataclasses.dataclass(frozen=True)
class DivergencePlan:
    engine: str = "zero3"
    steps: int = 200
    checkpoints: int = 4  # evaluated at step 0 and at `checkpoints` evenly spaced steps up to `steps`
    world_size: int = 2
    model: str = "small-moe"
    layers: int | None = None  # None: every block (small-moe: 6)
    width_scale: int | None = None  # None: the zoo's default small scale
    seed: int = 0
    other_seed: int = 1
    lr: float = 1e-4
    held_out_sequences: int = 64
    seq_len: int = 64
    timeout_s: float = 300.0

    def checkpoint_steps(self) -> list[int]:
        count = max(1, min(self.checkpoints, self.steps))
        return sorted({0, *(round(self.steps * (i + 1) / count) for i in range(count))})


# ---------------------------------------------------------------------------------------- metrics


def held_out_tokens(plan: DivergencePlan):
    """The fixed held-out inputs: the first `held_out_sequences` windows of the held-out split."""
    import torch

    from measure.corpus import sample_windows

    rows = sample_windows(0, plan.seq_len, plan.held_out_sequences, seed=0, split="heldout")
    return torch.from_numpy(rows[:, :-1].copy())


def model_outputs(model, weights: dict, tokens, chunk: int = 16) -> dict[str, np.ndarray]:
    """Float32 forward of `model` with `weights` (BF16 tensors by name) on `tokens`: next-token
    log-probabilities (tokens × vocab; the softmax in float64, kept as float32 to hold 16k-token
    vocabularies) and each MoE block's router scores (the values its top-k ranks: softmax probabilities or
    logits) as (layers, tokens, experts)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name].float())
    model.eval()
    routers = [block.moe for block in model.blocks if block.moe is not None]
    captured: list[list] = [[] for _ in routers]
    handles = []
    for index, moe in enumerate(routers):

        def hook(_module, _inputs, output, index=index, moe=moe):
            logits = output.float()
            scores = logits.softmax(dim=-1) if moe.router_score == "softmax" else logits
            captured[index].append(scores.double().numpy())

        handles.append(moe.router.register_forward_hook(hook))
    log_probs = []
    try:
        with torch.no_grad():
            for start in range(0, tokens.shape[0], chunk):
                logits = model(tokens[start : start + chunk]).double()
                log_probs.append(
                    torch.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1]).float().numpy()
                )
    finally:
        for handle in handles:
            handle.remove()
    return {
        "log_probs": np.concatenate(log_probs),
        "router_scores": np.stack([np.concatenate(chunks) for chunks in captured]),
        "top_k": np.array(routers[0].top_k if routers else 0),
    }


def top_k_sets(scores: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest scores per row (ties broken by the lower index, as torch.topk on
    CPU does for equal values)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return np.sort(order, axis=-1)


def margins(scores: np.ndarray, k: int) -> np.ndarray:
    """(k-th best − (k+1)-th best score) / (max − min score) per row: how close a decision is to a swap."""
    ordered = -np.sort(-scores, axis=-1)
    spread = ordered[..., 0] - ordered[..., -1]
    gap = ordered[..., k - 1] - ordered[..., k]
    return np.where(spread > 0, gap / np.where(spread > 0, spread, 1.0), 0.0)


def flip_margin_auc(reference_margins: np.ndarray, flipped: np.ndarray) -> float | None:
    """Probability that a flipped decision had a smaller reference margin than an unflipped one (ties
    count half): 0.5 is no relation, 1.0 means only the closest calls flipped. None without both kinds."""
    flipped = flipped.astype(bool)
    positives, negatives = int(flipped.sum()), int((~flipped).sum())
    if positives == 0 or negatives == 0:
        return None
    ranks = _average_ranks(-reference_margins)  # smaller margin → larger score
    return float((ranks[flipped].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing their average rank (the Mann–Whitney convention)."""
    unique, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def compare_outputs(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict[str, Any]:
    """The layout study's metrics of `other` against `reference` on the same tokens."""
    p_log, q_log = reference["log_probs"], other["log_probs"]
    kl_sum = 0.0
    for start in range(0, len(p_log), 1024):  # float64 per block of rows: a 16k vocabulary is large
        p, q = p_log[start : start + 1024].astype(np.float64), q_log[start : start + 1024].astype(np.float64)
        kl_sum += float(np.sum(np.exp(p) * (p - q)))
    kl = kl_sum / len(p_log)
    top1 = float(np.mean(p_log.argmax(axis=-1) == q_log.argmax(axis=-1)))
    k = int(reference["top_k"])
    ref_scores, other_scores = reference["router_scores"], other["router_scores"]
    flipped = np.any(top_k_sets(ref_scores, k) != top_k_sets(other_scores, k), axis=-1)
    reference_margins = margins(ref_scores, k)
    return {
        "kl": max(kl, 0.0) if kl > -1e-12 else kl,  # rounding can leave -1e-17 for identical inputs
        "top1_agreement": top1,
        "routing_differ": float(flipped.mean()),
        "near_tie_share": float((reference_margins < NEAR_TIE_MARGIN).mean()),
        "flip_margin_auc": flip_margin_auc(reference_margins.reshape(-1), flipped.reshape(-1)),
        "decisions": int(flipped.size),
    }


# ---------------------------------------------------------------------------------------- the arms


def _arm_config(base, arm: str, plan: DivergencePlan):
    changes = {
        "reference": {},
        "ciera": {"ciera": True},
        "ulp": {"nudge_ulp": True},
        "int8": {"lossy_gather": "every"},
        "seed": {"init_seed": plan.other_seed},
    }[arm]
    return dataclasses.replace(base, **changes)


def run_divergence(
    plan: DivergencePlan,
    on_progress: ProgressCallback | None = None,
    work_dir: Path | None = None,
) -> dict[str, Any]:
    """Train the reference and every arm, evaluate them at the checkpoints, return the JSON document."""
    import torch

    from measure.train import TrainConfig, train
    from measure.zoo import build_model

    checkpoints = plan.checkpoint_steps()
    arms = ["reference", *ARMS]
    progress = ArmProgress(plan.steps * len(arms), on_progress)
    losses: dict[str, list[float]] = {}
    nudged = None

    with tempfile.TemporaryDirectory(prefix="ciera-divergence-", dir=work_dir) as scratch:
        root = Path(scratch)
        base = TrainConfig(
            model=plan.model,
            engine=plan.engine,
            ciera=False,
            world_size=plan.world_size,
            steps=plan.steps,
            layers=plan.layers,
            width_scale=plan.width_scale,
            seed=plan.seed,
            lr=plan.lr,
            timeout_s=plan.timeout_s,
            parameter_snapshot_steps=tuple(checkpoints),
        )
        for arm in arms:
            config = dataclasses.replace(_arm_config(base, arm, plan), snapshot_dir=str(root / arm))
            document = train(config, progress.arm(arm))
            losses[arm] = [record["loss"] for record in document["steps"]]
            if arm == "ulp":
                nudged = document["nudged"]
        progress.say("evaluating on held-out tokens")
        torch.manual_seed(0)
        model = build_model(
            plan.model, plan.layers, plan.width_scale, plan.seed, activation_checkpointing=False
        )
        tokens = held_out_tokens(plan)
        from measure.arms import load_state

        points: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for step in checkpoints:
            reference = model_outputs(model, load_state(root / "reference" / f"params-{step}.pt"), tokens)
            for arm in ARMS:
                other = model_outputs(model, load_state(root / arm / f"params-{step}.pt"), tokens)
                points[arm].append({"step": step, **compare_outputs(reference, other)})
    for arm in ARMS:  # each metric as a fraction of the seed arm's at the same step
        for point, seed_point in zip(points[arm], points["seed"], strict=True):
            for key in ("kl", "routing_differ"):
                point[f"{key}_vs_seed"] = point[key] / seed_point[key] if seed_point[key] > 0 else None
            point["top1_disagreement_vs_seed"] = (
                (1 - point["top1_agreement"]) / (1 - seed_point["top1_agreement"])
                if seed_point["top1_agreement"] < 1
                else None
            )
    return {
        "schema": SCHEMA,
        "engine": plan.engine,
        "model": plan.model,
        "layers": plan.layers,
        "width_scale": plan.width_scale,
        "world_size": plan.world_size,
        "steps": plan.steps,
        "seed": plan.seed,
        "other_seed": plan.other_seed,
        "lr": plan.lr,
        "checkpoints": checkpoints,
        "checkpoint_count": plan.checkpoints,
        "held_out_sequences": plan.held_out_sequences,
        "seq_len": plan.seq_len,
        "held_out_tokens": int(tokens.numel()),
        "host": host_description(),
        "near_tie_margin": NEAR_TIE_MARGIN,
        "reference": "the plain engine, same seed and data order",
        "nudged": nudged,
        "arms": [
            {"name": arm, "label": ARMS[arm], "points": points[arm], "losses": losses[arm]} for arm in ARMS
        ],
        "reference_losses": losses["reference"],
    }
