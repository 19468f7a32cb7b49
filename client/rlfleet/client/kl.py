"""The SDK's name for ``rlfleet.kl``, the KL estimators the reward service shares (defined there, below both)."""

from rlfleet.kl import *  # noqa: F401,F403
from rlfleet.kl import __all__  # noqa: F401
