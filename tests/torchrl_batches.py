"""Ragged batches exactly as a trainer receives them: the collector's own ``group_message``
over generation/reward replies, through the wire codec (encode -> bytes -> decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlfleet.services.collector.episode_runner import group_of_episodes
from rlfleet.services.collector.trajectories import GroupSamples, group_message
from rlfleet.services.trajectory.rows import concat_rows, split_rows
from rlfleet.v1 import generation_pb2, reward_pb2, sampling_pb2, tensor_pb2
from rlfleet.wire import Ragged, decode_tensordict, encode_ragged, encode_tensor


def ragged_batch(*, groups: int = 2, group_size: int = 3, vocab: int = 100, seed: int = 0,
                 behaviour=None, temperature: float = 1.0) -> TensorDict:
    """``groups`` GRPO groups of ``group_size`` samples. ``behaviour(prompt, response)`` gives the
    behaviour log-probs of one sample (default: random negatives)."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for group in range(groups):
        prompt = torch.randint(1, vocab, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
        samples, refs, scores, rewards, kls = [], [], [], [], []
        for index in range(group_size):
            length = int(torch.randint(2, 6, (1,), generator=generator))
            response = torch.randint(1, vocab, (length,), generator=generator)
            lp = behaviour(prompt, response) if behaviour else -torch.rand(length, generator=generator) - 0.1
            samples.append(generation_pb2.GenerateResponse(
                sample_index=index, prompt_token_ids=encode_tensor(prompt), response_token_ids=encode_tensor(response),
                behavior_log_probs=encode_tensor(lp.float()), finish_reason=sampling_pb2.FINISH_REASON_STOP,
                policy_version_start=3, policy_version_end=4,
                sampling=sampling_pb2.SamplingParams(temperature=temperature, top_p=1.0, max_tokens=8),
                timing=generation_pb2.SampleTiming(total_seconds=0.5)))
            refs.append(lp.float() - 0.05)
            scores.append(float(torch.rand(1, generator=generator)))
            rewards.append(torch.zeros(length))
            rewards[-1][-1] = scores[-1]
            kls.append(torch.full((length,), 0.05))
        score = torch.tensor(scores)
        advantage = (score - score.mean()) / (score.std() + 1e-6)
        reply = reward_pb2.ComputeRewardsResponse(
            kl=encode_ragged(Ragged.from_list(kls)), rewards=encode_ragged(Ragged.from_list(rewards)),
            scores=encode_tensor(score), clipped_scores=encode_tensor(score), advantages=encode_tensor(advantage),
            kl_mean=encode_tensor(torch.full((group_size,), 0.05)), kl_coef=0.1)
        parts.append(group_message(group=GroupSamples.decode(samples), ref_log_probs=encode_ragged(refs),
                                   rewards=reply, group_id=100 + group, prompt_id=f"p{group}",
                                   query=f"question {group}",
                                   task=reward_pb2.Task(reward_fn="numeric_match", ground_truth=str(group))))
    # As the trajectory service does: rows stored one by one, a batch concatenated from them.
    rows = [row for message in parts for row in split_rows(message)]
    return decode_tensordict(tensor_pb2.TensorDict.FromString(concat_rows(rows).SerializeToString()))


def episode_batch(*, group_size: int = 3, turns: int = 3, vocab: int = 100, seed: int = 0,
                  behaviour=None) -> TensorDict:
    """One group of ``group_size`` multi-turn episodes (the collector's ``group_of_episodes``):
    ``turns`` sampled turns with observation tokens between them. ``behaviour(history, sampled)``
    gives a turn's behaviour log-probs (default: random negatives)."""
    from rlfleet.services.collector.episode_runner import Episode, SampledTurn

    generator = torch.Generator().manual_seed(seed)
    episodes = []
    for _ in range(group_size):
        prompt = torch.randint(1, vocab, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
        episode = Episode(prompt, reward=float(torch.rand(1, generator=generator)), done=True)
        for turn in range(turns):
            sampled = torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=generator)),),
                                    generator=generator)
            history = episode.history()
            lp = behaviour(history, sampled) if behaviour else -torch.rand(len(sampled), generator=generator) - 0.1
            episode.turns.append(SampledTurn(sampled, lp.float(), torch.full((len(sampled),), turn), turn, turn, 0.1,
                                      sampling_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8)))
            if turn < turns - 1:
                episode.turns[-1].observation = torch.randint(1, vocab, (3,), generator=generator)
        episodes.append(episode)
    group = group_of_episodes(episodes)
    responses = group.responses.to_list()
    score = torch.tensor(group.environment_rewards)
    advantage = (score - score.mean()) / (score.std() + 1e-6)
    mask = group.response_mask.to_list()
    kls = [torch.where(m, 0.05, 0.0) for m in mask]
    rewards = [torch.zeros(len(r)) for r in responses]
    for reward, s in zip(rewards, score.tolist()):
        reward[-1] = s
    reply = reward_pb2.ComputeRewardsResponse(
        kl=encode_ragged(Ragged.from_list(kls)), rewards=encode_ragged(Ragged.from_list(rewards)),
        scores=encode_tensor(score), clipped_scores=encode_tensor(score), advantages=encode_tensor(advantage),
        kl_mean=encode_tensor(torch.full((group_size,), 0.05)), kl_coef=0.1)
    refs = [torch.where(m, b - 0.05, -1.0) for m, b in zip(mask, group.behavior_log_probs.to_list())]
    message = group_message(group=group, ref_log_probs=encode_ragged(Ragged.from_list(refs)), rewards=reply,
                            group_id=7, prompt_id="episode", query="")
    rows = split_rows(message)
    return decode_tensordict(tensor_pb2.TensorDict.FromString(concat_rows(rows).SerializeToString()))


# --- stand-ins for the SDK's answers, for unit tests of the adapters' logic above the client ----------------
@dataclass
class Pushed:
    """What ``Client.push_weights`` answers: the committed version."""

    version: int


@dataclass
class FakeBatch:
    """A batch as the SDK's batch stream yields it: its TensorDict and whether it was delivered before."""

    td: TensorDict
    redelivered: bool = False

    def __len__(self):
        return int(self.td.batch_size[0])
