"""Spec values that are valid but not implemented yet: rejected with a clear message instead of ignored.

Each entry names the field, the value and what works today. Remove an entry when its feature lands.
"""

from __future__ import annotations

from collections.abc import Callable

from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.problems import Problem

# (field path, predicate that is True when the job asks for the missing feature, message)
_Check = tuple[str, Callable[[SeqTrainJob], bool], str]

_UNAVAILABLE: list[_Check] = [
]


def unavailable(job: SeqTrainJob) -> list[Problem]:
    return [Problem(path, msg) for path, wants, msg in _UNAVAILABLE if wants(job)]
