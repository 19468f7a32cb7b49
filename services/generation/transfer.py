"""rlfleet's vLLM weight-transfer engine: runs inside every vLLM worker process.

vLLM (0.32) drives weight updates through pluggable engines
(``vllm/distributed/weight_transfer/``): the service calls
``AsyncLLM.start_weight_update`` -> ``update_weights(update_info)`` ->
``finish_weight_update(weight_version)`` and vLLM calls the methods below in
each worker. This engine, registered as ``"rlfleet"`` by the
``vllm.general_plugins`` entry point (``register``) so that it exists in the
engine-core process too, loads from two transports:

- the push's bytes lie in a shared-memory segment (written by the trainer, the
  collector, or the generation service as grpc chunks arrived). The worker
  maps it and loads each tensor from a view of the mapped pages: no pickling,
  no copy besides the one into the model's parameters.
- nccl pushes are first *staged* into such a segment (two-phase, like the
  others): an init info carrying a rendezvous joins the trainer's group
  through vLLM's own ``NCCLWeightTransferEngine``; ``stage_nccl_push`` (a
  ``collective_rpc`` target) receives the broadcast with vLLM's consumers
  and writes it into the segment; the apply then loads from the segment.

The load goes through vLLM's layerwise reload (``initialize_layerwise_reload`` /
``finalize_layerwise_reload`` around ``model.load_weights``), which maps HF
checkpoint names onto fused parameters and re-runs post-load processing.
Floating tensors in another dtype than the engine's (a bf16 trainer, a
float32 engine) are converted one tensor at a time as they are loaded.

A delta push (``changed`` set) loads only the layers holding a changed
tensor: layerwise reload processes a layer once all of its weights arrived,
so each changed tensor brings its whole layer (``loaded_with``: q with k and
v into qkv_proj, gate with up), read from the replica's kept weights; every
other layer keeps its kernel tensors as they are.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

BACKEND = "rlfleet"
#: Passed as vLLM's ``weight_transfer_config``.
WEIGHT_TRANSFER_CONFIG = {"backend": BACKEND}


def register() -> None:
    """``vllm.general_plugins`` entry point: make the ``rlfleet`` backend known (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlfleetWeightTransferEngine")


@dataclass
class RlfleetInitInfo:
    """Init info: empty for shm; ``nccl`` holds vLLM's NCCLWeightTransferInitInfo fields."""

    nccl: dict[str, Any] | None = None


@dataclass
class RlfleetUpdateInfo:
    """One update: every tensor of a push (names, wire dtype names, shapes) and the segment holding them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    shm_path: str = ""
    total_bytes: int = 0
    changed: list[str] | None = None
    """A delta push: the tensors that changed (their layers are loaded); None: load every tensor."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes differ in length")


def _engine_base():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


def layer_of(name: str, packed_modules: dict[str, list[str]]) -> str:
    """The vLLM layer a checkpoint tensor loads into: its module, with the modules vLLM fuses
    (``packed_modules_mapping``: q/k/v_proj -> qkv_proj) named by their fused module."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed_modules.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def loaded_with(names: list[str], changed: list[str], packed_modules: dict[str, list[str]]) -> set[str]:
    """The tensors a delta loads: every tensor of ``names`` in a layer that holds a changed one."""
    layers = {layer_of(name, packed_modules) for name in changed}
    return {name for name in names if layer_of(name, packed_modules) in layers}


class _NothingToLoadFilter(logging.Filter):
    """Drops layerwise reload's "<layer class>: Failed to load weights" for the layers no checkpoint can
    load, and only for them.

    vLLM (0.32, ``reload/layerwise.py``) warns for each layer that received no weight during a reload
    and counts every tensor of a layer as loadable, non-persistent buffers included. A rotary embedding
    holds nothing but such a buffer (``cos_sin_cache``, computed from the config at construction, never
    in a checkpoint, not in ``state_dict``), so every push warned "RotaryEmbedding: Failed to load
    weights" although nothing failed: vLLM puts the layer's own tensors back (``_place_kernel_tensors``),
    the cache unchanged. A layer holding a parameter or a persistent buffer that a push left unloaded
    still warns (a full push carries every checkpoint tensor: ``push_validation``), and so does a rotary
    embedding with learnable parameters (``FourierRotaryEmbedding``)."""

    MESSAGE = "%s: Failed to load weights"

    def __init__(self) -> None:
        super().__init__()
        self.layer_classes: set[str] = set()
        """Class names of the layers whose only tensors are non-persistent buffers."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and record.args and record.args[0] in self.layer_classes)

    def learn(self, model: torch.nn.Module) -> None:
        computed, loadable = set(), set()
        for layer in model.modules():
            params = [p for p in layer._parameters.values() if p is not None]
            buffers = {name for name, b in layer._buffers.items() if b is not None}
            if params or buffers - layer._non_persistent_buffers_set:
                loadable.add(type(layer).__name__)
            elif buffers:
                computed.add(type(layer).__name__)
        self.layer_classes |= computed - loadable


_NOTHING_TO_LOAD = _NothingToLoadFilter()
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def quiet_layers_with_nothing_to_load(model: torch.nn.Module) -> None:
    """Install ``_NothingToLoadFilter`` on layerwise reload's logger for ``model``'s layers (once per process)."""
    _NOTHING_TO_LOAD.learn(model)
    layerwise = logging.getLogger(_LAYERWISE_LOGGER)
    if _NOTHING_TO_LOAD not in layerwise.filters:
        layerwise.addFilter(_NOTHING_TO_LOAD)


@contextmanager
def _quiet_reload():
    """Layerwise reload warns for each layer that loaded nothing, which is every layer a delta leaves."""
    layerwise = logging.getLogger(_LAYERWISE_LOGGER)
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)


def shm_weights(segment_flat: torch.Tensor, update: RlfleetUpdateInfo, target_dtype: torch.dtype | None,
                only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a mapped segment (only those in ``only`` when given), floating
    tensors converted to ``target_dtype``."""
    from rlfleet.wire.dtypes import dtype_from_name
    from rlfleet.wire.shm import view_tensor

    offset = 0
    for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes):
        dtype = dtype_from_name(dtype_name)
        start = offset
        offset += math.prod(shape) * dtype.itemsize
        if only is not None and name not in only:
            continue
        tensor = view_tensor(segment_flat, start, dtype, shape)
        if target_dtype is not None and tensor.is_floating_point() and tensor.dtype != target_dtype:
            tensor = tensor.to(target_dtype)
        yield name, tensor


class SegmentSink:
    """Writes received ``(name, tensor)`` pairs at their offsets in a segment (device -> host)."""

    def __init__(self, flat: torch.Tensor, update: RlfleetUpdateInfo):
        from rlfleet.wire.dtypes import BY_NAME
        from rlfleet.wire.shm import tensor_offsets

        self.flat = flat
        sizes = [math.prod(shape) * BY_NAME[d].itemsize for d, shape in zip(update.dtype_names, update.shapes)]
        self.where = dict(zip(update.names, zip(tensor_offsets(sizes), sizes)))
        self.written = 0

    def __call__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            offset, size = self.where[name]
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if raw.numel() != size:
                raise ValueError(f"{name}: received {raw.numel()} bytes, the manifest says {size}")
            self.flat[offset:offset + size].copy_(raw)
            self.written += size


def receive_broadcast(nccl, update: RlfleetUpdateInfo, sink, device: torch.device) -> None:
    """Receive one push from rank 0 the way vLLM's ``NCCLWeightTransferEngine.receive_weights``
    does (packed buffers or tensor by tensor, as the trainer chose at init), handing each received
    batch of ``(name, tensor)`` pairs to ``sink`` (None: take part without keeping anything)."""
    from rlfleet.wire.dtypes import dtype_from_name

    specs = [(name, (list(shape), dtype_from_name(dtype_name)))
             for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes)]
    keep = sink if sink is not None else (lambda pairs: None)
    if nccl.packed:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        packed_nccl_broadcast_consumer(iterator=iter(specs), group=nccl.model_update_group, src=0,
                                       post_unpack_func=keep, buffer_size_bytes=nccl.packed_buffer_size_bytes,
                                       num_buffers=nccl.packed_num_buffers, device=device)
        return
    stream = torch.cuda.current_stream() if device.type == "cuda" else None
    for name, (shape, dtype) in specs:
        weight = torch.empty(shape, dtype=dtype, device=device)
        nccl.model_update_group.broadcast(weight, src=0, stream=stream)
        keep([(name, weight)])


def stage_nccl_push(worker, update: dict[str, Any]) -> int:
    """``collective_rpc`` target, run in every worker: see ``receive_into_segment``."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, RlfleetWeightTransferEngine):
        raise RuntimeError(f"the worker's weight-transfer engine is {type(engine).__name__}, not rlfleet's")
    return engine.receive_into_segment(RlfleetUpdateInfo(**update))


class RlfleetWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    """See the module docstring."""

    init_info_cls = RlfleetInitInfo
    update_info_cls = RlfleetUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        quiet_layers_with_nothing_to_load(model)
        self._nccl = None
        self._partial = False  # the update being loaded is a delta

    def init_transfer_engine(self, init_info: RlfleetInitInfo) -> None:
        if init_info.nccl is None:
            return
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        if self._nccl is not None:
            self._nccl.shutdown()
        self._nccl = NCCLWeightTransferEngine(self.config, self.vllm_config, self.device, self.model)
        self._nccl.init_transfer_engine(self._nccl.parse_init_info(init_info.nccl))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        partial, self._partial = self._partial, False
        if partial:
            with _quiet_reload():
                finalize_layerwise_reload(self.model, self.model_config)
        else:
            finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: RlfleetUpdateInfo) -> None:
        from rlfleet.wire.shm import open_segment

        segment = open_segment(update_info.shm_path, update_info.total_bytes, trusted=True, populate=True)
        try:
            flat = segment.as_uint8()
            target = self.model_config.dtype if self.model_config is not None else None
            only = None
            if update_info.changed is not None:
                self._partial = True
                packed = dict(getattr(self.model, "packed_modules_mapping", None) or {})
                only = loaded_with(update_info.names, update_info.changed, packed)
            self.model.load_weights(shm_weights(flat, update_info, target, only))
            del flat
        finally:
            segment.close(unlink=False)

    def receive_into_segment(self, update_info: RlfleetUpdateInfo) -> int:
        """Stage an nccl push: receive the trainer's broadcast and write it into the segment.

        Every worker takes part in the broadcast (each is a rank); the first worker of each
        data-parallel group writes. Returns the bytes written here."""
        if self._nccl is None:
            raise RuntimeError("nccl receive before an nccl init_weight_transfer_engine")
        from rlfleet.wire.shm import open_segment

        writer = self.parallel_config.rank == 0
        segment = open_segment(update_info.shm_path, update_info.total_bytes, trusted=True, writable=writer)
        try:
            flat = segment.as_uint8()
            sink = SegmentSink(flat, update_info) if writer else None
            receive_broadcast(self._nccl, update_info, sink, self.device)
            del flat
            return sink.written if sink is not None else 0
        finally:
            segment.close(unlink=False)

    def shutdown(self) -> None:
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None
