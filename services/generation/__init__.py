"""rlfleet generation service."""
