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
  through vLLM's own ``NCCLWeightTransferEngine``; ``stage_nccl_push`` (a worker
  method ``collective_rpc`` calls by name) receives the broadcast with vLLM's consumers
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
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)

BACKEND = "rlfleet"
#: Passed as vLLM's ``weight_transfer_config``.
WEIGHT_TRANSFER_CONFIG = {"backend": BACKEND}


def register() -> None:
    """``vllm.general_plugins`` entry point: make the ``rlfleet`` backend known, and give vLLM's workers the
    methods the service calls by name (``WORKER_METHODS``; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.worker_base import WorkerBase

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlfleetWeightTransferEngine")
    for name, function in WORKER_METHODS.items():
        if getattr(WorkerBase, name, None) is not function:
            setattr(WorkerBase, name, function)


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
    fingerprints: list[int | None] | None = None
    """Each tensor's fingerprint from the trainer's manifest (None where unset); None: none at all."""
    verify: bool = False
    """Check the engine's parameters after the load against the tensors loaded into them (``LoadCheck``)."""
    watermark_path: str = ""
    """A streamed load: the bytes arrive while it runs, and this ``watermark.Watermark`` says how many have
    (each tensor is read once they passed it; the load stops where a cut push ended). Empty: all are there."""
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
                only: set[str] | None = None, arrived: Callable[[int, int], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a mapped segment (only those in ``only`` when given), floating
    tensors converted to ``target_dtype``. ``arrived(start, end)``: blocks until the segment holds the
    next tensor's bytes, ``start`` to ``end`` (a streamed load), False if it never will (the stream
    ends there)."""
    from rlfleet.wire.dtypes import dtype_from_name
    from rlfleet.wire.shm import view_tensor

    offset = 0
    for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes):
        dtype = dtype_from_name(dtype_name)
        start = offset
        offset += math.prod(shape) * dtype.itemsize
        if only is not None and name not in only:
            continue
        if arrived is not None and not arrived(start, offset):
            return
        tensor = view_tensor(segment_flat, start, dtype, shape)
        if target_dtype is not None and tensor.is_floating_point() and tensor.dtype != target_dtype:
            tensor = tensor.to(target_dtype)
        yield name, tensor


def engine_parameter(name: str, packed_modules: dict[str, list[str]]) -> str:
    """The engine parameter a checkpoint tensor loads into: ``layer_of`` its module, same leaf
    (``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.qkv_proj.weight``)."""
    return f"{layer_of(name, packed_modules)}.{name.rpartition('.')[2]}"


class LoadCheck:
    """Fingerprints (``rlfleet.wire.fingerprint``) of what a load puts into the engine, checked after it.

    ``record`` wraps the ``(name, tensor)`` stream a load reads: each tensor, as loaded, adds its fingerprint
    to its engine parameter's expected one (a fused parameter gets the sum of its parts'): the trainer's
    for a tensor loaded in its pushed dtype (the commit checked its bytes against it; no second read of
    them), its own for one the load converts to the engine's dtype (or one without a trainer's
    fingerprint). ``check`` then reads each expected parameter in the engine: the parameter a load filled
    must hold exactly the trainer's tensors. Only parameters ``calibrate`` found loaded as they are (a copy, or a
    concatenation of checkpoint tensors) are checked: a model whose loader or post-processing transforms
    a weight (quantization, a permutation) keeps the check of the staged bytes for it."""

    def __init__(self, model: torch.nn.Module):
        self.packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        self.checkable: set[str] | None = None
        """Parameters a load copies as they are; None: not calibrated (nothing is checked)."""
        self.expected: dict[str, int] = {}
        self.seconds = 0.0
        """Spent fingerprinting since the last ``check`` (the tensors as they load, then the parameters)."""

    def record(self, weights: Iterator[tuple[str, torch.Tensor]], fingerprints: dict[str, int],
               pushed_dtypes: dict[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
        from rlfleet.wire.fingerprint import MASK, fingerprint

        for name, tensor in weights:
            started = time.perf_counter()
            trainer = fingerprints.get(name)
            if trainer is not None and tensor.dtype == pushed_dtypes.get(name):
                value = trainer  # loaded as pushed, its bytes checked at the commit: the parameter must hold them
            else:
                value = fingerprint(tensor)  # converted to the engine's dtype as it loads (or never fingerprinted)
            key = engine_parameter(name, self.packed)
            self.expected[key] = (self.expected.get(key, 0) + value) & MASK
            self.seconds += time.perf_counter() - started
            yield name, tensor

    def engine(self, model: torch.nn.Module, names: set[str]) -> dict[str, int]:
        """The fingerprints of the engine's parameters among ``names``."""
        from rlfleet.wire.fingerprint import fingerprint

        params = dict(model.named_parameters())
        return {name: fingerprint(params[name]) for name in names if name in params}

    def calibrate(self, model: torch.nn.Module, checkpoint: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        """Which parameters hold exactly what was loaded into them: ``model`` as the checkpoint loaded it,
        against the checkpoint's tensors (as a load converts them)."""
        self.expected.clear()
        for _ in self.record(checkpoint, {}, {}):
            pass
        self.checkable = {name for name, value in self.engine(model, set(self.expected)).items()
                          if value == self.expected[name]}
        skipped = set(self.expected) - self.checkable
        self.expected.clear()
        return skipped

    def check(self, model: torch.nn.Module) -> dict[str, Any]:
        """Compare the engine with what this load recorded, then forget it: ``checked`` (parameters compared),
        ``wrong`` (what differs, named, or "") and ``seconds`` (the fingerprints' CPU, recording included)."""
        from rlfleet.wire.fingerprint import listed

        started = time.perf_counter()
        try:
            found = self.engine(model, self.checkable & set(self.expected)) if self.checkable is not None else {}
            wrong = [f"{name} in the engine ({found[name]:#018x}, the tensors loaded into it make "
                     f"{self.expected[name]:#018x})" for name in sorted(found) if found[name] != self.expected[name]]
            return {"checked": len(found), "wrong": listed(wrong),
                    "seconds": self.seconds + time.perf_counter() - started}
        finally:
            self.expected.clear()
            self.seconds = 0.0


def checkpoint_weights(model_path: str, target_dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in a local checkpoint's safetensors files, floating ones converted
    to ``target_dtype`` (as a push's are loaded). Nothing when ``model_path`` holds none."""
    from pathlib import Path

    from safetensors import safe_open

    for path in sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else ():
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():
                tensor = tensors.get_tensor(name)
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


def _transfer_engine(worker) -> "RlfleetWeightTransferEngine":
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, RlfleetWeightTransferEngine):
        raise RuntimeError(f"the worker's weight-transfer engine is {type(engine).__name__}, not rlfleet's")
    return engine


def calibrate_load_check(worker) -> list[str] | None:
    """Worker method ``rlfleet_calibrate_load_check``, once its model is loaded: see
    ``RlfleetWeightTransferEngine.calibrate_load_check``."""
    return _transfer_engine(worker).calibrate_load_check()


def load_check(worker) -> dict[str, Any] | None:
    """Worker method ``rlfleet_load_check``: what the last load's check found (then forgotten)."""
    return _transfer_engine(worker).take_check()


def stage_nccl_push(worker, update: dict[str, Any]) -> int:
    """Worker method ``rlfleet_stage_nccl_push``: see ``receive_into_segment``."""
    return _transfer_engine(worker).receive_into_segment(RlfleetUpdateInfo(**update))


WORKER_METHODS = {"rlfleet_calibrate_load_check": calibrate_load_check, "rlfleet_load_check": load_check,
                  "rlfleet_stage_nccl_push": stage_nccl_push}
"""Added to vLLM's workers by ``register``: ``collective_rpc`` takes a method's name across processes (a
function of ours would need vLLM's pickle fallback, ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""


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
        self._check: LoadCheck | None = None  # the update being loaded is checked (update_info.verify)
        self._load_check: LoadCheck | None = None  # set up by calibrate_load_check, before any push
        self._checked: dict[str, Any] | None = None  # the last checked load's result, until taken

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
        check, self._check = self._check, None
        if check is not None:  # read by the service (``load_check``): an exception here would wedge vLLM's session
            self._checked = check.check(self.model)

    def take_check(self) -> dict[str, Any] | None:
        """The last checked load's result (``checked``: parameters compared; ``wrong``: what differs, or ""),
        None if none since; forgotten once taken."""
        checked, self._checked = self._checked, None
        return checked

    def calibrate_load_check(self) -> list[str] | None:
        """Set up the check of what each load puts into the engine (``LoadCheck``), calibrated against the
        checkpoint the engine started from (so, before any push); the parameters it cannot check (their
        load transforms them). None with tensor parallelism: each worker then holds a slice of a
        parameter (and copies of some), which no sum of whole tensors describes; only the pushed bytes
        are checked."""
        if self.parallel_config.tensor_parallel_size > 1:
            return None
        check = LoadCheck(self.model)
        target = self.model_config.dtype if self.model_config is not None else None
        skipped = check.calibrate(self.model, checkpoint_weights(self.model_config.model, target))
        self._load_check = check
        return sorted(skipped)

    def receive_weights(self, update_info: RlfleetUpdateInfo) -> None:
        from rlfleet.wire.shm import open_segment

        segment = open_segment(update_info.shm_path, update_info.total_bytes, trusted=True, populate=True)
        watermark = None
        try:
            flat = segment.as_uint8()
            target = self.model_config.dtype if self.model_config is not None else None
            only = None
            if update_info.changed is not None:
                self._partial = True
                packed = dict(getattr(self.model, "packed_modules_mapping", None) or {})
                only = loaded_with(update_info.names, update_info.changed, packed)
            if update_info.watermark_path:
                from rlfleet.services.common.watermark import Watermark

                watermark = Watermark.open(update_info.watermark_path)
            weights = shm_weights(flat, update_info, target, only, watermark.wait_for if watermark else None)
            self._check = self._load_check if update_info.verify else None
            if self._check is not None:
                from rlfleet.wire.dtypes import dtype_from_name

                known = {name: value for name, value in zip(update_info.names, update_info.fingerprints or ())
                         if value is not None}
                pushed = {name: dtype_from_name(d) for name, d in zip(update_info.names, update_info.dtype_names)}
                weights = self._check.record(weights, known, pushed)
            self.model.load_weights(weights)
            del flat, weights
        finally:
            if watermark is not None:
                watermark.close()
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
