"""Trajectories whose every value derives from their id, and the checks that they came back intact.

Shared by the trajectory store's unit tests, the trajectory service's integration tests and the fuzz suite.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from rlfleet.services.trajectory.rows import split_units
from rlfleet.v1 import tensor_pb2
from rlfleet.wire import Ragged, decode_tensor, decode_tensordict, encode_tensordict, get_ragged


def make_trajectories(group_ids, first_id: int = 0, policy_version: int = 0,
                      group_size: bool = False, prompt_ids: bool = False) -> tensor_pb2.TensorDict:
    """Trajectories in the TorchRL-style layout: row i is "traj-<first_id + i>".

    Lengths and values derive from the id, so any row can be checked after a round trip.
    ``prompt_ids`` adds a ``prompt_id`` column: "prompt-<group_id>".
    """
    count = len(group_ids)
    ids = range(first_id, first_id + count)
    prompt = Ragged.from_list([torch.arange(i % 3 + 1, dtype=torch.int64) + i for i in ids])
    response = Ragged.from_list([torch.arange(i % 4, dtype=torch.int64) + 100 * i for i in ids])  # some empty
    behaviour = Ragged.from_list([torch.full((i % 4,), -0.5 * i) for i in ids])
    td = TensorDict({
        "tokens": TensorDict({"prompt": prompt.to_nested(), "response": response.to_nested()}, batch_size=[count]),
        "log_probs": TensorDict({"response": behaviour.to_nested()}, batch_size=[count]),
        "score": torch.tensor([float(i) for i in ids]),
        "next": TensorDict({"done": torch.tensor([[i % 2 == 0] for i in ids])}, batch_size=[count]),
        "sampling": TensorDict({"temperature": torch.full((count,), 0.7)}, batch_size=[count]),
        "group_id": torch.tensor(list(group_ids), dtype=torch.int64),
        "policy_version_start": torch.full((count,), policy_version, dtype=torch.int64),
        "policy_version_end": torch.full((count,), policy_version, dtype=torch.int64),
    }, batch_size=[count])
    if group_size:
        td["group_size"] = torch.tensor([list(group_ids).count(g) for g in group_ids], dtype=torch.int64)
    td["trajectory_id"] = NonTensorStack.from_list([f"traj-{i}" for i in ids])
    if prompt_ids:
        td["prompt_id"] = NonTensorStack.from_list([f"prompt-{g}" for g in group_ids])
    return encode_tensordict(td)


def payload_bytes(msg: tensor_pb2.TensorDict) -> int:
    """What the store counts against capacity_bytes for ``msg``: each group's rows, serialized."""
    group_ids = decode_tensor(msg.entries["group_id"].tensor).tolist()
    units: dict[int, list[int]] = {}
    for i, group_id in enumerate(group_ids):
        units.setdefault(group_id, []).append(i)
    return sum(map(len, split_units(msg, list(units.values()))))


def groups(first_group: int, n_groups: int, group_size: int) -> list[int]:
    """Group ids of ``n_groups`` groups of ``group_size`` rows, numbered from ``first_group``."""
    return [g for g in range(first_group, first_group + n_groups) for _ in range(group_size)]


def trajectory_ids(batch: tensor_pb2.TensorDict) -> list[str]:
    """The rows' "traj-<n>" ids, in batch order."""
    return list(batch.entries["trajectory_id"].strings.values)


def check_rows(batch: tensor_pb2.TensorDict) -> None:
    """Every entry of every row is what make_trajectories built for that id."""
    td = decode_tensordict(batch)
    ids = [int(t.split("-")[1]) for t in list(td["trajectory_id"])]
    for key, expected in [
        (("tokens", "prompt"), [torch.arange(i % 3 + 1) + i for i in ids]),
        (("tokens", "response"), [torch.arange(i % 4) + 100 * i for i in ids]),
        (("log_probs", "response"), [torch.full((i % 4,), -0.5 * i) for i in ids]),
    ]:
        got = get_ragged(td, key).to_list()
        assert len(got) == len(ids)
        for have, want in zip(got, expected):
            assert torch.equal(have, want.to(have.dtype)), key
    assert td["score"].tolist() == [float(i) for i in ids]
    assert td["next", "done"].tolist() == [[i % 2 == 0] for i in ids]
    assert td["sampling", "temperature"].shape == (len(ids),)
