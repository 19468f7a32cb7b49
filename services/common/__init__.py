"""Scaffolding shared by every service: server bootstrap, config, errors, metrics."""
