"""The learner on the real NF4 + peft tiny model: the PPO clip bites with several mini-batches,
gradients do not depend on the micro-batch size, state_dict/load_state_dict resume exactly, and
the adapter it exports carries peft's names."""

from __future__ import annotations

import math

import pytest
import torch
from train_samples import train_samples

from learner.actor import Learner, LearnerSpec, build_learner, new_step_sums
from shared.config import LearnerConfig, LoraConfig, PolicyConfig
from shared.types import TrainSample


def _learner(tiny_model, tmp_path, **overrides) -> Learner:
    config = LearnerConfig(warmup_steps=0, **overrides)
    return build_learner(LearnerSpec(str(tiny_model), LoraConfig(rank=4, alpha=8), config, str(tmp_path), seed=0))


def _learner_on(tiny_model, base_format: str, **config) -> Learner:
    """A learner on the tiny model loaded in `base_format`, its LoRA drawn from seed 0."""
    from learner.model import add_lora, load_base

    torch.manual_seed(0)
    model = add_lora(load_base(tiny_model, base_format), 4, 8, "all-linear")
    return Learner(model, LearnerConfig(warmup_steps=0, lr=1e-2, **config), torch.bfloat16)



def test_several_mini_batches_clip_tokens_and_one_does_not(tiny_model, tmp_path):
    one = _learner(tiny_model, tmp_path / "a", lr=5e-2, mini_batches=1).train_step(train_samples(), 1.0)
    four = _learner(tiny_model, tmp_path / "b", lr=5e-2, mini_batches=4).train_step(train_samples(), 1.0)
    assert one["learner/clip_frac"] == 0.0  # the ratio is 1 on the only step
    assert four["learner/clip_frac"] > 0.0  # later mini-batches see a moved policy


def test_gradient_does_not_depend_on_the_micro_batch_size(tiny_model, tmp_path):
    grads = []
    for micro_batch in (64, 5, 1):
        learner = _learner(tiny_model, tmp_path / str(micro_batch), micro_batch_size=micro_batch)
        learner.optimizer.zero_grad()
        sums = new_step_sums()
        learner._accumulate_gradients(train_samples(), None, 1.0, sums)
        grads.append({name: p.grad.clone() for name, p in zip(learner.lora.names, learner.lora_params)})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            assert torch.allclose(other[name], grad, rtol=1e-4, atol=1e-7), name
    assert any(grad.abs().sum() > 0 for grad in grads[0].values())


def test_state_dict_round_trip_continues_bit_for_bit(tiny_model, tmp_path):
    straight = _learner(tiny_model, tmp_path / "a", lr=1e-2)
    straight.train_step(train_samples(), 1.0)
    saved = straight.state_dict()
    expected = straight.train_step(train_samples(), 1.0)

    resumed = _learner(tiny_model, tmp_path / "b", lr=1e-2)
    resumed.load_state_dict(saved)
    assert resumed.version == 1
    got = resumed.train_step(train_samples(), 1.0)
    assert got["learner/loss"] == expected["learner/loss"]
    after, want = resumed.lora.state_dict(), straight.lora.state_dict()
    assert all(torch.equal(after[name], want[name]) for name in want)


def test_state_of_another_rank_is_refused(tiny_model, tmp_path):
    learner = _learner(tiny_model, tmp_path / "a")
    spec = LearnerSpec(str(tiny_model), LoraConfig(rank=8, alpha=16), LearnerConfig(), str(tmp_path / "b"))
    other = build_learner(spec)
    state = other.state_dict()
    state["lora"] = {name.replace("q_proj", "nope"): t for name, t in state["lora"].items()}
    with pytest.raises(ValueError, match="other LoRA tensors"):
        learner.load_state_dict(state)


def test_checkpoint_files_round_trip_through_bytes_bit_for_bit(tiny_model, tmp_path):
    """The files a checkpoint holds (safetensors + JSON, no pickle) restore the learner exactly."""
    straight = _learner(tiny_model, tmp_path / "a", lr=1e-2, mini_batches=2)
    straight.train_step(train_samples(), 1.0)
    files = straight.checkpoint_files()
    assert set(files) == {"adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                          "learner_state.safetensors", "learner_state.json"}
    expected = straight.train_step(train_samples(), 1.0)
    resumed = _learner(tiny_model, tmp_path / "b", lr=1e-2, mini_batches=2)
    assert resumed.load_checkpoint_files(files) == 1
    got = resumed.train_step(train_samples(), 1.0)
    assert got["learner/loss"] == expected["learner/loss"] and got["learner/lr"] == expected["learner/lr"]
    after, want = resumed.lora.state_dict(), straight.lora.state_dict()
    assert all(torch.equal(after[name], want[name]) for name in want)


def test_non_finite_loss_skips_the_optimizer_step(tiny_model, tmp_path):
    learner = _learner(tiny_model, tmp_path, lr=1e-2)
    before = {name: t.clone() for name, t in learner.lora.state_dict().items()}
    poisoned = [TrainSample(s.prompt_ids, s.completion_ids, s.rollout_logprobs, float("nan")) for s in train_samples()]
    stats = learner.train_step(poisoned, 1.0)
    assert stats["learner/skipped_steps"] == 1.0 and learner.version == 0
    assert all(torch.equal(t, before[name]) for name, t in learner.lora.state_dict().items())
    assert learner.train_step(train_samples(), 1.0)["learner/skipped_steps"] == 0.0 and learner.version == 1


def test_kl_penalty_uses_the_adapter_off_reference(tiny_model, tmp_path):
    """At a fresh LoRA (B = 0) the policy is the reference: KL 0. After some steps it is not,
    and a KL penalty keeps the policy closer to the base than the same steps without it."""
    drift = {}
    for coef in (0.0, 5.0):
        learner = _learner(tiny_model, tmp_path / str(coef), lr=5e-2, kl_coef=max(coef, 1e-9))
        first = learner.train_step(train_samples(), 1.0)
        assert first["learner/ref_kl"] == pytest.approx(0.0, abs=1e-9)
        for _ in range(4):
            last = learner.train_step(train_samples(), 1.0)
        drift[coef] = last["learner/ref_kl"]
    assert drift[0.0] > 0 and drift[5.0] < drift[0.0]


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model, tmp_path):
    grads = []
    for checkpointing in (False, True):
        learner = _learner(tiny_model, tmp_path / str(checkpointing), gradient_checkpointing=checkpointing)
        learner.optimizer.zero_grad()
        learner._accumulate_gradients(train_samples(), None, 1.0, new_step_sums())
        grads.append({name: p.grad.clone() for name, p in zip(learner.lora.names, learner.lora_params)})
    assert all(torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-8) for name in grads[0])


def test_importance_metrics_are_reported(tiny_model, tmp_path):
    """Rollout logprobs set to the learner's own, minus log 4 on even samples: the ratio
    pi_learner / pi_rollout is 4 there (above the cap 2: truncated) and 1 elsewhere."""
    learner = _learner(tiny_model, tmp_path)
    samples = train_samples()
    own = learner.logprobs([(s.prompt_ids, s.completion_ids) for s in samples], 1.0)
    shifted = [TrainSample(s.prompt_ids, s.completion_ids, [lp - math.log(4) * (i % 2 == 0) for lp in row], s.advantage)
               for i, (s, row) in enumerate(zip(samples, own))]
    stats = learner.train_step(shifted, 1.0)
    tokens = [len(s.completion_ids) for s in samples]
    high = sum(n for i, n in enumerate(tokens) if i % 2 == 0)
    expected_mean = (4 * high + sum(tokens) - high) / sum(tokens)
    assert stats["learner/importance_ratio_mean"] == pytest.approx(expected_mean, rel=1e-4)
    assert stats["learner/importance_ratio_max"] == pytest.approx(4.0, rel=1e-4)
    assert stats["learner/truncated_frac"] == pytest.approx(high / sum(tokens))
    assert stats["learner/lr"] == pytest.approx(1e-3)


def _full_vocabulary_logprobs(model, pairs, temperature):
    """The reference: the whole model's logits at every position, log-softmax, then gather."""
    rows, entropies = [], []
    for prompt, completion in pairs:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
        logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)], dim=-1)
        rows.append(logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1).detach())
    return rows, entropies


@pytest.mark.parametrize("chunk", [2048, 3])
def test_chunked_completion_logprobs_equal_the_full_vocabulary_reference(tiny_model, tmp_path, monkeypatch, chunk):
    """Logits of completion positions only, a few tokens at a time, recomputed in backward and
    turned straight into their gradient: the same logprobs, entropies and gradients as the whole
    model's log-softmax, unpadded row by row."""
    import learner.logprobs as logprobs

    monkeypatch.setattr(logprobs, "LOGIT_CHUNK_TOKENS", chunk)
    learner = _learner(tiny_model, tmp_path)
    with learner.lora.edited() as params:
        for param in params:  # a non-zero adapter, so LoRA takes part
            param.add_(torch.randn_like(param) * 0.05)
    pairs = [(s.prompt_ids, s.completion_ids) for s in train_samples(6)]
    scores = logprobs.completion_logprobs(learner.model, pairs, 0.7, learner.pad_id)
    scores.logprobs.sum().backward()
    chunked = [p.grad.clone() for p in learner.lora_params]
    learner.optimizer.zero_grad()
    reference, reference_entropy = _full_vocabulary_logprobs(learner.model, pairs, 0.7)
    torch.stack([row.sum() for row in reference]).sum().backward()
    for row, entropy, (_, completion), want, want_entropy in zip(scores.logprobs, scores.entropy, pairs, reference,
                                                                 reference_entropy):
        assert torch.allclose(row[: len(completion)], want, atol=1e-5)
        assert torch.allclose(entropy[: len(completion)], want_entropy, atol=1e-4)
        assert torch.all(row[len(completion) :] == 0)
    worst = max(((a - p.grad).abs().max() / p.grad.abs().max()).item() for a, p in zip(chunked, learner.lora_params))
    assert worst < 1e-4, worst
    assert scores.mask.sum() == sum(len(c) for _, c in pairs) and torch.all(scores.entropy >= 0)


def test_step_metrics_report_the_padding_saved_by_sorting(tiny_model, tmp_path):
    stats = _learner(tiny_model, tmp_path, micro_batch_size=4).train_step(train_samples(), 1.0)
    assert 0 <= stats["learner/padding_frac"] < stats["learner/padding_frac_unsorted"]
    assert stats["learner/sequence_tokens"] == sum(len(s.prompt_ids) + len(s.completion_ids) for s in train_samples())


def test_auto_micro_batches_on_a_cpu_use_the_default_size(tiny_model, tmp_path):
    learner = _learner(tiny_model, tmp_path, micro_batch_size="auto", gradient_checkpointing="auto")
    assert (learner.limits.rows, learner.limits.tokens, learner.limits.gradient_checkpointing) == (64, None, False)
    assert math.isfinite(learner.train_step(train_samples(), 1.0)["learner/loss"])


def test_learner_export_names_match_peft(tiny_model, tmp_path):
    from peft import get_peft_model_state_dict

    learner = build_learner(LearnerSpec(str(tiny_model), LoraConfig(rank=4, alpha=8), LearnerConfig(), str(tmp_path)))
    ours, peft_names = learner.lora.state_dict(), get_peft_model_state_dict(learner.model)
    assert ours.keys() == peft_names.keys() and len(ours) > 0
    assert all(torch.equal(ours[name], peft_names[name]) for name in ours)


def test_lora_computes_in_the_bf16_base_dtype_from_fp32_master_weights(tiny_model):
    """On a 16-bit base the LoRA products run in that dtype (peft would cast every layer's
    input up to the fp32 LoRA weights), while the weights, their gradients and the optimizer
    stay fp32; the logprobs agree with an all-fp32 learner holding the same adapter."""
    bf16, fp32 = _learner_on(tiny_model, "bf16"), _learner_on(tiny_model, "fp32")
    with bf16.lora.edited() as mine, fp32.lora.edited() as theirs:
        for ours, reference in zip(mine, theirs):
            ours.copy_(torch.randn_like(ours) * 0.05)
            reference.copy_(ours)
    seen = []
    for name, module in bf16.model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    pairs = [(s.prompt_ids, s.completion_ids) for s in train_samples(6)]
    want = fp32.logprobs(pairs, 1.0)
    got = bf16.logprobs(pairs, 1.0)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    gaps = torch.tensor([abs(a - b) for row, ref in zip(got, want) for a, b in zip(row, ref)])
    # bf16 rounding: the worst token depends on the CPU's bf16 kernels (0.054 with AVX-512 BF16,
    # mean 0.011); dropping the adapter moves the mean by 0.2
    assert gaps.mean() < 0.03 and gaps.max() < 0.1, gaps
    before = [p.detach().clone() for p in bf16.lora_params]
    stats = bf16.train_step(train_samples(), 1.0)
    assert math.isfinite(stats["learner/loss"]) and stats["learner/grad_norm"] > 0
    assert all(p.dtype == torch.float32 and not torch.equal(p, b) for p, b in zip(bf16.lora_params, before))


@pytest.mark.parametrize("policy_format", ["nf4-exact", "int4-dense", "w8a8"])
def test_compiled_decoder_layers_train_as_the_eager_ones(tiny_model, tmp_path, policy_format):
    """learner.compile_layers: the same loss and gradients as eager layers, with gradient
    checkpointing (the compiled layer is recomputed in backward) and micro-batches of several
    widths (dynamic shapes); the packed int4 layers (int4-dense's learner) and the fp8 ones
    (w8a8's) compile into the layer's graph without breaking it."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    results = []
    # a graph compiled for an earlier parameter comes from Inductor's cache, past the graph passes
    with torch._inductor.config.patch(force_disable_caches=True):
        for compiled in (False, True):
            config = LearnerConfig(warmup_steps=0, compile_layers=compiled, micro_batch_size=4,
                                   gradient_checkpointing=True)
            spec = LearnerSpec(str(tiny_model), LoraConfig(rank=4, alpha=8), config, str(tmp_path / str(compiled)),
                               policy=PolicyConfig(format=policy_format))
            learner = build_learner(spec)
            learner.optimizer.zero_grad()
            counters.clear()
            loss = learner._accumulate_gradients(train_samples(), None, 1.0, new_step_sums())
            results.append((loss, [p.grad.clone() for p in learner.lora_params]))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    assert counters["inductor"]["qerl_lora_a_groups_fused"] > 0  # learner.lora_graph_pass ran
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-4, abs=1e-6)
    scale = max(grad.abs().max().item() for grad in eager_grads)
    assert scale > 0
    worst = max((a - b).abs().max().item() for a, b in zip(compiled_grads, eager_grads)) / scale
    assert worst < 1e-4, worst


def test_bf16_compute_copies_train_bit_for_bit_as_autocast_over_fp32_weights(tiny_model, monkeypatch):
    """learner.lora_weights: 16-bit copies refreshed once per optimizer step and the gradients
    summed into the fp32 masters once per micro-batch give the very weights that autocast over
    the fp32 LoRA weights gives (the same rounding, the same fp32 sums in the same order)."""
    import learner.actor as actor

    def trained(copies: bool) -> tuple[list[float], dict[str, torch.Tensor], Learner]:
        if not copies:  # the masters stay in the model, autocast rounds them at every use
            monkeypatch.setattr(actor, "base_compute_dtype", lambda model: torch.float32)
        learner = _learner_on(tiny_model, "bf16", micro_batch_size=3, mini_batches=2)
        monkeypatch.undo()
        losses = [learner.train_step(train_samples(), 1.0)["learner/loss"] for _ in range(3)]
        return losses, learner.lora.state_dict(), learner

    losses, weights, learner = trained(copies=True)
    want_losses, want_weights, reference = trained(copies=False)
    assert learner.lora.split and not reference.lora.split
    assert {p.dtype for p in learner.model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in learner.lora_params)
    assert losses == want_losses
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[name], want_weights[name]) for name in weights)
    assert any(not torch.equal(weights[name], torch.zeros_like(weights[name])) for name in weights if "lora_B" in name)
    # the copies are the masters rounded, so exports and checkpoints (masters) match the model
    copies = {name.replace(".default.", "."): p for name, p in learner.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(copies[name], weights[name].to(torch.bfloat16)) for name in weights)


def test_a_bf16_learner_resumes_bit_for_bit_through_its_compute_copies(tiny_model):
    """load_state_dict writes the fp32 masters and refreshes the 16-bit copies the layers use."""
    straight = _learner_on(tiny_model, "bf16", micro_batch_size=5)
    straight.train_step(train_samples(), 1.0)
    saved = straight.state_dict()
    expected = straight.train_step(train_samples(), 1.0)
    resumed = _learner_on(tiny_model, "bf16", micro_batch_size=5)
    assert resumed.lora.split
    resumed.load_state_dict(saved)
    got = resumed.train_step(train_samples(), 1.0)
    assert got["learner/loss"] == expected["learner/loss"]
    after, want = resumed.lora.state_dict(), straight.lora.state_dict()
    assert all(torch.equal(after[name], want[name]) for name in want)
