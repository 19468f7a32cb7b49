"""What a run id may be on the services that several runs share (a generation replica's named runs, a
reward service's KL controllers): it names files, metrics and log lines."""

from __future__ import annotations

import re

from rlfleet.services.common.errors import InvalidArgument

RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_run_id(run_id: str, field: str = "run_id") -> None:
    """InvalidArgument naming ``field`` unless ``run_id`` is 1 to 128 characters of [A-Za-z0-9._-]."""
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise InvalidArgument(f"{field} {run_id[:160]!r} is not a run id: 1 to 128 characters of [A-Za-z0-9._-]")
