"""ReferenceService gRPC adapter: unpack the request, call the micro-batcher, pack the reply."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlfleet.services.common.errors import InvalidArgument
from rlfleet.v1 import reference_pb2, reference_pb2_grpc
from rlfleet.wire import Ragged, decode_ragged, encode_ragged

if TYPE_CHECKING:
    from rlfleet.services.reference.service import ReferenceService


class ReferenceServicer(reference_pb2_grpc.ReferenceServiceServicer):
    def __init__(self, service: ReferenceService):
        self.service = service

    async def ScoreLogProbs(self, request, context):
        token_ids = decode_ragged(request.token_ids, "token_ids")
        starts = list(request.response_starts)
        if len(starts) != token_ids.batch_size:
            raise InvalidArgument(
                f"response_starts has {len(starts)} entries but token_ids has {token_ids.batch_size} samples"
            )
        # Per-sample checks (empty, start range, vocabulary, length) name the sample index.
        scores = await self.service.batcher.score(token_ids.to_list(), starts, request.with_entropy)
        response = reference_pb2.ScoreLogProbsResponse(model=self.service.config.model_path)
        encode_ragged(Ragged.from_list(scores.log_probs, torch.float32), out=response.ref_log_probs)
        if request.with_entropy:
            encode_ragged(Ragged.from_list(scores.entropies or [], torch.float32), out=response.entropies)
        return response
