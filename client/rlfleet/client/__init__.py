"""rlfleet client SDK: typed errors, channels with deadlines and bounded retries.

The high-level ``connect(...)`` client (batches, push_weights, policy_version)
lands with the collector; these building blocks are shared with the services.
"""

from rlfleet.client.channel import ChannelSettings, aio_channel, call_with_retry
from rlfleet.client.errors import RlfleetClientError, from_rpc_error

__all__ = ["ChannelSettings", "RlfleetClientError", "aio_channel", "call_with_retry", "from_rpc_error"]
