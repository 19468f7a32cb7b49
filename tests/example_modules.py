"""Importing the example programs of examples/ in tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def import_example(name: str):
    """The module ``examples/<name>.py`` (examples/ is not a package: put on sys.path just for the import)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))
