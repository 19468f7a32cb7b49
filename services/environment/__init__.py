"""rlfleet environment service: multi-turn tool-using episodes (the Python sandbox for now)."""
