"""rlfleet reward service."""
