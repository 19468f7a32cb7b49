"""vLLM worker extension for bench/weights.py: the floor of a weight swap, measured inside the worker.

Passed as ``worker_extension_cls="_floor_ext.FloorExtension"`` (bench/ must be on the engine process's
path); vLLM mixes the class into its worker, so ``self`` is the worker. Called with
``await engine.collective_rpc("bench_floor_load", args=(model_dir,))`` and
``await engine.collective_rpc("bench_floor_reload")``.
"""

from __future__ import annotations

import time
from pathlib import Path


class FloorExtension:
    def bench_floor_load(self, model_dir: str, scale: float = 1.001) -> int:
        """Load the HF checkpoint's tensors into this worker's memory once (scaled, so values change)."""
        import torch
        from safetensors.torch import load_file

        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        with torch.no_grad():
            for tensor in tensors.values():
                if tensor.is_floating_point():
                    tensor.mul_(scale)
        self._bench_floor_weights = sorted(tensors.items())
        return sum(t.numel() * t.element_size() for _, t in self._bench_floor_weights)

    def bench_floor_reload(self) -> float:
        """Seconds of vLLM's own in-place ``reload_weights`` from the tensors already held here."""
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(self._bench_floor_weights), is_checkpoint_format=True)
        return time.perf_counter() - started
