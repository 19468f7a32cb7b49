"""rlfleet collector service."""
