"""Errors shared by the fake's modules."""

from __future__ import annotations


def bad_request(message: str) -> Exception:
    from .store import ApiError

    return ApiError(400, "BadRequest", message)
