"""The learner's compiled decoder layers share one graph (`learner.model.compile_decoder_layers`).

A graph per layer costs a compile per layer and, past dynamo's recompile limit, silently runs
the rest eager; a KV cache built during the training forward once did exactly that (each layer
guarded on its own cache entry). dynamo traces a small random Qwen2 of 6 layers on the CPU; the
graphs are what count, so its eager backend stands in for Inductor's kernels."""

from __future__ import annotations

import torch

from learner.logprobs import completion_logprobs
from learner.model import add_lora, compile_decoder_layers


def _small_qwen2(layers: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).requires_grad_(False)


def _compiled_training_pass(model) -> dict:
    """Compile `model`'s 6 decoder layers, run a forward and backward, return dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    assert compile_decoder_layers(model, backend="eager") == 6
    torch._dynamo.reset()
    counters.clear()
    pairs = [([5, 6, 7], [8, 9, 10, 11]), ([5, 6], [8, 9, 10])]
    scores = completion_logprobs(model, pairs, 1.0, pad_id=0)
    (scores.logprobs * scores.mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return counters


def test_all_decoder_layers_run_one_compiled_graph():
    counters = _compiled_training_pass(add_lora(_small_qwen2(layers=6), rank=4, alpha=8, target_modules="all-linear"))
    # the first layer's input carries no gradient, the others' does: two graphs, whatever the depth
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])


def test_fp8_layers_stay_inside_the_one_compiled_graph():
    """The W8A8 learner's fp8 matmuls are custom ops the compiled layer traces through: with them
    as a graph break (as until 2026-12-07) each decoder layer ran as 8 graphs."""
    from peft import get_peft_model

    from learner.fp8_layers import Fp8Linear
    from learner.packed_layers import _replace_linears, packed_lora_config

    def fp8(linear: torch.nn.Linear) -> Fp8Linear:
        layer = Fp8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.qweight.copy_((linear.weight * 100).to(layer.qweight.dtype))
        layer.scale.fill_(0.01)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
        return layer

    model = _small_qwen2(layers=6)
    assert len(_replace_linears(model, fp8)) == 6 * 7
    counters = _compiled_training_pass(get_peft_model(model, packed_lora_config(model, rank=4, alpha=8,
                                                                                target_modules="all-linear")))
    assert counters["frames"]["ok"] == 2 and not counters["graph_break"], (dict(counters["frames"]),
                                                                           dict(counters["graph_break"]))


def test_lora_down_projections_on_one_input_run_as_one_gemm():
    """learner.lora_graph_pass on the graphs dynamo traces from LoRA'd decoder layers: q/k/v's
    and gate/up's lora_A become one linear each (o's and down's read their own inputs and stay),
    and the layers give the gradients of the untouched model."""
    import torch._dynamo

    from learner.lora_graph_pass import LINEAR_OPS, fuse_shared_input_lora_a

    model = add_lora(_small_qwen2(layers=2), rank=4, alpha=8, target_modules="all-linear")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which would hide a wrong A product
                param.normal_(std=0.1)
    pairs = [([5, 6, 7], [8, 9, 10, 11]), ([5, 6], [8, 9, 10])]

    def lora_gradients() -> list[torch.Tensor]:
        model.zero_grad()
        scores = completion_logprobs(model, pairs, 1.0, pad_id=0)
        (scores.logprobs * scores.mask).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    reference = lora_gradients()
    linears_per_graph = []

    def fusing_backend(gm: torch.fx.GraphModule, example_inputs):
        assert fuse_shared_input_lora_a(gm.graph) == 2
        gm.recompile()
        linears_per_graph.append(sum(node.target in LINEAR_OPS for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    for layer in model.get_base_model().get_decoder().layers:
        layer.compile(dynamic=True, backend=fusing_backend)
    fused = lora_gradients()
    # 7 base + 7 lora_B + 4 lora_A (one q/k/v, one gate/up, o's, down's) instead of 21
    assert linears_per_graph and set(linears_per_graph) == {18}, linears_per_graph
    worst = max((a - b).abs().max().item() for a, b in zip(fused, reference))
    assert worst < 1e-5, worst
