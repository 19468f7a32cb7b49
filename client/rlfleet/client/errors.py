"""The SDK's name for ``rlfleet.rpc.errors``, which the services share (defined there, below both)."""

from rlfleet.rpc.errors import *  # noqa: F401,F403
from rlfleet.rpc.errors import __all__  # noqa: F401
