"""Learner side: NF4 base + peft LoRA, logprobs, advantages, losses, adapter export."""
