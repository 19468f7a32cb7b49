"""rlfleet trajectory service."""
