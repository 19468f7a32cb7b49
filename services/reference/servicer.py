"""ReferenceService gRPC adapter: unpack the request, call the micro-batcher, pack the reply."""

from __future__ import annotations

import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.services.common.server import Service
from rlfleet.services.reference.batcher import MicroBatcher
from rlfleet.v1 import reference_pb2, reference_pb2_grpc
from rlfleet.wire import Ragged, decode_ragged, encode_ragged


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    def __init__(self, batcher: MicroBatcher, model: str, service: Service):
        self.batcher = batcher
        self.model = model
        self.service = service
        """Only its supervision is used: once it failed, every call is refused with the reason."""

    async def ScoreLogProbs(self, request, context):
        self.service.check_working()
        token_ids, starts = request.token_ids, request.response_starts
        # Sized from the message's own counts before anything is built from it.
        self.batcher.check_size(len(token_ids.lengths), token_ids.values.shape[0] if token_ids.values.shape else 0)
        sequences = decode_ragged(token_ids, "token_ids")
        if len(starts) != sequences.batch_size:
            raise InvalidArgument(
                f"response_starts has {len(starts)} entries but token_ids has {sequences.batch_size} samples")
        # Per-sample checks (empty, start range, vocabulary, length) name the sample index.
        scores = await self.batcher.score(sequences.to_list(), list(starts), request.with_entropy)
        response = reference_pb2.ScoreLogProbsResponse(model=self.model)
        encode_ragged(Ragged.from_list(scores.log_probs, torch.float32), out=response.ref_log_probs)
        if request.with_entropy:
            encode_ragged(Ragged.from_list(scores.entropies or [], torch.float32), out=response.entropies)
        return response
