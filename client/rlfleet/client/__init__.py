"""rlfleet client SDK."""
