"""An error message that quotes a huge request field is cut to fit grpc's trailer limit (16 KiB):
the caller gets the precise status, not RESOURCE_EXHAUSTED "Stream removed"."""

from __future__ import annotations

from rlfleet.services.common.interceptors import MAX_DETAILS_BYTES, bounded_details


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
