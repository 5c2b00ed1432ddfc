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


PAIRS = [([5, 6, 7], [8, 9, 10, 11]), ([5, 6], [8, 9, 10])]  # two lengths: an attention mask


def _compiled_training_pass(model) -> dict:
    """Compile `model`'s 6 decoder layers, run a forward and backward, return dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    assert compile_decoder_layers(model, backend="eager") == 6
    torch._dynamo.reset()
    counters.clear()
    scores = completion_logprobs(model, PAIRS, 1.0, pad_id=0)
    (scores.logprobs * scores.mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return counters


def test_all_decoder_layers_run_one_compiled_graph():
    counters = _compiled_training_pass(add_lora(_small_qwen2(layers=6), rank=4, alpha=8, target_modules="all-linear"))
    # one graph whatever the depth: the embeddings' output is made to carry a gradient like the
    # other layers' inputs (else the first layer compiles a second graph)
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])


def test_a_pass_without_gradients_adds_one_graph_for_all_layers():
    """The old-policy and reference logprobs run under no_grad: dynamo compiles that grad mode once
    more, and for every layer alike (the embeddings' output gets a gradient only where autograd
    records one; else layer 0 would compile a graph of its own there)."""
    model = add_lora(_small_qwen2(layers=6), rank=4, alpha=8, target_modules="all-linear")
    counters = _compiled_training_pass(model)
    with torch.no_grad():
        completion_logprobs(model, PAIRS, 1.0, pad_id=0)
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
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"], (dict(counters["frames"]),
                                                                           dict(counters["graph_break"]))


def test_lora_down_projections_on_one_input_run_as_one_gemm():
    """learner.lora_graph_pass on the graphs dynamo traces from LoRA'd decoder layers: q/k/v's
    and gate/up's lora_A become one linear each (o's and down's read their own inputs and stay),
    so autograd's graphs of a layer hold 3 matmuls fewer in forward and 6 in backward, and the
    layers give the gradients of the unfused ones."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from learner.lora_graph_pass import fuse_shared_input_lora_a

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    pairs = [([5, 6, 7], [8, 9, 10, 11]), ([5, 6], [8, 9, 10])]

    def compiled_layers(fuse: bool) -> tuple[list[torch.Tensor], dict[str, set[int]]]:
        counts: dict[str, set[int]] = {"forward": set(), "backward": set()}

        def counting(side: str):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                counts[side].add(sum(node.target in matmuls for node in gm.graph.nodes))
                return make_boxed_func(gm.forward)
            return compiler

        def backend(gm: torch.fx.GraphModule, example_inputs):
            if fuse:
                assert fuse_shared_input_lora_a(gm.graph) == 2
                gm.recompile()
            return aot_module_simplified(gm, example_inputs, fw_compiler=counting("forward"),
                                         bw_compiler=counting("backward"))

        torch._dynamo.reset()
        model = add_lora(_small_qwen2(layers=2), rank=4, alpha=8, target_modules="all-linear")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:  # peft starts B at zero, which would hide a wrong A product
                    param.normal_(generator=torch.Generator().manual_seed(len(name)), std=0.1)
        for layer in model.get_base_model().get_decoder().layers:
            layer.compile(dynamic=True, backend=backend)
        scores = completion_logprobs(model, pairs, 1.0, pad_id=0)
        (scores.logprobs * scores.mask).sum().backward()
        return [p.grad for p in model.parameters() if p.requires_grad], counts

    unfused, unfused_counts = compiled_layers(fuse=False)
    fused, fused_counts = compiled_layers(fuse=True)
    # forward: 7 base + 7 lora_A + 7 lora_B; backward: the input's gradient of each and the LoRA
    # weights' (the first layer's graph, whose input carries no gradient, has fewer)
    assert unfused_counts == {"forward": {21}, "backward": {29, 35}}, unfused_counts
    assert fused_counts == {"forward": {18}, "backward": {25, 29}}, fused_counts
    worst = max((a - b).abs().max().item() for a, b in zip(fused, unfused))
    assert worst < 1e-5, worst
