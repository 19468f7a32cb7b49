"""rlfleet echo service."""
