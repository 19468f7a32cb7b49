"""queue_poll: vLLM's shared-memory queue readers sleep instead of spinning when the generation service asks."""

from __future__ import annotations

import time

import pytest

from rlfleet.services.generation import queue_poll
from rlfleet.services.generation.config import GenerationEngineConfig

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


@pytest.fixture
def vllm_yield(monkeypatch):
    """vLLM's own wait, restored after the test whatever install() did to it."""
    original = shm_broadcast.sched_yield
    monkeypatch.setattr(shm_broadcast, "sched_yield", original)
    return original


def test_resolve_defaults_to_a_sleep_on_cpu_only():
    assert queue_poll.resolve(None, on_cpu=True) == queue_poll.CPU_DEFAULT_US == 20
    assert queue_poll.resolve(None, on_cpu=False) == 0
    assert queue_poll.resolve(0, on_cpu=True) == 0
    assert queue_poll.resolve(250, on_cpu=False) == 250


def test_config_refuses_a_negative_interval():
    with pytest.raises(ValueError, match="queue_poll_us"):
        GenerationEngineConfig(model="m", queue_poll_us=-1)


@pytest.mark.parametrize("raw", ["0", "", "  "])
def test_unset_or_zero_keeps_vllms_spin(monkeypatch, vllm_yield, raw):
    monkeypatch.setenv(queue_poll.ENV, raw)
    assert queue_poll.install() is False
    assert shm_broadcast.sched_yield is vllm_yield


def test_absent_variable_keeps_vllms_spin(monkeypatch, vllm_yield):
    monkeypatch.delenv(queue_poll.ENV, raising=False)
    assert queue_poll.install() is False
    assert shm_broadcast.sched_yield is vllm_yield


@pytest.mark.parametrize("raw", ["fast", "1.5", "-3"])
def test_a_malformed_interval_is_refused_naming_the_variable(monkeypatch, vllm_yield, raw):
    monkeypatch.setenv(queue_poll.ENV, raw)
    with pytest.raises(ValueError, match=queue_poll.ENV):
        queue_poll.install()
    assert shm_broadcast.sched_yield is vllm_yield


def test_install_replaces_the_yield_with_a_sleep_of_the_interval(monkeypatch, vllm_yield):
    monkeypatch.setenv(queue_poll.ENV, "2000")
    assert queue_poll.install() is True
    nap = shm_broadcast.sched_yield
    assert nap is not vllm_yield and nap.rlfleet_poll_us == 2000
    started = time.monotonic()
    nap()
    assert time.monotonic() - started >= 0.002  # a sleep lasts at least what it asks for
    assert queue_poll.install() is True  # a second load of the plugin changes nothing
    assert shm_broadcast.sched_yield is nap


def test_the_spin_condition_waits_through_the_replaced_yield(monkeypatch, vllm_yield):
    """SpinCondition.wait (a reader that read within its busy-loop window) calls the module's
    sched_yield: the name install() replaces is the one vLLM's readers call."""
    calls = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: calls.append(1))
    condition = shm_broadcast.SpinCondition.__new__(shm_broadcast.SpinCondition)
    condition.is_reader = True
    condition.busy_loop_s = 60.0
    condition.last_read = time.monotonic()
    condition.wait(timeout_ms=1)
    assert calls == [1]
