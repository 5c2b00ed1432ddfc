"""An Inductor graph pass for the compiled decoder layers: LoRA's down-projections (`lora_A`)
that read the same input run as one GEMM.

q, k and v read one normed input, and so do gate and up. peft gives each its own `lora_A`, a
GEMM of rank-many output columns: too narrow to fill the GPU's tiles, and each one a launch on a
learner bound by the host's launches, in forward and twice in backward (the input's and the
weight's gradient). Concatenated, the three (two) weights make one wider GEMM whose output is
split back into the per-module products, and autograd's backward of that is one GEMM for the
input's gradient and one for the weights'. Each output column is the same dot product as before;
only the GEMM kernel, and so the order of its sums, may differ.

The pass runs before autograd (Inductor's pre-grad stage) on the graph dynamo traced from a
decoder layer, where a LoRA weight is a graph input named after its module path.
"""

from __future__ import annotations

import hashlib
import operator
from collections import defaultdict
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

LINEAR_OPS = (torch._C._nn.linear, torch.nn.functional.linear)


def _linear_arguments(node: torch.fx.Node) -> tuple | None:
    """(input, weight, bias) of a linear `node`, positional or keyword; None for other nodes."""
    if node.op != "call_function" or node.target not in LINEAR_OPS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    return tuple(node.kwargs.get(name, arg) for name, arg in zip(("input", "weight", "bias"), args))


def _lora_a_weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The weight input of a bias-free linear `node` on a `lora_A` weight, else None."""
    arguments = _linear_arguments(node)
    if arguments is None:
        return None
    _, weight, bias = arguments
    if bias is not None or not isinstance(weight, torch.fx.Node) or weight.op != "placeholder":
        return None
    return weight if "lora_a" in weight.name.lower() else None


def shared_input_groups(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """The `lora_A` linear nodes of `graph` by the input node they read, in graph order; inputs
    read by two or more."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if _lora_a_weight(node) is not None:
            groups[_linear_arguments(node)[0]].append(node)
    return {source: nodes for source, nodes in groups.items() if len(nodes) > 1}


def _example(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def fuse_shared_input_lora_a(graph: torch.fx.Graph) -> int:
    """Rewrite each group of `lora_A` linears on one input as one linear on their concatenated
    weights, split back; returns how many groups were fused."""
    fused = 0
    for source, nodes in shared_input_groups(graph).items():
        weights = [_lora_a_weight(node) for node in nodes]
        examples = [_example(weight) for weight in weights]
        if any(example is None for example in examples) or len({(e.dtype, e.shape[1]) for e in examples}) != 1:
            continue  # unlike weights (or no shape to read): leave them apart
        widths = [int(example.shape[0]) for example in examples]
        with graph.inserting_before(nodes[0]):
            weight = graph.call_function(torch.cat, (weights,), {"dim": 0})
            product = graph.call_function(torch._C._nn.linear, (source, weight, None))
            parts = graph.call_function(torch.split, (product, widths), {"dim": -1})
            outputs = [graph.call_function(operator.getitem, (parts, index)) for index in range(len(nodes))]
        weight.meta["example_value"] = torch.cat(examples, dim=0)
        node_examples = [_example(node) for node in nodes]
        if all(example is not None for example in node_examples):
            product.meta["example_value"] = torch.cat(node_examples, dim=-1)
            parts.meta["example_value"] = tuple(node_examples)
        for node, output in zip(nodes, outputs):
            output.meta.update(node.meta)
            node.replace_all_uses_with(output)
            graph.erase_node(node)
        fused += 1
    if fused:
        from torch._dynamo.utils import counters

        counters["inductor"]["qerl_lora_a_groups_fused"] += fused
    return fused


class FuseSharedInputLoraA(CustomGraphPass):
    """`fuse_shared_input_lora_a` as Inductor's `pre_grad_custom_pass` (the uuid keys Inductor's
    cache of compiled graphs to this file's text)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_shared_input_lora_a(graph)

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
