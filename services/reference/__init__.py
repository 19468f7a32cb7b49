"""rlfleet reference service."""
