"""GenerationEngine against a real vLLM engine and a plain transformers forward pass.

One engine per module (start-up is ~30 s). Tests run in file order and share
the engine's policy version: each weight push uses the next version.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rlfleet.services.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from rlfleet.services.common.sampling_spec import SamplingSpec
from rlfleet.services.generation import queue_poll
from rlfleet.services.generation.config import GenerationEngineConfig
from rlfleet.services.generation.config import MAX_LORA_RANKS
from rlfleet.services.generation.vllm_engine import GenerationEngine
from rlfleet.services.launch import tmp_env
from rlfleet.services.generation.sampling import SampleResult
from rlfleet.services.models.tiny import build_tiny_model
from rlfleet.v1 import weights_pb2
from rlfleet.wire import WireError
from tests.hf_reference import load_hf, perturbed, response_log_probs
from tests.waiting import wait_for, wait_for_async

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_QUEUED_REQUESTS = 4
MAX_LORA_RANK = 8
LOG_PROB_TOLERANCE = 1e-4
PROMPT = [1, 348, 201, 330, 400, 223, 20, 267, 223, 21, 2, 201, 1, 305, 310, 201]
LONG_RESPONSE_TOKENS = 400
ENGINE_STEP_TIMEOUT = 60.0
"""Until the engine shows what a call set off (a request running or admitted, a swap waiting for the drain):
one engine step of the tiny model, milliseconds; 60 s for a loaded 2-core machine. The long request
(LONG_RESPONSE_TOKENS) runs for seconds, so it is still running when this returns."""
ABORT_TIMEOUT = 30.0
"""Until requests whose consumers were cancelled have left vLLM: the aborts reach the engine core at its next step."""


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def base_state_dict(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(model_dir):
    config = GenerationEngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_queued_requests=MAX_QUEUED_REQUESTS,
        kv_cache_memory_bytes=64 * 1024 * 1024,
        max_lora_rank=MAX_LORA_RANK,  # the adapter tests at the end; the others run without an adapter
    )
    engine = GenerationEngine(config)
    # In this process, as a service has in its own (rlfleet.services.launch.private_tmp): the engine core's
    # file store and the IPC sockets in a directory of their own, removed at the end (vLLM leaves them).
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-engine-"))
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH")}
    os.environ.update({**tmp_env(tmp), "VLLM_RPC_BASE_PATH": str(tmp)})
    try:
        await engine.start()
    finally:
        for name, value in saved.items():
            if name == "VLLM_RPC_BASE_PATH":
                continue  # read again at the engine's shutdown
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    yield engine
    await engine.shutdown()
    if saved["VLLM_RPC_BASE_PATH"] is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = saved["VLLM_RPC_BASE_PATH"]
    shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- helpers


def as_push(state_dict: dict[str, torch.Tensor]):
    return list(state_dict.items())


def hf_model(model_dir, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


@torch.no_grad()
def hf_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a plain forward pass, at the sampled tokens."""
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    response_logits = logits[len(prompt) - 1 : -1] / temperature
    log_probs = torch.log_softmax(response_logits, dim=-1)
    return log_probs.gather(-1, torch.tensor(response)[:, None])[:, 0]


def max_abs_diff(sample: SampleResult, reference: torch.Tensor) -> float:
    engine_log_probs = torch.tensor(sample.behavior_log_probs, dtype=torch.float32)
    return (engine_log_probs - reference).abs().max().item()


async def collect(engine: GenerationEngine, spec: SamplingSpec, request_id: str, prompt=PROMPT):
    return [sample async for sample in engine.generate(prompt, spec, request_id)]


def long_spec() -> SamplingSpec:
    return SamplingSpec(n=1, temperature=1.0, max_tokens=LONG_RESPONSE_TOKENS, ignore_eos=True, seed=7)


# ---------------------------------------------------------------- tests


def test_engine_processes_sleep_on_their_queues(engine):
    """On CPU the engine's queue readers sleep queue_poll's default interval instead of spinning: this
    process's vLLM queues are patched, and the variable set, before vLLM forks its engine core from it
    (the fork inherits both). The generation service's engine processes are spawned instead:
    test_generation_service checks that each of them installs the sleep."""
    from vllm.distributed.device_communicators import shm_broadcast

    assert getattr(shm_broadcast.sched_yield, "rlfleet_poll_us", None) == queue_poll.CPU_DEFAULT_US
    assert os.environ[queue_poll.ENV] == str(queue_poll.CPU_DEFAULT_US)


def test_render_chat_matches_tokenizer_template(engine):
    messages = [{"role": "user", "content": "what is 2 plus 3"}]
    assert engine.render_chat(messages) == PROMPT


@pytest.mark.parametrize("temperature", [0.7, 1.0])
async def test_behavior_log_probs_match_hf(engine, model_dir, temperature):
    spec = SamplingSpec(n=4, temperature=temperature, max_tokens=24, seed=11)
    samples = await collect(engine, spec, f"fidelity-{temperature}")

    assert sorted(s.index for s in samples) == [0, 1, 2, 3]
    reference = hf_model(model_dir)
    for sample in samples:
        assert sample.prompt_length == len(PROMPT)
        assert len(sample.behavior_log_probs) == len(sample.response_token_ids) > 0
        assert sample.finish_reason in ("stop", "length")
        assert sample.policy_version_start == sample.policy_version_end == 0
        expected = hf_log_probs(reference, PROMPT, sample.response_token_ids, temperature)
        assert max_abs_diff(sample, expected) <= LOG_PROB_TOLERANCE
    # A GRPO group is not n copies of one sample.
    assert len({tuple(s.response_token_ids) for s in samples}) > 1


async def test_vllm_hands_each_sample_over_every_stream_interval_tokens(engine):
    """The engine's ``stream_interval`` (16 by default) reaches vLLM: a 64-token sample arrives as its first
    token, then 16 tokens at a time, then the rest at its end, not as an output per token. (The samples
    the engine assembles from such deltas keep every token's log-prob: test_behavior_log_probs_match_hf.)"""
    from rlfleet.services.generation.sampling import to_vllm

    assert engine.config.stream_interval == 16
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=64, ignore_eos=True)
    sizes = [len(output.outputs[0].token_ids) async for output in
             engine.vllm.generate({"prompt_token_ids": PROMPT}, to_vllm(spec), "stream-interval")]
    assert sizes == [1, 16, 16, 16, 15]


async def test_a_turn_from_a_cached_history_samples_exactly_what_a_cold_one_does(engine, model_dir):
    """A multi-turn episode's next turn reuses the KV its history left in the prefix cache (blocks of
    ``block_size`` tokens, 32 by default): same tokens and log-probs as from a cold cache, and as HF's."""
    assert engine.config.block_size == 32
    first, = await collect(engine, SamplingSpec(n=1, temperature=1.0, max_tokens=60, ignore_eos=True, seed=3),
                           "turn-1")
    history = PROMPT + first.response_token_ids + [201, 1, 305, 310, 201]  # + an observation's tokens
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    warm, = await collect(engine, spec, "turn-2-warm", prompt=history)
    # Private on purpose: the service resets the cache only with a weight swap.
    assert await engine.vllm.reset_prefix_cache()
    cold, = await collect(engine, spec, "turn-2-cold", prompt=history)

    assert warm.cached_prompt_tokens == 64  # the prompt and turn 1's KV, up to its last full block
    assert cold.cached_prompt_tokens == 0
    assert warm.response_token_ids == cold.response_token_ids
    assert warm.behavior_log_probs == cold.behavior_log_probs
    expected = hf_log_probs(hf_model(model_dir), history, warm.response_token_ids, 1.0)
    assert max_abs_diff(warm, expected) <= LOG_PROB_TOLERANCE


async def test_weight_push_changes_log_probs(engine, model_dir, base_state_dict):
    new_weights = perturbed(base_state_dict, seed=1)
    await engine.weights.update(1, as_push(new_weights), mode="wait")
    assert engine.policy_version == 1

    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=32, seed=3)
    samples = await collect(engine, spec, "after-push-1")
    old_model, new_model = hf_model(model_dir), hf_model(model_dir, new_weights)
    for sample in samples:
        assert sample.policy_version_start == sample.policy_version_end == 1
        tokens = sample.response_token_ids
        assert max_abs_diff(sample, hf_log_probs(new_model, PROMPT, tokens, 1.0)) <= LOG_PROB_TOLERANCE
        assert max_abs_diff(sample, hf_log_probs(old_model, PROMPT, tokens, 1.0)) > 1e-2


async def test_rejected_push_leaves_engine_untouched(engine, base_state_dict):
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=32, seed=5)
    before = await collect(engine, spec, "before-bad-push")
    good = as_push(perturbed(base_state_dict, seed=99))

    wrong_shape = list(good)
    name, tensor = wrong_shape[0]
    wrong_shape[0] = (name, tensor[:-1])
    with pytest.raises(InvalidArgument, match=name):
        await engine.weights.update(2, wrong_shape)

    unknown = [*good, ("model.layers.7.mlp.up_proj.weight", torch.zeros(2, 2))]
    with pytest.raises(InvalidArgument, match="model.layers.7.mlp.up_proj.weight"):
        await engine.weights.update(2, unknown)

    with pytest.raises(InvalidArgument, match="missing"):
        await engine.weights.update(2, good[1:])

    assert engine.policy_version == 1
    after = await collect(engine, spec, "after-bad-push")
    by_index = {s.index: s for s in after}
    for sample in before:
        assert by_index[sample.index].response_token_ids == sample.response_token_ids
        assert by_index[sample.index].behavior_log_probs == sample.behavior_log_probs


async def test_stale_version_is_refused(engine, base_state_dict):
    push = as_push(base_state_dict)
    for stale_version in (0, 1):
        with pytest.raises(FailedPrecondition):
            await engine.weights.update(stale_version, push)
    assert engine.policy_version == 1


async def test_keep_mode_sample_spans_two_versions(engine, model_dir, base_state_dict):
    old_weights, new_weights = perturbed(base_state_dict, seed=1), perturbed(base_state_dict, seed=2)
    generation = asyncio.create_task(collect(engine, long_spec(), "keep-in-flight"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    await engine.weights.update(2, as_push(new_weights), mode="keep")
    (sample,) = await generation

    assert sample.finish_reason == "length"
    assert len(sample.response_token_ids) == LONG_RESPONSE_TOKENS
    assert (sample.policy_version_start, sample.policy_version_end) == (1, 2)
    (_, _, switch), (_, switch_again, end) = sample.policy_version_spans
    assert switch == switch_again and 0 < switch < end == LONG_RESPONSE_TOKENS
    # Tokens before the switch came from the old weights, after it from the new.
    tokens = sample.response_token_ids
    engine_log_probs = torch.tensor(sample.behavior_log_probs)
    old_ref = hf_log_probs(hf_model(model_dir, old_weights), PROMPT, tokens, 1.0)
    new_ref = hf_log_probs(hf_model(model_dir, new_weights), PROMPT, tokens, 1.0)
    assert (engine_log_probs[:switch] - old_ref[:switch]).abs().max() <= LOG_PROB_TOLERANCE
    assert (engine_log_probs[switch:] - new_ref[switch:]).abs().max() <= LOG_PROB_TOLERANCE


async def test_abort_mode_ends_in_flight_samples(engine, base_state_dict):
    generation = asyncio.create_task(collect(engine, long_spec(), "abort-in-flight"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    await engine.weights.update(3, as_push(perturbed(base_state_dict, seed=3)), mode="abort")
    (sample,) = await generation

    assert sample.finish_reason == "abort"
    assert len(sample.response_token_ids) < LONG_RESPONSE_TOKENS
    assert len(sample.behavior_log_probs) == len(sample.response_token_ids)
    assert sample.policy_version_start == sample.policy_version_end == 2
    (after,) = await collect(engine, SamplingSpec(max_tokens=8), "after-abort")
    assert after.policy_version_start == 3


async def test_wait_mode_drains_then_swaps(engine, base_state_dict):
    generation = asyncio.create_task(collect(engine, long_spec(), "wait-in-flight"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    push = asyncio.create_task(
        engine.weights.update(4, as_push(perturbed(base_state_dict, seed=4)), mode="wait")
    )
    await wait_for_async(lambda: engine.swapping, ENGINE_STEP_TIMEOUT, "the swap to wait for the drain")
    assert not engine.serving
    (sample,) = await generation
    await push

    assert sample.finish_reason == "length"
    assert sample.policy_version_start == sample.policy_version_end == 3
    assert engine.serving and engine.policy_version == 4


async def test_admission_bound_and_cancellation(engine):
    flood = [
        asyncio.create_task(collect(engine, long_spec(), f"flood-{i}"))
        for i in range(MAX_QUEUED_REQUESTS)
    ]
    await wait_for_async(lambda: engine.status().requests_in_flight == MAX_QUEUED_REQUESTS, ENGINE_STEP_TIMEOUT,
                         "the flood admitted")
    with pytest.raises(ResourceExhausted):
        await collect(engine, SamplingSpec(max_tokens=4), "one-too-many")

    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    assert engine.status().requests_in_flight == 0
    # Cancelling the consumers aborted the vLLM requests too.
    await wait_for_async(lambda: engine.vllm.get_num_unfinished_requests() == 0, ABORT_TIMEOUT,
                         "the cancelled requests to leave vLLM")
    (sample,) = await collect(engine, SamplingSpec(max_tokens=4), "after-flood")
    assert sample.finish_reason in ("stop", "length")
    assert engine.status().tokens_per_second > 0


# ---------------------------------------------------------------- resume swaps


async def serve(engine: GenerationEngine, weights: dict[str, torch.Tensor], mode: str = "wait") -> int:
    """Push ``weights`` as the next policy version; returns that version."""
    version = engine.policy_version + 1
    await engine.weights.update(version, as_push(weights), mode=mode)
    return version


def check_log_probs_per_span(sample: SampleResult, models: dict[int, torch.nn.Module]) -> None:
    """Each token's behaviour log-prob is the HF one under the weights of the version that sampled it."""
    engine_log_probs = torch.tensor(sample.behavior_log_probs)
    for version, start, end in sample.policy_version_spans:
        expected = hf_log_probs(models[version], PROMPT, sample.response_token_ids, 1.0)
        assert (engine_log_probs[start:end] - expected[start:end]).abs().max() <= LOG_PROB_TOLERANCE, version


async def test_resume_mode_continues_a_sample_on_the_new_weights(engine, model_dir, base_state_dict):
    """The swap aborts the request inside vLLM; the engine continues it as prompt + the tokens so far:
    the caller sees one sample of the full budget whose first tokens are those the old weights sampled
    (the same as an unswapped run with the same seed), split where the swap took effect."""
    old_weights, new_weights = perturbed(base_state_dict, seed=5), perturbed(base_state_dict, seed=6)
    old_version = await serve(engine, old_weights)
    (unswapped,) = await collect(engine, long_spec(), "resume-reference")
    before = engine.status()
    generation = asyncio.create_task(collect(engine, long_spec(), "resume-in-flight"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    new_version = await serve(engine, new_weights, mode="resume")
    (sample,) = await generation

    assert sample.finish_reason == "length"
    assert len(sample.response_token_ids) == len(sample.behavior_log_probs) == LONG_RESPONSE_TOKENS
    (first, start, switch), (second, switch_again, end) = sample.policy_version_spans
    assert (first, second) == (old_version, new_version) == (sample.policy_version_start, sample.policy_version_end)
    assert start == 0 and switch == switch_again and 0 < switch < end == LONG_RESPONSE_TOKENS
    after = engine.status()
    assert (after.resumed_samples - before.resumed_samples, after.resumed_tokens - before.resumed_tokens) == (1, switch)
    # Nothing sampled before the swap was lost or changed.
    assert sample.response_token_ids[:switch] == unswapped.response_token_ids[:switch]
    assert sample.behavior_log_probs[:switch] == unswapped.behavior_log_probs[:switch]
    check_log_probs_per_span(sample, {old_version: hf_model(model_dir, old_weights),
                                      new_version: hf_model(model_dir, new_weights)})


async def test_resume_mode_resumes_each_sample_of_a_group_and_again_at_a_second_swap(engine, model_dir,
                                                                                     base_state_dict):
    weights = [perturbed(base_state_dict, seed=seed) for seed in (7, 8, 9)]
    versions = [await serve(engine, weights[0])]
    resumed_before = engine.status().resumed_samples
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=LONG_RESPONSE_TOKENS, ignore_eos=True)
    generation = asyncio.create_task(collect(engine, spec, "resume-group"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the group running")
    versions.append(await serve(engine, weights[1], mode="resume"))
    # The three continuations are inside vLLM (a continuation reaches it at its first read) ...
    await wait_for_async(lambda: engine.status().resumed_samples - resumed_before == 3
                         and engine.vllm.get_num_unfinished_requests() == 3, ENGINE_STEP_TIMEOUT,
                         "the continuations submitted")
    # ... so the second swap aborts them too, and they are continued again.
    versions.append(await serve(engine, weights[2], mode="resume"))
    samples = await generation

    assert sorted(s.index for s in samples) == [0, 1, 2]
    assert len({tuple(s.response_token_ids) for s in samples}) == 3  # resumed independently
    assert engine.status().resumed_samples - resumed_before == 6  # every sample, at each swap
    models = {version: hf_model(model_dir, w) for version, w in zip(versions, weights)}
    for sample in samples:
        assert sample.finish_reason == "length"
        assert len(sample.response_token_ids) == len(sample.behavior_log_probs) == LONG_RESPONSE_TOKENS
        spans = sample.policy_version_spans
        assert [end for _, _, end in spans[:-1]] == [start for _, start, _ in spans[1:]]
        assert spans[0][1] == 0 and spans[-1][2] == LONG_RESPONSE_TOKENS and spans[-1][0] == versions[2]
        assert [version for version, _, _ in spans] == sorted({version for version, _, _ in spans} & set(versions))
        check_log_probs_per_span(sample, models)
    assert any(sample.policy_version_spans[0][0] == versions[0] for sample in samples)


async def test_resume_mode_finishes_a_request_with_stop_strings_with_abort(engine, base_state_dict):
    """Stop strings cannot be matched across the boundary (vLLM matches them in a request's own output
    text): such a request finishes as under an abort swap, and nothing is continued."""
    before = engine.status().resumed_samples
    old_version = engine.policy_version
    spec = SamplingSpec(temperature=1.0, max_tokens=LONG_RESPONSE_TOKENS, ignore_eos=True, stop=("<<no such stop>>",))
    generation = asyncio.create_task(collect(engine, spec, "resume-stop-strings"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    await serve(engine, perturbed(base_state_dict, seed=10), mode="resume")
    (sample,) = await generation

    assert sample.finish_reason == "abort"
    assert 0 < len(sample.response_token_ids) == len(sample.behavior_log_probs) < LONG_RESPONSE_TOKENS
    assert sample.policy_version_spans == [(old_version, 0, len(sample.response_token_ids))]
    assert engine.status().resumed_samples == before


async def test_a_request_bound_to_a_version_runs_on_it_alone(engine, base_state_dict):
    """A rolling update's pin (``required_version``): refused on another version, naming both; a ``keep`` swap
    while it runs ends it with "abort" on its version instead of continuing it on the new weights, while a
    request beside it that is bound to nothing is continued on them (the swap runs as ``resume``)."""
    version = engine.policy_version
    with pytest.raises(Aborted, match=f"pinned to policy version {version + 1}; this replica serves version "
                                      f"{version}"):
        [s async for s in engine.generate(PROMPT, SamplingSpec(max_tokens=4), "bound-ahead", version + 1)]

    async def bound():
        return [s async for s in engine.generate(PROMPT, long_spec(), "bound", version)]
    pinned = asyncio.create_task(bound())
    free = asyncio.create_task(collect(engine, long_spec(), "unbound"))
    await wait_for_async(lambda: engine.status().requests_running == 2, ENGINE_STEP_TIMEOUT, "both requests running")
    await serve(engine, perturbed(base_state_dict, seed=12), mode="keep")
    (on_pin,), (unbound,) = await pinned, await free

    assert on_pin.finish_reason == "abort" and 0 < len(on_pin.response_token_ids) < LONG_RESPONSE_TOKENS
    assert on_pin.policy_version_spans == [(version, 0, len(on_pin.response_token_ids))]
    assert unbound.finish_reason == "length" and len(unbound.response_token_ids) == LONG_RESPONSE_TOKENS
    assert (unbound.policy_version_start, unbound.policy_version_end) == (version, version + 1)


# ---------------------------------------------------------------- delta pushes


def changed_few(weights: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """``weights`` with noise added to ``names`` only."""
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) if name in names else tensor
            for name, tensor in weights.items()}


DELTA_TENSORS = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.0.input_layernorm.weight"]
"""Changed by the delta test: one tensor of a fused qkv_proj, one of gate_up_proj, one plain layer."""


async def test_a_delta_push_reloads_what_changed_and_keeps_the_rest(engine, model_dir, base_state_dict):
    """A full push is kept; a delta naming three tensors patches it: the engine then samples exactly as
    Hugging Face does with those three changed (so q and v beside the changed k, and gate beside up, kept
    their bytes), and not as with the base."""
    full = perturbed(base_state_dict, seed=20)
    base_version = await serve(engine, full)
    after = changed_few(full, DELTA_TENSORS, seed=21)
    await engine.weights.update(base_version + 1, [(name, after[name]) for name in DELTA_TENSORS],
                                base_version=base_version)
    assert engine.policy_version == base_version + 1

    samples = await collect(engine, SamplingSpec(n=2, temperature=1.0, max_tokens=32, seed=22), "after-delta")
    new_model, old_model = hf_model(model_dir, after), hf_model(model_dir, full)
    for sample in samples:
        assert sample.policy_version_start == sample.policy_version_end == base_version + 1
        tokens = sample.response_token_ids
        assert max_abs_diff(sample, hf_log_probs(new_model, PROMPT, tokens, 1.0)) <= LOG_PROB_TOLERANCE
        assert max_abs_diff(sample, hf_log_probs(old_model, PROMPT, tokens, 1.0)) > 1e-3


async def test_an_empty_delta_moves_the_version_and_changes_nothing(engine):
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=32, seed=23)
    before = await collect(engine, spec, "before-empty-delta")
    version = engine.policy_version
    await engine.weights.update(version + 1, [], base_version=version)
    assert engine.policy_version == version + 1
    after = {s.index: s for s in await collect(engine, spec, "after-empty-delta")}
    for sample in before:
        assert after[sample.index].response_token_ids == sample.response_token_ids
        assert after[sample.index].behavior_log_probs == sample.behavior_log_probs


async def test_a_delta_on_another_base_or_reshaping_a_tensor_is_refused_untouched(engine, base_state_dict):
    version = engine.policy_version
    name = DELTA_TENSORS[0]
    tensor = base_state_dict[name]
    with pytest.raises(FailedPrecondition, match=f"delta push on version {version - 1}: this replica serves "
                                                 f"version {version}"):
        await engine.weights.update(version + 1, [(name, tensor)], base_version=version - 1)
    with pytest.raises(WireError, match=name):  # INVALID_ARGUMENT, by the interceptor
        await engine.weights.update(version + 1, [(name, tensor[:-1])], base_version=version)
    with pytest.raises(WireError, match="model.layers.7.mlp.up_proj.weight"):
        await engine.weights.update(version + 1, [("model.layers.7.mlp.up_proj.weight", torch.zeros(2, 2))],
                                    base_version=version)
    assert engine.policy_version == version


# ---------------------------------------------------------------- LoRA adapter pushes
# Adapters as a trainer pushes them (peft's names, one flat buffer), served by vLLM against Hugging Face
# + peft. The module's weights are first set back to the checkpoint's: the peft references sit on it.

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir, rank: int, alpha: float, seed: int):
    """The trainer's side: the tiny model with a seeded LoRA whose lora_B is non-zero (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # lora_A's init
    model = get_peft_model(load_hf(model_dir), LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()


async def push_adapter(engine, model, version: int, mode: str = "keep", pairs=None, rank=None, delta=False):
    """``model``'s adapter (or ``pairs``) as an adapter push of ``version``."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"]
    pairs = pairs if pairs is not None else list(get_peft_model_state_dict(model).items())
    lora = weights_pb2.LoraAdapter(rank=rank or config.r, alpha=config.lora_alpha,
                                   target_modules=sorted(config.target_modules))
    await engine.weights.update(version, pairs, mode=mode, lora=lora, base_version=version - 1 if delta else None)


def test_the_allowed_ranks_are_vllms():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    assert MAX_LORA_RANKS == tuple(get_args(MaxLoRARanks))


async def test_an_adapter_push_is_served_with_the_log_probs_of_hf_and_peft(engine, model_dir, base_state_dict):
    await serve(engine, base_state_dict)  # the checkpoint's weights again: the references' base
    model = peft_model(model_dir, rank=8, alpha=16, seed=1)
    version = engine.policy_version + 1
    await push_adapter(engine, model, version)
    assert engine.policy_version == version

    samples = await collect(engine, SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=31), "adapter-1")
    for sample in samples:
        assert sample.policy_version_spans == [(version, 0, len(sample.response_token_ids))]
        tokens = sample.response_token_ids
        assert max_abs_diff(sample, response_log_probs(model, PROMPT, tokens)) <= LOG_PROB_TOLERANCE
        assert max_abs_diff(sample, response_log_probs(load_hf(model_dir), PROMPT, tokens)) > 1e-2


async def test_a_request_runs_to_its_end_on_the_adapter_it_started_on(engine, model_dir):
    """``keep``: an adapter push pauses nothing; the request running goes on with the previous adapter (two
    resident), new requests get the pushed one, and the previous one leaves vLLM when its last request ends."""
    first = peft_model(model_dir, rank=8, alpha=16, seed=1)  # what the previous test pushed
    first_version = engine.policy_version
    second = peft_model(model_dir, rank=4, alpha=16, seed=2)  # a rank below max_lora_rank: a scaling of its own
    long = asyncio.create_task(collect(engine, long_spec(), "adapter-long"))
    await wait_for_async(lambda: engine.status().requests_running == 1, ENGINE_STEP_TIMEOUT, "the request running")
    await push_adapter(engine, second, first_version + 1)
    assert engine.status().requests_running == 1 and not long.done()
    assert len(await engine.vllm.list_loras()) == 2

    (fresh,) = await collect(engine, SamplingSpec(temperature=1.0, max_tokens=16, seed=32), "adapter-2")
    assert fresh.policy_version_spans == [(first_version + 1, 0, len(fresh.response_token_ids))]
    assert max_abs_diff(fresh, response_log_probs(second, PROMPT, fresh.response_token_ids)) <= LOG_PROB_TOLERANCE
    (sample,) = await long
    assert sample.policy_version_spans == [(first_version, 0, LONG_RESPONSE_TOKENS)]
    assert max_abs_diff(sample, response_log_probs(first, PROMPT, sample.response_token_ids)) <= LOG_PROB_TOLERANCE
    loras = engine.vllm.list_loras

    async def one_left():
        return len(await loras()) == 1
    deadline = asyncio.get_running_loop().time() + ABORT_TIMEOUT
    while not await one_left():
        assert asyncio.get_running_loop().time() < deadline, "the previous adapter never left vLLM"
        await asyncio.sleep(0.05)
    await wait_for_async(lambda: len(list(engine.weights.adapters.directory.iterdir())) == 1, ABORT_TIMEOUT,
                         "the previous adapter's directory to go")


async def test_adapter_pushes_the_replica_cannot_serve_are_refused_untouched(engine, model_dir):
    version = engine.policy_version
    model = peft_model(model_dir, rank=8, alpha=16, seed=3)
    with pytest.raises(FailedPrecondition, match="rank 16 is above this replica's max_lora_rank 8"):
        await push_adapter(engine, model, version + 1, rank=16)
    from peft import get_peft_model_state_dict

    pairs = [(name, tensor.t().contiguous() if name.endswith("layers.0.self_attn.q_proj.lora_A.weight") else tensor)
             for name, tensor in get_peft_model_state_dict(model).items()]
    with pytest.raises((InvalidArgument, WireError), match="layers.0.self_attn.q_proj.lora_A"):
        await push_adapter(engine, model, version + 1, pairs=pairs)
    with pytest.raises((InvalidArgument, WireError), match="never a delta"):
        await push_adapter(engine, model, version + 1, delta=True)
    assert engine.policy_version == version


async def test_a_full_push_drops_the_adapter(engine, model_dir, base_state_dict):
    weights = perturbed(base_state_dict, seed=33)
    version = await serve(engine, weights, mode="keep")  # run as "resume" under an adapter
    (sample,) = await collect(engine, SamplingSpec(temperature=1.0, max_tokens=16, seed=34), "after-adapters")
    assert sample.policy_version_spans == [(version, 0, len(sample.response_token_ids))]
    expected = hf_log_probs(hf_model(model_dir, weights), PROMPT, sample.response_token_ids, 1.0)
    assert max_abs_diff(sample, expected) <= LOG_PROB_TOLERANCE
    await wait_for_async(lambda: not list(engine.weights.adapters.directory.iterdir()), ABORT_TIMEOUT, "adapters removed")


async def test_shutdown_ends_vllms_output_handler_before_it_reads_the_closed_queue(engine, monkeypatch):
    """Runs last: it stops the module's engine. vLLM's shutdown, run in a thread, closes its output queue and
    then cancels its output handler from that thread; a handler that read the closed queue in between
    logged an EngineDeadError traceback at a plain stop. Here vLLM's cancel comes only once the handler has
    ended, the worst order: the handler still ends cancelled (``GenerationEngine.shutdown`` cancels it
    first), having read nothing and logged nothing."""
    from vllm.v1.engine import async_llm

    handler = engine.vllm.output_handler
    assert handler is not None and not handler.done()
    cancel = async_llm.cancel_task_threadsafe

    def cancel_once_ended(task):
        if task is handler:
            wait_for(handler.done, ABORT_TIMEOUT, "vLLM's output handler to end")
        cancel(task)

    monkeypatch.setattr(async_llm, "cancel_task_threadsafe", cancel_once_ended)
    await engine.shutdown()
    assert handler.cancelled()
