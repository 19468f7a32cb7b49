"""Generators of the docs site's reference and benchmark pages (``scripts/gen-docs``).

Each generator is a function returning ``{path relative to docs/: text}``; ``scripts/gen-docs``
writes them, ``scripts/gen-docs --check`` fails when a committed page differs from what the code
says now (a setting, an RPC, a console script or a result file changed without its page).
"""
