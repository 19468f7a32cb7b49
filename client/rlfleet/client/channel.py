"""The SDK's name for ``rlfleet.rpc.channel``, which the services share (defined there, below both)."""

from rlfleet.rpc.channel import *  # noqa: F401,F403
from rlfleet.rpc.channel import __all__  # noqa: F401
