"""Session-wide fixtures shared by unit and integration tests."""

from __future__ import annotations

import pytest

from rlfleet.services.models.tiny import build_tiny_model
from tests.postgres import PostgresServer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The deterministic tiny Qwen2 model + tokenizer, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (Hugging Face), loaded once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))



@pytest.fixture(scope="session")
def postgres():
    """One PostgreSQL server for the session (``tests/postgres.py``): each test takes a fresh database
    with ``postgres.create_database()``. Fails, naming scripts/bootstrap, where the binaries are missing."""
    server = PostgresServer().start()
    yield server
    server.stop()
