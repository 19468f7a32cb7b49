"""Plain Hugging Face log-probs: the ground truth the services are compared with."""

from __future__ import annotations

import torch


def load_hf(model_dir, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


@torch.inference_mode()
def response_log_probs(model, prompt_ids, response_ids, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token given everything before it."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def perturbed(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state_dict`` plus seeded noise (std 0.05): weights whose log-probs visibly differ."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in state_dict.items()
    }


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir, seed: int, targets=LORA_TARGETS):
    """A trainer's LoRA adapter (peft, rank 8, alpha 16, seeded, lora_B non-zero so that it changes the outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()
