"""rlfleet services: generation, reference, reward, trajectory, collector."""
