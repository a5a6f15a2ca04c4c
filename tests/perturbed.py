"""A LoRA adapter for backend tests: its B weights are perturbed, so it changes the outputs."""

from __future__ import annotations

from pathlib import Path

import torch


def perturbed_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """Save to ``out`` a rank-4 q/v LoRA adapter on the model in ``model_dir`` with random B weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    # peft draws lora_A from the global RNG: seed it, without moving it for the tests after this one
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5)  # LoRA starts as the identity (B = 0): move it off
    model.save_pretrained(out)  # adapter "default": saved at the folder's top level
    return out
