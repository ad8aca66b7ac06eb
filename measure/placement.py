"""Where a rank of `ciera train` / `ciera measure` runs: its device and its process group's backend, and
what that machine is (the environment record every result carries).

One rule for every rank: CUDA available → ``cuda:<LOCAL_RANK>`` with NCCL; no CUDA → the CPU with gloo.
``CIERA_TRAIN_BACKEND`` overrides it: ``gloo`` keeps the ranks on the CPU on a CUDA machine, ``nccl``
insists on CUDA (an error when there is none), ``auto`` (or unset) is the rule. The choice is said on the
console in one line (`Placement.note`), never made silently.

`choose_placement` is the decision alone (no torch: CPU tests check the CUDA branch's choice with it);
`place_rank` applies it to this process (`torch.cuda.set_device`) and remembers it (`current`), and
`init_group` forms the process group on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from .train import TrainError

BACKEND_ENV = "CIERA_TRAIN_BACKEND"
BACKEND_REQUESTS = ("auto", "gloo", "nccl")


class PlacementError(TrainError):
    """A rank that cannot be placed as asked (bad CIERA_TRAIN_BACKEND or LOCAL_RANK, no such GPU): one line."""


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:<index>"
    backend: str  # the process group's: "gloo" or "nccl"
    local_rank: int
    reason: str  # why this placement, for the console note

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_type(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def ds_accelerator(self) -> str:
        """DeepSpeed's DS_ACCELERATOR for this placement."""
        return self.device_type

    def note(self) -> str:
        """The one console line that says where the ranks run."""
        if self.cuda:
            return (
                f"ranks placed on CUDA with nccl, local rank r on cuda:r ({self.reason}; "
                f"{BACKEND_ENV}=gloo keeps them on the CPU)"
            )
        return f"ranks placed on the CPU with gloo ({self.reason})"


CPU_PLACEMENT = Placement("cpu", "gloo", 0, "never placed: the CPU")


def backend_request(env: Mapping[str, str]) -> str:
    """CIERA_TRAIN_BACKEND's value (unset or empty: auto), or a one-line PlacementError."""
    value = env.get(BACKEND_ENV, "").strip()
    if value == "":
        return "auto"
    if value not in BACKEND_REQUESTS:
        raise PlacementError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(BACKEND_REQUESTS)}")
    return value


def local_rank_of(env: Mapping[str, str], default: int = 0) -> int:
    """LOCAL_RANK (set by torchrun, the deepspeed launcher and `ciera train`'s spawned ranks)."""
    value = env.get("LOCAL_RANK")
    if value is None:
        return default
    try:
        local_rank = int(value)
    except ValueError:
        local_rank = -1
    if local_rank < 0:
        raise PlacementError(f"LOCAL_RANK={value!r}: expected an integer >= 0")
    return local_rank


def choose_placement(
    cuda_available: bool, local_rank: int, env: Mapping[str, str], cuda_devices: int = 0
) -> Placement:
    """The placement of the rank with this ``local_rank`` (one rank per GPU) on a node with ``cuda_devices``
    visible GPUs; ``env`` gives CIERA_TRAIN_BACKEND."""
    request = backend_request(env)
    if request == "gloo":
        return Placement("cpu", "gloo", local_rank, f"{BACKEND_ENV}=gloo")
    if not cuda_available:
        if request == "nccl":
            raise PlacementError(
                f"{BACKEND_ENV}=nccl, but CUDA is not available here: expected a CUDA build of torch and a "
                "visible GPU, or gloo / auto"
            )
        return Placement("cpu", "gloo", local_rank, "no CUDA device")
    if local_rank >= cuda_devices:
        raise PlacementError(
            f"LOCAL_RANK={local_rank}, but this node has {cuda_devices} visible CUDA device(s): expected one "
            f"rank per GPU (at most {cuda_devices} ranks on this node)"
        )
    return Placement(f"cuda:{local_rank}", "nccl", local_rank, f"CUDA available: {cuda_devices} device(s)")


_current: Placement | None = None


def place_rank(env: Mapping[str, str] | None = None) -> Placement:
    """Decide this process's placement (LOCAL_RANK from the environment), select its GPU, remember it; for
    this process's own environment (``env`` None) also set DeepSpeed's DS_ACCELERATOR to match it."""
    import torch

    global _current
    applied = env is None
    env = os.environ if env is None else env
    available = torch.cuda.is_available()
    placement = choose_placement(
        available, local_rank_of(env), env, torch.cuda.device_count() if available else 0
    )
    accelerator = check_ds_accelerator(placement, env)
    if applied:
        os.environ["DS_ACCELERATOR"] = accelerator
    if placement.cuda:
        torch.cuda.set_device(placement.device)
    _current = placement
    return placement


def current() -> Placement:
    """This process's placement (`place_rank`), or the CPU if it was never placed (tests that form a gloo
    group themselves)."""
    return _current or CPU_PLACEMENT


def check_ds_accelerator(placement: Placement, env: Mapping[str, str]) -> str:
    """DS_ACCELERATOR for this placement; a one-line PlacementError when the environment sets another."""
    wanted = placement.ds_accelerator
    given = env.get("DS_ACCELERATOR")
    if given not in (None, "", wanted):
        raise PlacementError(
            f"DS_ACCELERATOR={given!r}, but the ranks are placed on {placement.device_type}: expected "
            f"{wanted!r} or unset ({BACKEND_ENV}=gloo places them on the CPU)"
        )
    return wanted


def quiet_engine_deprecations() -> None:
    """Silence, in this process, the FutureWarning torch 2.13 prints for the `torch.distributed` APIs that
    DeepSpeed and FSDP2 call (`all_gather_into_tensor`, `reduce_scatter_tensor`): it repeats on every rank
    and step, names nothing a user of these commands can act on, and buries their output. Only that
    message is filtered; every other warning still prints."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )


def init_group(placement: Placement, rank: int, world_size: int, timeout_s: float) -> None:
    """Form the default process group on ``placement`` (NCCL bound to this rank's GPU), in a process
    whose engines' deprecated collectives no longer warn (`quiet_engine_deprecations`): every rank of
    `ciera train`, `ciera measure` (spawned or under a launcher) and `benchmarks/train_step.py` forms it here."""
    import torch
    import torch.distributed as dist

    quiet_engine_deprecations()
    device_id = torch.device(placement.device) if placement.cuda else None
    dist.init_process_group(
        placement.backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device_id,
    )


# ---------------------------------------------------------------------------------------- environment


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_cores() -> int:
    """The cores this process may use (ranks sharing them run slower than one rank per core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def driver_version() -> str:
    """The NVIDIA driver's version: from the kernel module (Linux), else pynvml, else 'unknown (why)'."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    try:
        import pynvml
    except ImportError:
        return "unknown (no /proc/driver/nvidia/version, pynvml not installed)"
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as error:  # noqa: BLE001 — the record says why instead of failing the run
        return f"unknown (pynvml: {type(error).__name__})"


def nccl_version() -> str:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as error:  # noqa: BLE001 — a torch built without NCCL
        return f"unknown ({type(error).__name__})"
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    major, minor, patch = version // 1000, (version % 1000) // 100, version % 100  # older int form
    return f"{major}.{minor}.{patch}"


def environment_record(placement: Placement | None = None, env: Mapping[str, str] | None = None) -> dict:
    """What this rank runs on: placement, device name, driver, CUDA runtime and NCCL versions, GPUs per
    node (visible devices, and the launcher's LOCAL_WORLD_SIZE), CPU model and cores. Off CUDA the CUDA
    fields say 'no CUDA' and gpus_per_node is 0."""
    import torch

    placement = placement or current()
    env = os.environ if env is None else env
    local_world = env.get("LOCAL_WORLD_SIZE")
    record: dict[str, Any] = {
        "device": placement.device,
        "backend": placement.backend,
        "cpu_model": cpu_model(),
        "cpu_cores": cpu_cores(),
        "local_world_size": int(local_world) if local_world and local_world.isdigit() else None,
        "torch_cuda": torch.version.cuda or "no CUDA in this torch build",
    }
    if placement.cuda:
        index = int(placement.device.split(":", 1)[1])
        record |= {
            "device_name": torch.cuda.get_device_name(index),
            "driver": driver_version(),
            "nccl": nccl_version(),
            "gpus_per_node": torch.cuda.device_count(),
        }
    else:
        reason = "no CUDA" if not torch.cuda.is_available() else f"no CUDA ({placement.reason})"
        record |= {
            "device_name": f"cpu: {record['cpu_model']}",
            "driver": reason,
            "nccl": reason,
            "gpus_per_node": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        }
    return record
