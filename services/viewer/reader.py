"""What the viewer reads, as JSON-ready dicts: the trajectory store's sample log and per-version
statistics, the collector's status and dead letters. Read-only calls only (a ``reader`` token is
enough); nothing here knows about HTTP."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from rlfleet.rpc.channel import ChannelSettings, aio_channel
from rlfleet.v1 import (collector_pb2, collector_pb2_grpc, tensor_pb2, trajectory_pb2,
                        trajectory_pb2_grpc)
from rlfleet.wire.tensor import numpy_view
from rlfleet.wire.tensordict import entry_at

_FILTERS = {"": trajectory_pb2.SAMPLE_FILTER_UNSPECIFIED, "delivered": trajectory_pb2.SAMPLE_FILTER_DELIVERED,
            "filtered": trajectory_pb2.SAMPLE_FILTER_FILTERED}
_TOOL_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
TEXT_CHARS = 300
"""Characters of a listed trajectory's prompt (its end: the question after any system prompt) and of its
completion (its start) shown in the samples table."""
TEXT_READS = 16
"""Trajectories read at once to show a page's texts."""


NO_COLLECTOR = "no collector (collector_address is unset): showing what the trajectory store holds"


class BadQuery(ValueError):
    """A query parameter the viewer cannot use (names it)."""


class Reader:
    """Channels to the trajectory service and the collector, and the calls the page needs."""

    def __init__(self, trajectory_address: str, collector_address: str | None, settings: ChannelSettings,
                 tokenizer=None):
        self._settings = settings
        self._trajectory_channel = aio_channel(trajectory_address, settings)
        self._trajectory = trajectory_pb2_grpc.TrajectoryServiceStub(self._trajectory_channel)
        self.collector_address = collector_address
        self._collector_channel = aio_channel(collector_address, settings) if collector_address else None
        self._collector = collector_pb2_grpc.CollectorServiceStub(self._collector_channel) \
            if self._collector_channel else None
        self._tokenizer = tokenizer

    async def close(self) -> None:
        await self._trajectory_channel.close()
        if self._collector_channel is not None:
            await self._collector_channel.close()

    async def _call(self, method, request):
        return await method(request, timeout=self._settings.timeout, metadata=self._settings.metadata())

    async def versions(self, min_version: int = 0) -> dict[str, Any]:
        reply = await self._call(self._trajectory.GetVersionStats,
                                 trajectory_pb2.GetVersionStatsRequest(min_version=min_version, limit=10_000))
        return {"versions": [_message(stats) for stats in reply.versions]}

    async def samples(self, query: dict[str, str]) -> dict[str, Any]:
        request = trajectory_pb2.ListSamplesRequest(
            min_version=_int(query, "min_version", 0), limit=_int(query, "limit", 100),
            before_cursor=_int(query, "before", 0))
        if query.get("max_version", "") != "":
            request.max_version = _int(query, "max_version", 0)
        for name in ("min_score", "max_score"):
            if query.get(name, "") != "":
                setattr(request, name, _float(query, name))
        which = query.get("filter", "")
        if which not in _FILTERS:
            raise BadQuery(f"filter: {which!r} is not one of {', '.join(repr(k) for k in _FILTERS)}")
        request.filter = _FILTERS[which]
        reply = await self._call(self._trajectory.ListSamples, request)
        samples = [_message(s) for s in reply.samples]
        if self._tokenizer is not None:
            await self._add_texts(samples)
        return {"samples": samples, "next_cursor": reply.next_cursor, "logged": reply.logged,
                "matching": reply.matching}

    async def _add_texts(self, samples: list[dict[str, Any]]) -> None:
        """Each listed trajectory's prompt and completion as text (``summary_texts``), read from the log."""
        limit = asyncio.Semaphore(TEXT_READS)

        async def add(sample: dict[str, Any]) -> None:
            async with limit:
                try:
                    reply = await self._call(self._trajectory.GetSample,
                                             trajectory_pb2.GetSampleRequest(cursor=int(sample["cursor"])))
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:  # gone from the log since the listing: no text
                        raise
                    return
            sample.update(summary_texts(reply.trajectory, self._tokenizer))

        await asyncio.gather(*(add(sample) for sample in samples))

    async def sample(self, cursor: int) -> dict[str, Any]:
        reply = await self._call(self._trajectory.GetSample, trajectory_pb2.GetSampleRequest(cursor=cursor))
        return {"summary": _message(reply.summary), **render_tokens(reply.trajectory, self._tokenizer),
                **task_of(reply.trajectory)}

    async def stats(self) -> dict[str, Any]:
        return _message(await self._call(self._trajectory.GetStats, trajectory_pb2.GetStatsRequest()))

    async def status(self) -> dict[str, Any]:
        """The collector's status, or ``{"unavailable": why}`` when there is none or it does not answer
        (the page then shows the store alone, and says so)."""
        if self._collector is None:
            return {"unavailable": NO_COLLECTOR}
        try:
            return _message(await self._call(self._collector.GetStatus, collector_pb2.GetStatusRequest()))
        except grpc.RpcError as exc:
            if is_refusal(exc):
                raise
            return self._unreachable(exc)

    async def failures(self) -> dict[str, Any]:
        """The collector's dead letters, newest first, or ``{"unavailable": why}`` as for ``status``."""
        if self._collector is None:
            return {"failures": [], "unavailable": NO_COLLECTOR}
        found, after = [], 0
        while True:  # the collector keeps a bounded list; read all of it, a page at a time
            try:
                reply = await self._call(self._collector.ListFailures,
                                         collector_pb2.ListFailuresRequest(after_seq=after, limit=1000))
            except grpc.RpcError as exc:
                if is_refusal(exc):
                    raise
                return {"failures": [], **self._unreachable(exc)}
            found += [_message(failure) for failure in reply.failures]
            if len(reply.failures) < 1000:
                return {"failures": found[::-1]}
            after = reply.failures[-1].seq

    def _unreachable(self, error: grpc.RpcError) -> dict[str, str]:
        """The page's notice: which address does not answer and the status code's name. gRPC's own message
        (``failed to connect to all addresses; last error: ... Connection refused (111)``, a TLS failure) is
        no sentence for a user: it goes to ``unavailable_details``, the notice's tooltip."""
        return {"unavailable": f"the collector at {self.collector_address} does not answer ({error.code().name}): "
                               f"showing what the trajectory store holds",
                "unavailable_details": error.details() or ""}


def render_tokens(trajectory: tensor_pb2.TensorDict, tokenizer) -> dict[str, Any]:
    """One trajectory's tokens for the page: each with its text, its part (prompt, assistant turn,
    tool call, observation), its turn, behaviour and reference log-probability and sampling version."""
    full = _ragged(trajectory, "tokens/full")
    prompt = _ragged(trajectory, "tokens/prompt")
    if full is None or prompt is None:
        return {"tokens": [], "turns": 0, "prompt_tokens": 0, "response_tokens": 0, "text": None}
    prompt_length = len(prompt)
    response_length = len(full) - prompt_length
    mask = _ragged(trajectory, "masks/all_assistant_mask")
    behaviour = _ragged(trajectory, "log_probs/response")
    reference = _ragged(trajectory, "ref_log_probs/response")
    versions = _ragged(trajectory, "versions/response")
    ids = [int(token) for token in full]
    pieces = [tokenizer.decode([token]) for token in ids] if tokenizer is not None else [f"[{t}]" for t in ids]
    parts = ["prompt" if position < prompt_length else
             "assistant" if mask is None or bool(mask[position]) else "observation" for position in range(len(ids))]
    _mark_tool_calls(parts, pieces)
    tokens, turn = [], 0
    for position, (token, piece, part) in enumerate(zip(ids, pieces, parts)):
        at = position - prompt_length
        sampled = part in ("assistant", "tool_call")
        if sampled and (position == 0 or parts[position - 1] not in ("assistant", "tool_call")):
            turn += 1
        tokens.append({
            "id": token, "text": piece, "part": part, "turn": turn if at >= 0 else 0,
            "logprob": _number(behaviour, at) if sampled else None,
            "ref_logprob": _number(reference, at),
            "version": int(versions[at]) if versions is not None and 0 <= at < len(versions) and
            versions[at] >= 0 else None,
        })
    return {"tokens": tokens, "turns": turn, "prompt_tokens": prompt_length, "response_tokens": response_length,
            "text": tokenizer.decode(ids) if tokenizer is not None else None}


def summary_texts(trajectory: tensor_pb2.TensorDict, tokenizer) -> dict[str, str]:
    """A trajectory's prompt (its last ``TEXT_CHARS`` characters) and completion (its first), the completion's
    tool calls in ⟦ ⟧ and the observations between turns in ⟨ ⟩: what the samples table shows."""
    rendered = render_tokens(trajectory, tokenizer)
    tokens, prompt_length = rendered["tokens"], rendered["prompt_tokens"]
    # Each run of one part decoded whole: a character split across tokens comes out whole.
    decode = tokenizer.decode if tokenizer is not None else lambda ids: "".join(f"[{i}]" for i in ids)
    prompt = decode([token["id"] for token in tokens[:prompt_length]])
    completion, run, part = [], [], None
    for token in [*tokens[prompt_length:], {"part": None, "id": None}]:
        if token["part"] != part and run:
            opening, closing = _MARKS.get(part, ("", ""))
            completion.append(f"{opening}{decode(run)}{closing}")
            run = []
        part = token["part"]
        if token["id"] is not None:
            run.append(token["id"])
    text = "".join(completion)
    return {"prompt_text": _squeeze(prompt)[-TEXT_CHARS:], "completion_text": _squeeze(text)[:TEXT_CHARS],
            **task_of(trajectory)}


def task_of(trajectory: tensor_pb2.TensorDict) -> dict[str, str]:
    """What the trajectory was scored against: its ``reward_fn`` and ``ground_truth`` (those it carries;
    a trajectory logged before the batch had them carries neither)."""
    return {key: trajectory.entries[key].strings.values[0] for key in ("reward_fn", "ground_truth")
            if key in trajectory.entries and trajectory.entries[key].strings.values}


_MARKS = {"tool_call": ("⟦", "⟧"), "observation": ("⟨", "⟩")}
"""How the samples table marks a completion's parts other than plain sampled text."""


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def _mark_tool_calls(parts: list[str], pieces: list[str]) -> None:
    """Within each run of sampled tokens, mark the tokens of ``<tool_call> ... </tool_call>`` (however
    the tokenizer split the markers; an unclosed call runs to the end of its turn) as ``tool_call``."""
    position = 0
    while position < len(parts):
        if parts[position] != "assistant":
            position += 1
            continue
        end = position
        while end < len(parts) and parts[end] == "assistant":
            end += 1
        text, starts = "", []
        for piece in pieces[position:end]:
            starts.append(len(text))
            text += piece
        spans = [(m.start(), m.end()) for m in _TOOL_CALL.finditer(text)]
        for k, start in enumerate(starts):
            stop = starts[k + 1] if k + 1 < len(starts) else len(text)
            if any(start < span_end and stop > span_start for span_start, span_end in spans):
                parts[position + k] = "tool_call"
        position = end


def _ragged(trajectory: tensor_pb2.TensorDict, key: str) -> np.ndarray | None:
    """The values of one row's ragged entry at ``key`` (None when absent)."""
    entry = entry_at(trajectory, key)
    if entry is None or entry.WhichOneof("kind") != "ragged":
        return None
    return numpy_view(entry.ragged.values)


def _number(values: np.ndarray | None, at: int) -> float | None:
    if values is None or not 0 <= at < len(values):
        return None
    value = float(values[at])
    return value if math.isfinite(value) else None


def _message(message) -> dict[str, Any]:
    """A reply as a dict with every field (defaults too) and NaN as None (JSON has no NaN)."""
    data = json_format.MessageToDict(message, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True)
    return _finite(data)


def _finite(value):
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value in ("NaN", "Infinity", "-Infinity"):
        return None
    return value


def _int(query: dict[str, str], name: str, default: int) -> int:
    text = query.get(name, "")
    if text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise BadQuery(f"{name}: {text!r} is not an integer") from None


def _float(query: dict[str, str], name: str) -> float:
    text = query.get(name, "")
    try:
        value = float(text)
    except ValueError:
        raise BadQuery(f"{name}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise BadQuery(f"{name}: {text!r} is not a finite number")
    return value


def is_refusal(error: grpc.RpcError) -> bool:
    """A call refused for what the viewer asked (shown as such), not a service outage."""
    return error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.OUT_OF_RANGE)
