"""Error details: a message that quotes a huge request field is cut to fit grpc's trailer limit
(16 KiB), so the caller gets the precise status, not RESOURCE_EXHAUSTED "Stream removed"; and an
error about one sample names it typed (``rlfleet.v1.SampleError``), for callers that must not
parse the message."""

from __future__ import annotations

import grpc
import pytest

from rlfleet.client.errors import NotFoundError, from_rpc_error
from rlfleet.services.common.errors import InvalidArgument, NotFound, about_sample
from rlfleet.services.common.interceptors import MAX_DETAILS_BYTES, bounded_details, detail_metadata
from rlfleet.services.reward.functions import RewardFunctions, TaskSpec
from rlfleet.wire.error_details import sample_error_of


def test_short_messages_pass_unchanged():
    assert bounded_details("entries[x]: bad dtype") == "entries[x]: bad dtype"
    at_limit = "a" * MAX_DETAILS_BYTES
    assert bounded_details(at_limit) == at_limit


def test_a_huge_message_keeps_its_head_and_tail_and_says_what_was_cut():
    message = "prompt[0].role: 'robot" + "x" * 12_000_000 + "' is not one of system, user, assistant, tool"
    cut = bounded_details(message)
    assert len(cut.encode()) <= MAX_DETAILS_BYTES
    assert cut.startswith("prompt[0].role: 'robot") and cut.endswith("is not one of system, user, assistant, tool")
    assert "bytes cut ...]" in cut


def test_multibyte_text_is_cut_on_character_boundaries():
    cut = bounded_details("é" * 10_000)
    assert len(cut.encode()) <= MAX_DETAILS_BYTES
    cut.encode().decode()  # valid UTF-8: no half character at either end of the cut


# ------------------------------------------------ typed details: which sample, not parsed from text


def test_an_error_about_a_sample_carries_it_typed_through_status_and_sdk():
    error = about_sample(NotFound, 3, "reward function 'x' is not registered")
    assert str(error) == "sample 3: reward function 'x' is not registered"  # the words are unchanged

    class Status(grpc.RpcError):  # what a failed call raises, as the SDK reads it
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return str(error)

        def trailing_metadata(self):
            return (("other-key", "x"), *detail_metadata(error))

    client_error = from_rpc_error(Status(), "CheckTasks")
    assert isinstance(client_error, NotFoundError)
    assert (client_error.sample_error.sample, client_error.sample_error.description) == (
        3, "reward function 'x' is not registered")


def test_errors_about_no_sample_carry_no_detail_and_a_long_description_is_cut():
    assert detail_metadata(InvalidArgument("tasks has 9 entries")) == ()
    assert detail_metadata(ValueError("a bug")) == ()
    assert sample_error_of(None) is None and sample_error_of((("rlfleet-sample-error-bin", b"\xff"),)) is None
    detail = sample_error_of(detail_metadata(about_sample(InvalidArgument, 0, "x" * 100_000)))
    assert detail.sample == 0 and len(detail.description.encode()) <= MAX_DETAILS_BYTES // 2


def test_the_reward_service_names_the_refused_task_typed():
    functions = RewardFunctions("numeric_match", None, {})
    functions.load()
    for task, status, description in [
        (TaskSpec("no_such_fn"), NotFound, "reward function 'no_such_fn' is not registered"),
        (TaskSpec("numeric_match", None, {"tolerance": "-1"}), InvalidArgument,
         "reward function 'numeric_match': argument tolerance='-1'"),
    ]:
        with pytest.raises(status) as err:
            functions.resolve(task, 2)
        assert err.value.sample == 2 and err.value.description.startswith(description)
        assert str(err.value) == f"sample 2: {err.value.description}"
