"""The reference service as a real process: parity with a direct HF forward, errors, concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from rlfleet.services.launch import ServiceProcess
from rlfleet.v1 import reference_pb2, reference_pb2_grpc, tensor_pb2
from rlfleet.wire import Ragged, decode_ragged, encode_ragged
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

MAX_LEN = 256  # set through the env var, so the over-long case stays cheap
MAX_REQUEST_TOKENS = 1024  # likewise, so the oversize-request cases stay cheap


@pytest.fixture(scope="module")
def tiny_model(request) -> Path:
    from rlfleet.services.models.tiny import build_tiny_model

    return build_tiny_model(request.config.cache.mkdir("rlfleet-tiny-model"))


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """One service process for the module: model path by CLI flag, max_len by env var."""
    proc = ServiceProcess(
        "reference", ["--model-path", str(tiny_model), "--log-format", "text"],
        env={"RLFLEET_REFERENCE_MAX_LEN": str(MAX_LEN), "RLFLEET_REFERENCE_MAX_REQUEST_TOKENS": str(MAX_REQUEST_TOKENS)},
    )
    proc.start(tmp_path_factory.mktemp("reference"))
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def stub(reference):
    channel = grpc.insecure_channel(reference.address)
    yield reference_pb2_grpc.ReferenceServiceStub(channel)
    channel.close()


def direct(model, sequence: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one sequence alone: log_softmax(logits) gathered at the next token."""
    with torch.inference_mode():
        log_probs = model(sequence.unsqueeze(0)).logits[0].float().log_softmax(-1)
    chosen = log_probs[:-1].gather(-1, sequence[1:].unsqueeze(-1)).squeeze(-1)[start - 1:]
    entropy = -(log_probs.exp() * log_probs).sum(-1)[start - 1:-1]
    return chosen, entropy


def ragged_batch(seed: int, vocab_size: int, shapes=None):
    generator = torch.Generator().manual_seed(seed)
    shapes = shapes or [(1, 1), (3, 14), (20, 2), (7, 7), (1, 40), (33, 9), (2, 1), (12, 30)]  # (prompt, response)
    sequences = [torch.randint(0, vocab_size, (p + r,), generator=generator) for p, r in shapes]
    return sequences, [p for p, _ in shapes]


def request_for(sequences, starts, with_entropy=False) -> reference_pb2.ScoreLogProbsRequest:
    return reference_pb2.ScoreLogProbsRequest(
        token_ids=encode_ragged(Ragged.from_list(sequences, torch.int64)),
        response_starts=starts, with_entropy=with_entropy,
    )


def check_against_direct(hf_model, sequences, starts, reply, with_entropy):
    log_probs = decode_ragged(reply.ref_log_probs, "ref_log_probs")
    assert log_probs.values.dtype == torch.float32
    assert log_probs.lengths.tolist() == [s.numel() - start for s, start in zip(sequences, starts)]
    entropies = decode_ragged(reply.entropies).to_list() if with_entropy else [None] * len(sequences)
    for sequence, start, got, got_entropy in zip(sequences, starts, log_probs.to_list(), entropies):
        want, want_entropy = direct(hf_model, sequence, start)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if with_entropy:
            torch.testing.assert_close(got_entropy, want_entropy, atol=1e-5, rtol=0)


def test_health_and_model_load_order(reference):
    assert reference.health() == health_pb2.HealthCheckResponse.SERVING
    log = reference.log_path.read_text()
    # Listening (NOT_SERVING) first, then the model load, then SERVING.
    assert log.index("listening") < log.index("reference model loaded") < log.index("serving")


def test_parity_with_a_direct_forward(stub, hf_model, tiny_model):
    vocab_size = hf_model.get_input_embeddings().num_embeddings
    sequences, starts = ragged_batch(seed=1, vocab_size=vocab_size)
    reply = stub.ScoreLogProbs(request_for(sequences, starts, with_entropy=True), timeout=60)
    assert reply.model == str(tiny_model)
    check_against_direct(hf_model, sequences, starts, reply, with_entropy=True)
    entropies = decode_ragged(reply.entropies).values
    assert bool((entropies > 0).all()) and bool((entropies <= torch.log(torch.tensor(vocab_size)) + 1e-4).all())

    # Without entropies the field stays empty; int32 token ids are accepted too.
    plain = reference_pb2.ScoreLogProbsRequest(
        token_ids=encode_ragged(Ragged.from_list(sequences, torch.int32)), response_starts=starts)
    reply = stub.ScoreLogProbs(plain, timeout=60)
    assert not reply.HasField("entropies")
    check_against_direct(hf_model, sequences, starts, reply, with_entropy=False)

    # The longest accepted sequence is scored.
    longest, start = ragged_batch(seed=3, vocab_size=vocab_size, shapes=[(MAX_LEN - 5, 5)])
    check_against_direct(hf_model, longest, start, stub.ScoreLogProbs(request_for(longest, start), timeout=60), False)

    # An empty batch is an empty answer.
    empty = stub.ScoreLogProbs(request_for([], []), timeout=60)
    assert decode_ragged(empty.ref_log_probs).batch_size == 0


def _bad_requests(vocab_size: int):
    good = [torch.arange(6), torch.arange(4), torch.arange(5)]
    over_long = [torch.arange(6), torch.zeros(MAX_LEN + 1, dtype=torch.int64), torch.arange(5)]
    out_of_vocab = [torch.arange(6), torch.tensor([1, 2, vocab_size, 3]), torch.arange(5)]
    float_ids = reference_pb2.ScoreLogProbsRequest(
        token_ids=encode_ragged(Ragged.from_list([torch.ones(3), torch.ones(3)], torch.float32)),
        response_starts=[1, 1])
    torn = request_for(good, [1, 1, 1])
    torn.token_ids.values.data = torn.token_ids.values.data[:-3]
    return {
        "empty sequence": (request_for([torch.arange(6), torch.arange(0), torch.arange(5)], [1, 1, 1]),
                           "sample 1: sequence is empty"),
        "start past the end": (request_for(good, [1, 4, 1]), "sample 1: response_start 4 must be"),
        "start zero": (request_for(good, [1, 1, 0]), "sample 2: response_start 0 must be"),
        "token id >= vocab": (request_for(out_of_vocab, [1, 1, 1]),
                              f"sample 1, token 2: id {vocab_size} is outside the vocabulary"),
        "negative token id": (request_for([torch.arange(6), torch.tensor([1, -1])], [1, 1]),
                              "sample 1, token 1: id -1 is outside the vocabulary"),
        "over-long sequence": (request_for(over_long, [1, 1, 1]),
                               f"sample 1: sequence has {MAX_LEN + 1} tokens, max_len is {MAX_LEN}"),
        "too few response_starts": (request_for(good, [1, 1]),
                                    "response_starts has 2 entries but token_ids has 3 samples"),
        "float token ids": (float_ids, "sample 0: token ids must be integers"),
        "torn bytes": (torn, "token_ids.values.data"),
        "missing token_ids": (reference_pb2.ScoreLogProbsRequest(response_starts=[1]), "token_ids.values"),
        "too many tokens": (request_for([torch.arange(256)] * 5, [1] * 5),
                            f"token_ids: the request holds 1280 tokens, max_request_tokens is {MAX_REQUEST_TOKENS}"),
        "too many sequences": (reference_pb2.ScoreLogProbsRequest(
            token_ids=tensor_pb2.RaggedTensor(values=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[0]),
                                              lengths=[0] * 1_000_000), response_starts=[1]),
            "token_ids: the request holds 1000000 sequences, at most 512 fit"),
        # No elements, strides past int64: was INTERNAL ("stride calculation overflowed").
        "overflowing zero-element shape": (reference_pb2.ScoreLogProbsRequest(
            token_ids=tensor_pb2.RaggedTensor(values=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64,
                                                                       shape=[0, 2**62, 2**62]), lengths=[0]),
            response_starts=[1]), "token_ids.values.shape"),
    }


@pytest.mark.parametrize("case", list(_bad_requests(512)))
def test_bad_input_is_invalid_argument_naming_the_sample(stub, hf_model, case):
    vocab_size = hf_model.get_input_embeddings().num_embeddings
    request, message = _bad_requests(vocab_size)[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreLogProbs(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()
    # One bad request fails alone: the service keeps serving.
    sequences, starts = ragged_batch(seed=5, vocab_size=vocab_size, shapes=[(4, 3), (2, 6)])
    check_against_direct(hf_model, sequences, starts, stub.ScoreLogProbs(request_for(sequences, starts), timeout=60),
                         with_entropy=False)


def test_concurrent_callers_each_get_their_own_result(stub, hf_model):
    vocab_size = hf_model.get_input_embeddings().num_embeddings
    callers = 16
    batches = []
    for caller in range(callers):
        generator = torch.Generator().manual_seed(100 + caller)
        shapes = [tuple(int(n) for n in torch.randint(1, 30, (2,), generator=generator))
                  for _ in range(1 + caller % 4)]
        batches.append(ragged_batch(seed=100 + caller, vocab_size=vocab_size, shapes=shapes))
    replies: list = [None] * callers
    errors: list[BaseException] = []
    barrier = threading.Barrier(callers)

    def call(index: int) -> None:
        try:
            sequences, starts = batches[index]
            barrier.wait(timeout=60)
            replies[index] = stub.ScoreLogProbs(request_for(sequences, starts, with_entropy=index % 2 == 0),
                                                timeout=120)
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors
    for index, ((sequences, starts), reply) in enumerate(zip(batches, replies)):
        assert reply.HasField("entropies") == (index % 2 == 0)
        check_against_direct(hf_model, sequences, starts, reply, with_entropy=index % 2 == 0)


def test_unknown_dtype_enum_is_invalid_argument(stub):
    request = reference_pb2.ScoreLogProbsRequest(
        token_ids=tensor_pb2.RaggedTensor(values=tensor_pb2.Tensor(dtype=99, shape=[2], data=b"\x00" * 16),
                                          lengths=[2]),
        response_starts=[1])
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreLogProbs(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids.values.dtype" in err.value.details()


def test_a_full_queue_is_resource_exhausted(tiny_model, tmp_path):
    """Two requests may wait for a forward pass; a third is refused at once, not queued."""
    # The batcher waits a minute for more work: whatever is queued stays queued meanwhile.
    proc = ServiceProcess("reference", ["--model-path", str(tiny_model), "--log-format", "text",
                                        "--max-queued-requests", "2", "--max-wait-ms", "60000",
                                        "--micro-batch-tokens", "100000"])
    proc.start(tmp_path)
    channel = None
    try:
        proc.wait_ready(300)
        channel = grpc.insecure_channel(proc.address)
        stub = reference_pb2_grpc.ReferenceServiceStub(channel)
        request = request_for([torch.arange(6)], [2])
        calls = [stub.ScoreLogProbs.future(request, timeout=300) for _ in range(3)]
        # Refused at once; the bound stays under --max-wait-ms (60 s), past which the two queued calls would
        # run and a third one could be queued.
        refused = wait_for(lambda: [call for call in calls if call.done()], 50, "a call to be refused")
        assert len(refused) == 1
        assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused[0].details()
        assert "max_queued_requests=2" in refused[0].details()
        for call in calls:
            call.cancel()
    finally:
        if channel is not None:
            channel.close()
        proc.stop()
