"""TorchRL-style prompt sources -> rlfleet prompt specs.

A source is a TorchRL ``DataLoadingPrimer`` (its ``dataloader`` is cycled, as the primer does),
a ``torch.utils.data.DataLoader`` or any iterable. Each item it yields is one prompt or a batch
of them: a dict of lists (a collated dataset batch, e.g. ``{"query": [...], "answer": [...]}``),
a list of dicts, or a ``TensorDict``. One prompt is a ``str`` (a user message), a TorchRL-style
dict (``query``: str or chat messages; ``answer`` becomes the ``ground_truth``; GSM8K's
``question`` and the generic ``text`` are read as the query, as TorchRL's collate functions
rename them), or an rlfleet prompt spec (a dict with ``prompt``).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, Mapping

from tensordict import TensorDictBase

QUERY_KEYS = ("query", "question", "text")


def prompt_items(source: Any, *, cycle: bool = True) -> Iterator[Any]:
    """Endless for a ``DataLoadingPrimer`` (or anything with ``.dataloader``) unless ``cycle`` is
    False, else one pass."""
    loader = getattr(source, "dataloader", None)
    if loader is None:
        batches: Iterable = source
    else:
        batches = itertools.chain.from_iterable(_forever(loader)) if cycle else loader
    for batch in batches:
        yield from _unbatch(batch)


def _forever(loader: Iterable) -> Iterator[Iterable]:
    while True:
        yield loader


def _unbatch(batch: Any) -> Iterator[Any]:
    if isinstance(batch, TensorDictBase):
        if not batch.batch_dims:
            yield {key: _plain(batch.get(key)) for key in batch.keys()}
            return
        for index in range(batch.batch_size[0]):
            yield {key: _plain(batch[index].get(key)) for key in batch.keys()}
    elif isinstance(batch, Mapping) and "prompt" not in batch and batch and all(
            isinstance(v, (list, tuple)) and not _is_chat(v) for v in batch.values()):
        columns = {key: list(values) for key, values in batch.items()}
        for row in zip(*columns.values()):
            yield dict(zip(columns, row))
    elif isinstance(batch, (list, tuple)) and not _is_chat(batch):
        yield from batch
    else:
        yield batch


def to_spec(item: Any, *, reward_fn: str | None, reward_args: Mapping[str, Any] | None,
            system_prompt: str | None) -> dict:
    """One prompt (see the module doc) as an rlfleet spec dict with the adapter's defaults."""
    if isinstance(item, Mapping) and "prompt" in item:
        spec = dict(item)
    else:
        query, answer = _query(item)
        messages = [{"role": "user", "content": query}] if isinstance(query, str) else [dict(m) for m in query]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        spec = {"prompt": messages}
        if answer is not None:
            spec["ground_truth"] = str(answer)
    if reward_fn and not spec.get("reward_fn"):
        spec["reward_fn"] = reward_fn
    if reward_args and not spec.get("reward_args"):
        spec["reward_args"] = dict(reward_args)
    return spec


def _query(item: Any) -> tuple[Any, Any]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, Mapping):
        for key in QUERY_KEYS:
            if key in item:
                return item[key], item.get("answer")
        raise ValueError(f"a prompt dict needs one of {list(QUERY_KEYS)} (TorchRL) or 'prompt' (rlfleet), "
                         f"got keys {sorted(item)}")
    if _is_chat(item):
        return item, None
    raise TypeError(f"a prompt is a str, a dict or chat messages, got {type(item).__name__}")


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in value)


def _plain(value: Any) -> Any:
    # NonTensorData -> its payload; a NonTensorStack -> a list.
    if hasattr(value, "tolist") and not hasattr(value, "dtype"):
        return value.tolist()
    return getattr(value, "data", value)
