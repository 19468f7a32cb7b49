"""Model helpers shared by the services (the tiny local model builder)."""
