"""Each wire record is defined once (rlfleet.client.results) and read from its message by field name."""

from __future__ import annotations

import dataclasses

import pytest

from rlfleet.client.results import (BufferStats, DroppedStale, DynamicSamplingStatus, PromptFailure,
                                    RollingUpdateStatus, from_message, to_message)
from rlfleet.v1 import collector_pb2, trajectory_pb2

RECORDS = [
    (BufferStats, trajectory_pb2.GetStatsResponse),
    (DroppedStale, trajectory_pb2.DropStaleResponse),
    (PromptFailure, collector_pb2.PromptFailure),
    (DynamicSamplingStatus, collector_pb2.DynamicSamplingStatus),
    (RollingUpdateStatus, collector_pb2.RollingUpdateStatus),
]


@pytest.mark.parametrize(("record", "message"), RECORDS, ids=[record.__name__ for record, _ in RECORDS])
def test_a_record_has_exactly_its_messages_fields(record, message):
    assert {item.name for item in dataclasses.fields(record)} == set(message.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize(("record", "message"), RECORDS, ids=[record.__name__ for record, _ in RECORDS])
def test_every_field_round_trips_by_name(record, message):
    """Distinct values per field: a field read from its neighbour's slot would show."""
    values = {}
    for number, descriptor in enumerate(message.DESCRIPTOR.fields, start=2):
        if descriptor.is_repeated:
            values[descriptor.name] = (f"v{number}",) if descriptor.type == descriptor.TYPE_STRING else (number,)
        elif descriptor.type == descriptor.TYPE_BOOL:
            values[descriptor.name] = number % 2 == 0
        elif descriptor.type == descriptor.TYPE_STRING:
            values[descriptor.name] = f"v{number}"
        elif descriptor.type in (descriptor.TYPE_DOUBLE, descriptor.TYPE_FLOAT):
            values[descriptor.name] = number + 0.5
        else:
            values[descriptor.name] = number
    built = record(**values)

    assert from_message(record, to_message(built, message)) == built
    assert record.from_proto(message(**values)) == built


def test_unset_oversampling_reads_as_one():
    assert DynamicSamplingStatus.from_proto(collector_pb2.DynamicSamplingStatus(enabled=True)).oversampling == 1.0
