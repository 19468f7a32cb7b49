import asyncio
import random
import threading
from pathlib import Path

import pytest
import torch

from rlfleet.services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlfleet.services.reference.batcher import MicroBatcher
from rlfleet.services.reference.config import ReferenceConfig
from rlfleet.services.reference.scorer import ReferenceScorer
from tests.waiting import wait_for_async

QUEUE_TIMEOUT = 60.0
"""Until ``score`` calls already scheduled have queued their requests: one pass of the event loop; 60 s for a
loaded machine."""


@pytest.fixture(scope="module")
def scorer(request) -> ReferenceScorer:
    from rlfleet.services.models.tiny import build_tiny_model

    path: Path = build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))
    scorer = ReferenceScorer(ReferenceConfig(
        model_path=str(path), padding_side="left", token_budget=4096, max_len=64, max_wait_ms=20,
    ))
    scorer.load()
    return scorer


async def wait_pending(batcher: MicroBatcher, count: int) -> None:
    await wait_for_async(lambda: len(batcher._pending) >= count, QUEUE_TIMEOUT, f"{count} requests queued")


def random_request(rng: random.Random, vocab_size: int):
    count = rng.randint(1, 3)
    sequences, starts = [], []
    for _ in range(count):
        length = rng.randint(2, 40)
        sequences.append([rng.randrange(vocab_size) for _ in range(length)])
        starts.append(rng.randint(1, length - 1))
    return sequences, starts


def expected_for(scorer, sequences, starts):
    """Each sequence scored alone, straight from the model."""
    out = []
    for sequence, start in zip(sequences, starts):
        ids = torch.tensor(sequence)
        with torch.inference_mode():
            log_probs = scorer.model(ids.unsqueeze(0)).logits[0].float().log_softmax(-1)
        out.append(log_probs[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)[start - 1 :])
    return out


async def test_concurrent_callers_each_get_their_own_result(scorer):
    rng = random.Random(0)
    requests = [random_request(rng, scorer.vocab_size) for _ in range(24)]
    async with MicroBatcher(scorer) as batcher:
        results = await asyncio.gather(*(
            batcher.score(sequences, starts, with_entropy=index % 2 == 0)
            for index, (sequences, starts) in enumerate(requests)
        ))
        assert batcher.forward_calls < len(requests)  # callers really shared forward passes
    for index, ((sequences, starts), result) in enumerate(zip(requests, results)):
        assert len(result.log_probs) == len(sequences)
        assert (result.entropies is not None) == (index % 2 == 0)
        for got, want in zip(result.log_probs, expected_for(scorer, sequences, starts)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


async def test_staggered_callers_and_a_small_token_budget(scorer):
    rng = random.Random(1)
    requests = [random_request(rng, scorer.vocab_size) for _ in range(12)]

    async def call(batcher, delay, sequences, starts):
        await asyncio.sleep(delay)  # arrivals spread over 30 ms: the load, not a wait for anything
        return await batcher.score(sequences, starts)

    async with MicroBatcher(scorer, max_wait_ms=5, token_budget=64) as batcher:
        results = await asyncio.gather(*(
            call(batcher, rng.uniform(0, 0.03), sequences, starts) for sequences, starts in requests
        ))
        assert batcher.forward_calls > 1
    for (sequences, starts), result in zip(requests, results):
        for got, want in zip(result.log_probs, expected_for(scorer, sequences, starts)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


async def test_forward_runs_off_the_event_loop(scorer, monkeypatch):
    threads = []
    original = scorer.score_validated

    def spy(*args):
        threads.append(threading.current_thread())
        return original(*args)

    monkeypatch.setattr(scorer, "score_validated", spy)
    async with MicroBatcher(scorer) as batcher:
        await batcher.score([[1, 2, 3]], [1])
    assert threads and threads[0] is not threading.main_thread()


async def test_one_bad_request_fails_alone(scorer):
    async with MicroBatcher(scorer) as batcher:
        good = batcher.score([[1, 2, 3, 4]], [2])
        bad = batcher.score([[1, 2, 3], [1, 999999]], [1, 1])
        results = await asyncio.gather(good, bad, return_exceptions=True)
    assert isinstance(results[1], InvalidArgument)
    assert "sample 1, token 1" in str(results[1])
    assert results[0].log_probs[0].shape == (2,)


async def test_forward_failure_reaches_every_caller_of_the_batch(scorer, monkeypatch):
    def explode(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(scorer, "score_validated", explode)
    async with MicroBatcher(scorer) as batcher:
        results = await asyncio.gather(
            *(batcher.score([[1, 2, 3]], [1]) for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) and "out of memory" in str(r) for r in results)
        # The loop survives a failed batch.
        monkeypatch.undo()
        assert len((await batcher.score([[1, 2, 3]], [1])).log_probs) == 1


async def test_a_cancelled_caller_does_not_disturb_the_others(scorer):
    async with MicroBatcher(scorer, max_wait_ms=30) as batcher:
        doomed = asyncio.ensure_future(batcher.score([[4, 5, 6]], [1]))
        survivor = asyncio.ensure_future(batcher.score([[7, 8, 9]], [2]))
        await wait_pending(batcher, 2)  # both queued: the batch is taken 30 ms after the first
        doomed.cancel()
        result = await survivor
    assert doomed.cancelled()
    expected = expected_for(scorer, [[7, 8, 9]], [2])[0]
    torch.testing.assert_close(result.log_probs[0], expected, atol=1e-5, rtol=0)


async def test_close_fails_waiting_callers_and_refuses_new_ones(scorer):
    batcher = MicroBatcher(scorer, max_wait_ms=10_000, token_budget=10_000)
    waiting = asyncio.ensure_future(batcher.score([[1, 2, 3]], [1]))
    await wait_pending(batcher, 1)
    await batcher.aclose()
    with pytest.raises(Unavailable):
        await waiting
    with pytest.raises(Unavailable, match="shutting down"):
        await batcher.score([[1, 2, 3]], [1])


async def test_empty_request(scorer):
    async with MicroBatcher(scorer) as batcher:
        result = await batcher.score([], [], with_entropy=True)
    assert result.log_probs == [] and result.entropies == []


async def test_a_full_queue_is_resource_exhausted_at_once(scorer):
    # A minute's wait for more requests: whatever is queued stays queued while the test runs.
    batcher = MicroBatcher(scorer, max_wait_ms=60_000, token_budget=10_000, max_queued_requests=2)
    waiting = [asyncio.ensure_future(batcher.score([[1, 2, 3]], [1])) for _ in range(2)]
    await wait_pending(batcher, 2)
    with pytest.raises(ResourceExhausted, match="2 requests of 6 tokens waiting .*max_queued_requests=2"):
        await batcher.score([[1, 2]], [1])
    await batcher.aclose()
    for future in waiting:
        with pytest.raises(Unavailable):
            await future


async def test_queued_tokens_are_bounded_but_one_request_always_fits(scorer):
    batcher = MicroBatcher(scorer, max_wait_ms=60_000, token_budget=10_000, max_queued_tokens=5)
    big = asyncio.ensure_future(batcher.score([[1, 2, 3, 4], [5, 6, 7, 8]], [1, 1]))  # 8 > 5, but alone
    await wait_pending(batcher, 1)
    with pytest.raises(ResourceExhausted, match="max_queued_tokens=5"):
        await batcher.score([[1, 2]], [1])
    await batcher.aclose()
    with pytest.raises(Unavailable):
        await big


async def test_oversize_request_is_invalid_argument_naming_token_ids(scorer):
    limit = scorer.config.max_request_tokens
    with pytest.raises(InvalidArgument, match=f"token_ids: the request holds {limit + 1} tokens"):
        scorer.check_size(2, limit + 1)
    with pytest.raises(InvalidArgument, match=f"at most {limit // 2} fit"):
        scorer.check_size(limit // 2 + 1, limit)
    async with MicroBatcher(scorer) as batcher:
        with pytest.raises(InvalidArgument, match="token_ids: the request holds"):
            await batcher.score([[1, 2]] * (limit // 2 + 1), [1] * (limit // 2 + 1))
