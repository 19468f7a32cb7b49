"""The batch schema (rlfleet/wire/batch_schema.py) is the contract: the collector's batches match it
key for key, and its renderings (docs, proto comment) are current."""

from __future__ import annotations

import pytest

from rlfleet.services.trajectory.rows import schema_mismatch, schema_of
from rlfleet.wire import encode_tensordict
from rlfleet.wire import batch_schema
from tests.torchrl_batches import ragged_batch


def test_every_key_the_collector_emits_is_documented_with_its_kind_dtype_and_shape():
    # ragged_batch runs the collector's own group_message and the trajectory service's row codec.
    emitted = schema_of(encode_tensordict(ragged_batch(groups=2, group_size=3)))
    documented = batch_schema.row_schema()
    assert schema_mismatch(documented, emitted, "batch") is None, schema_mismatch(documented, emitted, "batch")
    assert schema_mismatch(emitted, documented, "batch") is None


def test_a_key_added_without_documentation_fails_the_check():
    emitted = schema_of(encode_tensordict(ragged_batch(groups=1, group_size=2)))
    fewer = batch_schema.row_schema(tuple(f for f in batch_schema.BATCH_FIELDS if f.key != "kl_mean"))
    assert "kl_mean" in (schema_mismatch(fewer, emitted, "batch") or schema_mismatch(emitted, fewer, "batch") or "")


def test_the_rendered_docs_and_proto_comment_are_current():
    assert batch_schema.main(["batch_schema", "--check"]) == 0, "run scripts/gen-protos and commit"


@pytest.mark.parametrize("field", batch_schema.BATCH_FIELDS, ids=lambda f: f.key)
def test_every_field_is_described(field):
    assert field.kind in ("tensor", "ragged", "strings") and len(field.meaning) > 10
    assert (field.kind == "ragged") == bool(field.over)
