"""The rollout viewer: a read-only web page over the trajectory store's sample log and the collector."""
