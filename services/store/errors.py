"""Errors the store maps to gRPC codes: ValueError -> INVALID_ARGUMENT, these -> others."""

from __future__ import annotations


class CapacityError(Exception):
    """A limit that clears with time (backlog, in-flight trajectories): RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, *, reason: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_ms = retry_after_ms


class SizeLimitError(Exception):
    """A message over a configured size: RESOURCE_EXHAUSTED without a retry hint (never retry)."""
