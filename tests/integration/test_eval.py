"""Evaluation: `qerl eval` through real vLLM engines agreeing with the learner's own greedy
decoding of the same held-out problems (the held-out split itself: tests/unit/test_eval_input.py)."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.cli import main
from learner.actor import LearnerSpec, build_learner
from shared.config import load_config
from shared.tasks.addition import AdditionTask


def _learner_greedy_accuracy(learner, tokenizer, problems, max_new: int) -> float:
    """Greedy decoding with the learner's model (NF4 base + LoRA), token by token."""
    correct = 0
    with torch.no_grad():
        for problem in problems:
            ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
            out = []
            for _ in range(max_new):
                token = int(learner.model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
                if token == tokenizer.eos_token_id:
                    break
                out.append(token)
            correct += tokenizer.decode(out).strip() == problem.answer
    return correct / len(problems)


@pytest.mark.slow
def test_qerl_eval_matches_the_learners_greedy_decoding(tiny_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    config = load_config("configs/tiny_cpu.yaml", ["train.eval_problems=32", "rollout.num_workers=1"])
    learner = build_learner(LearnerSpec(str(tiny_model), config.lora, config.learner, str(tmp_path / "scratch"),
                                        config.policy, config.engine_dtype(), seed=0))
    # move the adapter off zero so that the eval really serves it
    with learner.lora.edited() as params:
        for param in params:
            param.add_(torch.randn_like(param) * 0.05)
    adapter = learner.save_adapter(str(tmp_path / "adapter"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    problems = AdditionTask(2).held_out(32)
    expected = _learner_greedy_accuracy(learner, tokenizer, problems, config.rollout.max_new_tokens)
    out = tmp_path / "eval.json"
    code = main(["eval", "--config", "configs/tiny_cpu.yaml", "--adapter", adapter, "--json", str(out),
                 "train.eval_problems=32", "rollout.num_workers=1"])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["eval/problems"] == 32 and record["eval/k"] == 4
    assert abs(record["eval/accuracy"] - expected) <= 1 / 32  # one near-tie may flip between kernels
    assert 0 <= record["eval/sampled_accuracy"] <= record["eval/pass_at_k"] <= 1
    assert "[qerl] eval: greedy accuracy" in capsys.readouterr().out
