"""A generation replica's lifecycle has one owner: ``ReplicaState.move_to`` along its transitions; the engine
and the weight swaps read the state and ask for moves."""

import pytest

from rlfleet.services.common.errors import FailedPrecondition
from rlfleet.services.generation.status import EngineState, ReplicaState

S = EngineState


def replica_at(*path: EngineState) -> ReplicaState:
    replica = ReplicaState(policy_version=0, max_model_len=64)
    for state in path:
        replica.move_to(state)
    return replica


def test_a_replica_starts_serves_swaps_fails_and_comes_back_with_a_push():
    replica = replica_at(S.STARTING, S.SERVING, S.SWAPPING, S.SERVING)
    assert replica.ready
    replica.move_to(S.FAILED)
    assert not replica.ready
    replica.move_to(S.SWAPPING)  # a FAILED replica takes pushes: one that applies serves again
    replica.move_to(S.SERVING)
    replica.move_to(S.STOPPED)
    replica.move_to(S.STOPPED)  # a second shutdown is no move
    assert replica.state is S.STOPPED


@pytest.mark.parametrize("path,to", [
    ((), S.SERVING),  # never started
    ((), S.SWAPPING),
    ((), S.FAILED),
    ((S.STARTING,), S.SWAPPING),  # a push before the engine serves
    ((S.STARTING, S.SERVING), S.STARTING),  # started twice
    ((S.STARTING, S.SERVING, S.STOPPED), S.SERVING),  # a swap ending after the shutdown
])
def test_a_move_the_lifecycle_does_not_make_is_refused_naming_both_states(path, to):
    replica = replica_at(*path)
    before = replica.state
    with pytest.raises(FailedPrecondition, match=f"is {before.value}, cannot become {to.value}"):
        replica.move_to(to)
    assert replica.state is before


def test_the_state_is_read_only_outside_the_owner():
    replica = replica_at()
    with pytest.raises(AttributeError):
        replica.state = S.SERVING
