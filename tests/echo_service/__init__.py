"""The echo service: the shared server scaffolding with no domain, only ``DiagnosticsService`` (which
every service registers). Tests and bench/codec.py start it to exercise the transport, health,
auth and TLS; no deployment runs it, so it lives here, outside the installed package.

Run it from the repository root: ``python -m tests.echo_service [flags]`` (``ServiceProcess`` with
``module=MODULE``; the integration tests' ``start_service("echo")``).
"""

MODULE = "tests.echo_service"
"""What ``python -m`` runs."""
