"""The SDK's name for ``rlfleet.rpc.records``, which the services share (defined there, below both)."""

from rlfleet.rpc.records import *  # noqa: F401,F403
from rlfleet.rpc.records import __all__  # noqa: F401
