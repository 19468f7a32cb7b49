"""The one error type of the wire codec."""

from __future__ import annotations


class WireError(ValueError):
    """A message does not decode to a valid tensor; ``field`` names where.

    ``field`` is a dotted path into the message (``"entries[tokens].ragged.lengths[2]"``)
    so a server can answer INVALID_ARGUMENT with a message a user can act on.
    """

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def prefixed(self, prefix: str) -> "WireError":
        """The same error with ``prefix`` prepended to the field path."""
        joined = f"{prefix}.{self.field}" if self.field else prefix
        return WireError(joined, self.problem)
