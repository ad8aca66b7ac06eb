"""Errors raised by the runtime. Payload errors always name the shard and the source rank."""

from __future__ import annotations


class CieraError(Exception):
    """Base class of every error this package raises on purpose."""


class BackendUnavailableError(CieraError, RuntimeError):
    """A codec backend was requested that this machine or build cannot provide."""


class PayloadError(CieraError, ValueError):
    """A received payload cannot be decoded into correct weights (corrupt, truncated, foreign)."""

    def __init__(self, shard_id: int, source_rank: int, reason: str) -> None:
        super().__init__(f"shard {shard_id} from rank {source_rank}: {reason}")
        self.shard_id = shard_id
        self.source_rank = source_rank
        self.reason = reason


class OutOfStepError(PayloadError):
    """The receiver's exponent cache is not at the generation the payload's delta was made against."""


class ChecksumMismatchError(PayloadError):
    """Verify mode: the rebuilt shard does not match the checksum the sender computed."""


class StalePayloadError(PayloadError):
    """A payload older than what the cache already reflects (replayed, delayed, or from a retired epoch)."""


class GatherError(CieraError, RuntimeError):
    """A compressed all-gather failed. Raised on every rank of the group with the same message, naming
    the shard and, per rank, what that rank found (``failures``: rank -> reason)."""

    def __init__(self, shard_id: int | None, failures: dict[int, str], summary: str = "") -> None:
        self.shard_id = shard_id
        self.failures = dict(sorted(failures.items()))
        shard = f"shard {shard_id}" if shard_id is not None else "all-gather"
        parts = "; ".join(f"rank {rank}: {reason}" for rank, reason in self.failures.items())
        super().__init__(f"{shard}: {summary}{': ' if summary and parts else ''}{parts}")


class ConfigMismatchError(GatherError):
    """Ranks disagree on what is being gathered or how (shard, mode, dtype, numel, codec settings)."""


class GatherTimeoutError(GatherError):
    """A round of the gather did not complete within the engine's timeout (a rank never arrived)."""


class SelectionMismatchError(CieraError, RuntimeError):
    """An engine plug-in's first gather of a parameter group does not have the size, dtype or process
    group that benefit-driven selection was decided for at enable time (the model changed in between).
    Raised on every rank alike (the sizes are the same on every rank), before any collective."""
