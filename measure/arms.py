"""What makes one training arm differ from the plain run, for `ciera validate lossless` and `divergence`:

- `LossyGather`: ZeRO++-style int8 weight gathers (qwZ) — each gathered shard block-quantised to int8
  with one absmax scale per `QUANTIZATION_GROUP` values, then dequantised: `once` changes one shard of
  the first parameter gather of step 0 on rank 0 (the control that a losslessness check must flag),
  `every` every parameter gather of every step on every rank.
- `nudge_one_weight`: one router weight moved by one ULP of BF16, the precision the engines gather in.
- `state_digest` / `save_state`: every parameter and optimizer state, hashed per tensor (compare at every
  step) or saved whole (compare values at chosen steps).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

QUANTIZATION_GROUP = 2048  # values per int8 scale (ZeRO++'s default group size)


def int8_block_roundtrip(values: torch.Tensor, group: int = QUANTIZATION_GROUP) -> torch.Tensor:
    """`values` quantised to int8 per group of `group` elements (symmetric, absmax / 127) and back, in
    the input's dtype and shape: what a receiver of a qwZ gather computes with."""
    flat = values.detach().reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % group)).view(-1, group)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    restored = (padded / scale).round().clamp(-127, 127) * scale
    return restored.reshape(-1)[: flat.numel()].to(values.dtype).view(values.shape)


class LossyGather:
    """Wraps torch.distributed's single-tensor all-gather (where DeepSpeed's and FSDP2's parameter gathers
    pass) so that, inside a training step, the shard a rank sends is replaced by its int8 round trip."""

    _installed: LossyGather | None = None

    def __init__(self, mode: str, rank: int) -> None:
        self.mode, self.rank = mode, rank
        self.step: int | None = None  # set while a training step runs
        self.applied = 0  # gathers made lossy on this rank

    @classmethod
    def installed(cls, mode: str, rank: int) -> LossyGather:
        if cls._installed is None:
            import torch.distributed as dist
            import torch.distributed.distributed_c10d as c10d

            lossy = cls(mode, rank)
            original = c10d.all_gather_single

            def gather(output_tensor, input_tensor, group=None, async_op=False):
                if lossy._applies(input_tensor):
                    input_tensor = int8_block_roundtrip(input_tensor)
                    lossy.applied += 1
                return original(output_tensor, input_tensor, group, async_op)

            c10d.all_gather_single = gather
            dist.all_gather_single = gather
            cls._installed = lossy
        cls._installed.mode, cls._installed.rank = mode, rank
        return cls._installed

    def _applies(self, tensor: torch.Tensor) -> bool:
        if self.mode == "none" or self.step is None or not tensor.is_floating_point():
            return False
        if self.mode == "every":
            return True
        return self.step == 0 and self.rank == 0 and self.applied == 0  # once

    @contextlib.contextmanager
    def during_step(self, step: int) -> Iterator[None]:
        self.step = step
        try:
            yield
        finally:
            self.step = None


def nudge_one_weight(model: torch.nn.Module) -> dict:
    """Move element 0 of the first router weight one BF16 ULP away from zero (the engines gather BF16, so
    this is the smallest change a gather can carry). The model must not be wrapped yet."""
    for name, param in model.named_parameters():
        if name.endswith("router.weight"):
            with torch.no_grad():
                before = param.view(-1)[:1].clone()
                bits = before.to(torch.bfloat16).view(torch.int16) + 1  # one ULP away from zero
                after = bits.view(torch.bfloat16).float()
                param.view(-1)[:1] = after
            return {"parameter": name, "index": 0, "from": float(before), "to": float(after)}
    raise ValueError("the model has no router weight to nudge (a dense model?)")


def state_digest(state: list[tuple[str, torch.Tensor]]) -> tuple[list[str], dict]:
    """(names, {"all": SHA-256 over every tensor, "tensors": the first 8 hex digits per tensor})."""
    names, short, overall = [], [], hashlib.sha256()
    for name, tensor in state:
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha256(data).hexdigest()
        names.append(name)
        short.append(digest[:8])
        overall.update(name.encode())
        overall.update(digest.encode())
    return names, {"all": overall.hexdigest(), "tensors": short}


def save_state(state: list[tuple[str, torch.Tensor]], path: Path) -> None:
    """Write {name: tensor} atomically (a partial file never carries the final name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        torch.save({name: tensor.detach().cpu().clone() for name, tensor in state}, staging)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
