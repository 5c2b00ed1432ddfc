"""The LoRA weights a learner trains: fp32 masters for the optimizer and, on a 16-bit base, the
copies in the base's dtype that the layers compute with.

Under autocast every layer call would cast each fp32 LoRA weight down and, in backward, its
gradient back up, and autograd would add each gradient into its fp32 sum on its own: three small
kernels per LoRA tensor and micro-batch (hundreds of launches on a 7B model, whose learner is
bound by the host's launches; BENCHMARKS.md has the profile). Here the copies are refreshed once
per optimizer step (one kernel), and a micro-batch's gradients are gathered and added to the fp32
sums in two. The arithmetic is the one autocast does: the weights rounded to the base's dtype,
each micro-batch's gradient computed in it and summed in fp32 in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors


def base_compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the base computes in: its output head's (a 4-bit base keeps that one dense)."""
    return model.get_output_embeddings().weight.dtype


class LoraWeights:
    """The trainable tensors of `model` (peft's LoRA), as masters plus compute copies.

    On construction the masters are moved into one flat fp32 buffer and, when `compute_dtype`
    differs from theirs, `model` gets a Parameter of that dtype in each master's place (views of
    a second flat buffer). After each backward call `fold_gradients`; after the optimizer step
    call `sync_copies`; write the masters anywhere else inside `edited()`.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype):
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        if not named:
            raise ValueError("the model has no trainable (LoRA) parameters")
        self.names = [name for name, _ in named]
        self.masters = [param for _, param in named]
        self._sizes = [param.numel() for param in self.masters]
        self._gradient_sum: torch.Tensor | None = None
        self.split = compute_dtype != self.masters[0].dtype
        if not self.split:  # an fp32 base: autograd sums the gradients into the masters itself
            self.copies = self.masters
            return
        self._master_flat = torch.cat([param.detach().reshape(-1) for param in self.masters])
        for param, view in zip(self.masters, self._master_flat.split(self._sizes)):
            param.data = view.view_as(param)
        self._copy_flat = self._master_flat.to(compute_dtype)
        self.copies = []
        for name, master, view in zip(self.names, self.masters, self._copy_flat.split(self._sizes)):
            copy = nn.Parameter(view.view_as(master))
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, copy)
            self.copies.append(copy)

    def fold_gradients(self) -> None:
        """Add the copies' gradients from the last backward to the masters' fp32 sums."""
        if not self.split:
            return
        grads = [copy.grad for copy in self.copies]
        if all(grad is None for grad in grads):
            return
        # one C++ call flattens them all, not a Python loop of reshapes over every tensor
        flat = _flatten_dense_tensors([grad if grad is not None else torch.zeros_like(copy)
                                       for grad, copy in zip(grads, self.copies)])
        for copy in self.copies:
            copy.grad = None
        if self.masters[0].grad is None:  # the first since zero_grad (ours or the optimizer's)
            self._gradient_sum = flat.to(self._master_flat.dtype)
            for master, view in zip(self.masters, self._gradient_sum.split(self._sizes)):
                master.grad = view.view_as(master)
        else:
            self._gradient_sum.add_(flat)

    def zero_grad(self) -> None:
        """Drop every gradient (masters' sums and any copy's unfolded one)."""
        self._gradient_sum = None
        for param in (*self.masters, *self.copies):
            param.grad = None

    @contextmanager
    def edited(self) -> Iterator[list[nn.Parameter]]:
        """The masters to write in place (no autograd); the compute copies follow on exit. A
        write outside would leave the layers computing with the old weights."""
        with torch.no_grad():
            yield self.masters
        self.sync_copies()

    @torch.no_grad()
    def sync_copies(self) -> None:
        """Round the masters into the compute copies."""
        if self.split:
            self._copy_flat.copy_(self._master_flat)

    def state_dict(self, adapter_name: str = "default") -> dict[str, torch.Tensor]:
        """The masters under peft's saved names (what `get_peft_model_state_dict` returns for a
        plain LoRA), without its walks over every module."""
        return {name.replace(f".{adapter_name}.", "."): master.detach()
                for name, master in zip(self.names, self.masters)}
