"""The learner on the real NF4 + peft tiny model: the PPO clip bites with several mini-batches,
gradients do not depend on the micro-batch size, and state_dict/load_state_dict resume exactly."""

from __future__ import annotations

import pytest
import torch

from learner.actor import Learner, LearnerSpec, build_learner, lora_state_dict, new_step_sums
from shared.config import LearnerConfig, LoraConfig
from shared.types import TrainSample


def _learner(tiny_model, tmp_path, **overrides) -> Learner:
    config = LearnerConfig(warmup_steps=0, **overrides)
    return build_learner(LearnerSpec(str(tiny_model), LoraConfig(rank=4, alpha=8), config, str(tmp_path), seed=0))


def _samples(count: int = 12) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(count):
        prompt = torch.randint(3, 90, (5 + index % 3,), generator=generator).tolist()
        completion = torch.randint(3, 90, (2 + index % 4,), generator=generator).tolist()
        samples.append(TrainSample(prompt, completion, [-3.0] * len(completion), 1.0 if index % 2 else -1.0))
    return samples


def test_several_mini_batches_clip_tokens_and_one_does_not(tiny_model, tmp_path):
    one = _learner(tiny_model, tmp_path / "a", lr=5e-2, mini_batches=1).train_step(_samples(), 1.0)
    four = _learner(tiny_model, tmp_path / "b", lr=5e-2, mini_batches=4).train_step(_samples(), 1.0)
    assert one["learner/clip_frac"] == 0.0  # the ratio is 1 on the only step
    assert four["learner/clip_frac"] > 0.0  # later mini-batches see a moved policy


def test_gradient_does_not_depend_on_the_micro_batch_size(tiny_model, tmp_path):
    grads = []
    for micro_batch in (64, 5, 1):
        learner = _learner(tiny_model, tmp_path / str(micro_batch), micro_batch_size=micro_batch)
        learner.optimizer.zero_grad()
        sums = new_step_sums()
        learner._accumulate_gradients(_samples(), None, 1.0, sums)
        grads.append({name: p.grad.clone() for name, p in zip(lora_state_dict(learner.model), learner.lora_params)})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            assert torch.allclose(other[name], grad, rtol=1e-4, atol=1e-7), name
    assert any(grad.abs().sum() > 0 for grad in grads[0].values())


def test_state_dict_round_trip_continues_bit_for_bit(tiny_model, tmp_path):
    straight = _learner(tiny_model, tmp_path / "a", lr=1e-2)
    straight.train_step(_samples(), 1.0)
    saved = straight.state_dict()
    expected = straight.train_step(_samples(), 1.0)

    resumed = _learner(tiny_model, tmp_path / "b", lr=1e-2)
    resumed.load_state_dict(saved)
    assert resumed.version == 1
    got = resumed.train_step(_samples(), 1.0)
    assert got["learner/loss"] == expected["learner/loss"]
    after, want = lora_state_dict(resumed.model), lora_state_dict(straight.model)
    assert all(torch.equal(after[name], want[name]) for name in want)


def test_state_of_another_rank_is_refused(tiny_model, tmp_path):
    learner = _learner(tiny_model, tmp_path / "a")
    spec = LearnerSpec(str(tiny_model), LoraConfig(rank=8, alpha=16), LearnerConfig(), str(tmp_path / "b"))
    other = build_learner(spec)
    state = other.state_dict()
    state["lora"] = {name.replace("q_proj", "nope"): t for name, t in state["lora"].items()}
    with pytest.raises(ValueError, match="other LoRA tensors"):
        learner.load_state_dict(state)
