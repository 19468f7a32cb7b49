"""What a run id (or name) may be on the services that several runs share (a generation replica's named
runs, a reward service's KL controllers): it names files, metrics and log lines; and the bound of a
run's weight in a replica's fair share."""

from __future__ import annotations

import re

from rlfleet.services.common.errors import InvalidArgument

RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_SHARE_WEIGHT = 1000.0
"""Largest weight a run may claim in a shared replica's fair share (``GenerateRequest.share_weight``, a
collector's ``share_weight``)."""


def is_run_id(value: str) -> bool:
    """Whether ``value`` is 1 to 128 characters of [A-Za-z0-9._-], other than "." and ".." (it names files)."""
    return bool(RUN_ID.fullmatch(value)) and value not in (".", "..")


def check_run_id(run_id: str, field: str = "run_id") -> None:
    """InvalidArgument naming ``field`` unless ``run_id`` is 1 to 128 characters of [A-Za-z0-9._-]."""
    if not is_run_id(run_id):
        raise InvalidArgument(f"{field} {run_id[:160]!r} is not a run id: 1 to 128 characters of [A-Za-z0-9._-]")
