"""TorchRL drop-in: ``RlfleetLLMCollector`` stands in for TorchRL 0.14's ``LLMCollector``.

    from rlfleet.client.torchrl import RlfleetLLMCollector, RlfleetWeightSyncScheme

    collector = RlfleetLLMCollector("collector:50050", dialog_turns_per_batch=32,
                                    policy=train_policy, prompts=primer)    # a DataLoadingPrimer
    for data in collector:                  # lazy stacks in TorchRL's LLM layout
        loss = loss_fn(data)                # GRPOLoss reads them as they are
        ...
        collector.update_policy_weights_()  # pushes train_policy's weights; version += 1

``RlfleetRayLLMCollector`` stands in for ``RayLLMCollector`` (TorchRL's Ray recipes, ``grpo-async.py``):
the same methods, its batch side in a Ray actor when Ray is initialized (``ray`` is imported then only).

TorchRL itself is never imported here: the adapter speaks TensorDict, which both share, so the
SDK installs without it (``pip install rlfleet[torchrl]`` brings the tested TorchRL).
``CorrectedGRPOLoss`` (``rlfleet.client.torchrl.offpolicy``, a ``GRPOLoss`` subclass) is the one
name that needs TorchRL: it is imported on first use.
"""

from rlfleet.client.torchrl.collector import RlfleetLLMCollector, RlfleetWeightSender, RlfleetWeightSyncScheme
from rlfleet.client.torchrl.layout import to_torchrl
from rlfleet.client.torchrl.logits import temperature_scaled
from rlfleet.client.torchrl.policy_weights import policy_state_dict
from rlfleet.client.torchrl.ray_collector import IgnoredArgumentWarning, RlfleetRayLLMCollector

__all__ = ["CorrectedGRPOLoss", "IgnoredArgumentWarning", "RlfleetLLMCollector", "RlfleetRayLLMCollector",
           "RlfleetWeightSender", "RlfleetWeightSyncScheme", "policy_state_dict", "temperature_scaled", "to_torchrl"]


def __getattr__(name: str):
    if name == "CorrectedGRPOLoss":  # subclasses TorchRL's GRPOLoss: import TorchRL only when asked for
        from rlfleet.client.torchrl.offpolicy import CorrectedGRPOLoss

        return CorrectedGRPOLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
