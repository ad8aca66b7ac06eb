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
