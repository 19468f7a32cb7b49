"""vLLM worker extension: in-place weight reload from raw bytes.

vLLM mixes this class into its worker (``worker_extension_cls``), so its
methods run inside the engine process with ``self`` being the worker and are
reached through ``AsyncLLM.collective_rpc("<method name>", args=...)``.

Weights arrive in chunks (``rlfleet_stage_weights``) and are applied in one
``reload_weights`` call (``rlfleet_apply_staged_weights``): vLLM reloads a fused
layer (qkv, gate_up) only once all its pieces are present, and one call keeps
the swap a single step of the engine loop. Method names carry an ``rlfleet_``
prefix because vLLM refuses extension attributes that clash with the worker's.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlfleet.services.generation.weights import WeightTensor, decode_tensor

#: Qualified name to pass as vLLM's ``worker_extension_cls``.
WORKER_EXTENSION_CLS = f"{__name__}.WeightUpdateExtension"


class WeightUpdateExtension:
    """Methods mixed into the vLLM worker; see module docstring."""

    def _rlfleet_staging(self) -> dict[str, WeightTensor]:
        # The worker's __init__ is vLLM's, so the staging area is created lazily.
        staging = getattr(self, "_rlfleet_staged_weights", None)
        if staging is None:
            staging = {}
            self._rlfleet_staged_weights = staging
        return staging

    def rlfleet_stage_weights(self, tensors: Sequence[WeightTensor]) -> int:
        """Keep ``(name, dtype, shape, bytes)`` entries for the next apply.

        Returns the number of tensors staged so far. The caller has validated
        names, shapes and byte lengths against the checkpoint.
        """
        staging = self._rlfleet_staging()
        for name, dtype, shape, data in tensors:
            staging[name] = (name, dtype, tuple(shape), data)
        return len(staging)

    def rlfleet_discard_staged_weights(self) -> None:
        """Drop staged tensors (a push failed or was cancelled half-way)."""
        self._rlfleet_staging().clear()

    def rlfleet_apply_staged_weights(self) -> int:
        """Reload the model in place from the staged tensors; returns their count.

        Uses the worker's ``reload_weights(..., is_checkpoint_format=True)``,
        which maps HF checkpoint names onto vLLM's fused parameters and
        re-runs post-load processing; ``model.load_weights`` alone does not
        work on the CPU backend. The staging area is emptied either way.
        """
        staging = self._rlfleet_staging()
        try:
            # Decode everything before touching the model, so a corrupt entry
            # fails while the old weights are still intact.
            weights = [
                (name, decode_tensor(dtype, shape, data))
                for name, dtype, shape, data in staging.values()
            ]
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            return len(weights)
        finally:
            staging.clear()
