"""EnvironmentService gRPC adapter: decode each request once, call ``Episodes``, pack the reply."""

from __future__ import annotations

import json
from typing import Callable

import torch

from rlfleet.env import ROLES, Task
from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.environment.config import EnvironmentServiceConfig
from rlfleet.services.environment.open_episodes import Episodes, StepAnswer, StepTurn, quoted
from rlfleet.v1 import environment_pb2, environment_pb2_grpc, sampling_pb2
from rlfleet.wire import decode_tensor, encode_tensor

FINISH_REASONS = ("stop", "length")


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, episodes: Callable[[], Episodes], config: EnvironmentServiceConfig):
        self.episodes = episodes
        self.config = config

    async def OpenEpisode(self, request, context):
        episodes = self.episodes()
        episode_id = _episode_id(request.episode_id, self.config)
        task = Task(
            prompt=_messages(request.prompt, self.config),
            ground_truth=_text("ground_truth", request.ground_truth, self.config),
            metadata=_metadata(request.metadata, self.config),
        )
        opening = await episodes.open(episode_id, request.environment, task)
        response = environment_pb2.OpenEpisodeResponse(
            messages=[_chat_message(message) for message in opening.messages],
            tools_json=[json.dumps(tool) for tool in opening.tools])
        encode_tensor(torch.tensor(opening.prompt_token_ids, dtype=torch.int64), out=response.prompt_token_ids)
        return response

    async def Step(self, request, context):
        episodes = self.episodes()
        episode_id = _episode_id(request.episode_id, self.config)
        turn = StepTurn(
            token_ids=_token_ids(request, self.config, len(episodes.renderer.tokenizer)),
            text=_text("text", request.text, self.config) or None,
            finish_reason=_finish_reason(request.finish_reason),
            number=_turn_number(request.turn),
            player=_player(request.player),
        )
        return _step_response(await episodes.step(episode_id, turn))

    async def CloseEpisode(self, request, context):
        final_reward = await self.episodes().close(_episode_id(request.episode_id, self.config))
        if final_reward is None:
            return environment_pb2.CloseEpisodeResponse()
        return environment_pb2.CloseEpisodeResponse(final_reward=final_reward, has_final_reward=True)


def _episode_id(value: str, config: EnvironmentServiceConfig) -> str:
    if not value:
        raise InvalidArgument("episode_id: required (chosen by the caller, unique among its open episodes)")
    if len(value) > config.max_episode_id_chars:
        raise InvalidArgument(f"episode_id: {len(value)} characters, more than max_episode_id_chars "
                              f"({config.max_episode_id_chars})")
    return value


def _text(field: str, value: str, config: EnvironmentServiceConfig) -> str:
    if len(value) > config.max_message_chars:
        raise InvalidArgument(f"{field}: {len(value)} characters, more than max_message_chars "
                              f"({config.max_message_chars})")
    return value


def _messages(messages, config: EnvironmentServiceConfig) -> list[dict[str, str]]:
    if not messages:
        raise InvalidArgument("prompt: at least one message is required")
    if len(messages) > config.max_prompt_messages:
        raise InvalidArgument(f"prompt: {len(messages)} messages, more than max_prompt_messages "
                              f"({config.max_prompt_messages})")
    decoded = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"prompt[{index}].role: {quoted(message.role)} is not one of {', '.join(ROLES)}")
        decoded.append({"role": message.role, "content": _text(f"prompt[{index}].content", message.content, config)})
    return decoded


def _metadata(metadata, config: EnvironmentServiceConfig) -> dict[str, str]:
    if len(metadata) > config.max_metadata_entries:
        raise InvalidArgument(f"metadata: {len(metadata)} entries, more than max_metadata_entries "
                              f"({config.max_metadata_entries})")
    return {key: _text(f"metadata[{quoted(key)}]", value, config) for key, value in metadata.items()}


def _token_ids(request, config: EnvironmentServiceConfig, vocabulary_size: int) -> list[int]:
    if not request.HasField("token_ids"):
        raise InvalidArgument("token_ids: required (the tokens sampled this turn)")
    tensor = decode_tensor(request.token_ids, "token_ids", max_elements=config.max_turn_tokens)
    if tensor.dim() != 1:
        raise InvalidArgument(f"token_ids: must be 1-D, not of shape {list(tensor.shape)}")
    if tensor.dtype not in (torch.int64, torch.int32):
        raise InvalidArgument(f"token_ids: must be int64 or int32, not {tensor.dtype}")
    if tensor.numel() == 0:
        raise InvalidArgument("token_ids: at least one sampled token is required")
    if int(tensor.min()) < 0 or int(tensor.max()) >= vocabulary_size:
        raise InvalidArgument(f"token_ids: ids must be in [0, {vocabulary_size}), the tokenizer's vocabulary")
    return tensor.tolist()


def _turn_number(value: int) -> int:
    if value < 0:
        raise InvalidArgument(f"turn: must be >= 1 (or 0: not checked), got {value}")
    return value


def _player(value: str) -> str:
    if len(value) > 128 or not value.isprintable():
        raise InvalidArgument(f"player: a player's name is at most 128 printable characters, got {quoted(value[:160])}")
    return value


def _finish_reason(value: str) -> str:
    if value == "":
        return "stop"
    if value not in FINISH_REASONS:
        raise InvalidArgument(f"finish_reason: {quoted(value)} is not one of {', '.join(FINISH_REASONS)}")
    return value


def _chat_message(message: dict) -> sampling_pb2.ChatMessage:
    return sampling_pb2.ChatMessage(role=message["role"], content=message["content"])


def _step_response(answer: StepAnswer) -> environment_pb2.StepResponse:
    response = environment_pb2.StepResponse(
        observation=[_chat_message(message) for message in answer.observation],
        done=answer.done, truncated=answer.truncated, info=answer.info, next_player=answer.next_player)
    if answer.reward is not None:
        response.reward, response.has_reward = answer.reward, True
    encode_tensor(torch.tensor(answer.observation_token_ids, dtype=torch.int64), out=response.observation_token_ids)
    return response
