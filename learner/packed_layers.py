"""The learner holding exactly the engine's 4-bit weights.

`Int4Linear` and `Nvfp4Linear` keep a compressed-tensors folder's packed tensors as buffers
(int4 `pack-quantized`: int32 words of eight 4-bit codes plus group scales; NVFP4: bytes of two
e2m1 codes, fp8 group scales and a global scale) and dequantize on the fly, the way
compressed-tensors decompresses them (the product rounded in the scales' dtype, the dtype the
engine runs in). Forward and backward go through the `packed_matmul` custom op, which saves only
the packed tensors and rebuilds the weight for dX = dY W, so the learner's memory stays near 4 bits a
weight however many layers a step goes through. peft puts its LoRA on top through its
custom-module hook (`packed_lora_config`): GPTQLoraLinear is a generic base(x) + B(A(x)) layer.
`load_packed_base` also loads W8A8 FP8 folders, into `learner.fp8_layers.Fp8Linear`.

On a GPU the rebuild is one Triton kernel per format (`learner.packed_kernels`; eager PyTorch
spends more time on it than on the GEMM it feeds, and a `torch.compile`d rebuild costs the host
more per call than the device). Its arithmetic is the reference's step for step, so the GPU test
compares the two bit for bit. The CPU runs the reference.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from learner.fp8_layers import Fp8Linear
from learner.quantized_folder import scheme_of

# e2m1 magnitudes by 3-bit code (compressed-tensors' kE2M1ToFloat)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, K/8] -> int8 codes in [-8, 7], [N, K]: code i of a word sits at bits 4i..4i+3,
    stored with +8 (compressed-tensors' pack_to_int32)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :in_features] - 8).to(torch.int8)


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, K/2] -> e2m1 values [N, K]: the low nibble first; bit 3 is the sign."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[(codes & 0x07).long()] * torch.where((codes & 0x08).bool(), -1.0, 1.0)
    return values.to(dtype)


def int4_weight(qweight: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """codes x group scale, in the scales' dtype (compressed-tensors' int4 decompression)."""
    codes = unpack_int4(qweight, in_features).to(scale.dtype)
    return codes * scale.repeat_interleave(group_size, dim=1)


def nvfp4_weight(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 values x fp32 group scale (already divided by the global scale) in fp32, then rounded
    once to `dtype`."""
    return (unpack_e2m1(qweight, torch.float32) * scale.repeat_interleave(16, dim=1)).to(dtype)


def rebuilt_weight(qweight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, in_features: int,
                   group_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight of a packed layer: NVFP4 when it has a global scale, else int4; in
    `dtype` when given (else as compressed-tensors decompresses it: fp32 for NVFP4, the scales'
    dtype for int4). On a GPU one Triton kernel (`learner.packed_kernels`), on the CPU the reference."""
    if global_scale is not None:
        dtype = dtype or torch.float32
        if qweight.is_cuda:
            from learner.packed_kernels import nvfp4_rebuild

            return nvfp4_rebuild(qweight, scale, global_scale, in_features, dtype)
        # the division by the global scale in fp32, as compressed-tensors' _dequantize
        return nvfp4_weight(qweight, scale.to(torch.float32) / global_scale, dtype)
    if qweight.is_cuda:
        from learner.packed_kernels import int4_rebuild

        return int4_rebuild(qweight, scale, in_features, group_size, dtype or scale.dtype)
    # the product is rounded to the scales' dtype first, then to `dtype`: two roundings, as the kernel
    weight = int4_weight(qweight, scale, in_features, group_size)
    return weight if dtype is None else weight.to(dtype)


def _autocast_off(device_type: str):
    """A context with autocast off: autocast's own where it is on, none to enter where it is
    already off (the learner's case, on every packed matmul)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


# x @ W.T with W rebuilt from the packed tensors in forward and again in backward, as custom ops:
# a compiled decoder layer (learner.compile_layers) traces through them without a graph break
# but cannot see inside, so it neither keeps the rebuilt weight for backward (2 bytes a weight:
# the 4-bit memory gone) nor fuses NVFP4's division by the global scale into a kernel that does
# not round as the reference does. Only the packed tensors are saved for backward.
@torch.library.custom_op("qerl::packed_matmul", mutates_args=())
def packed_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                  in_features: int, group_size: int) -> torch.Tensor:
    weight = rebuilt_weight(qweight, scale, global_scale, in_features, group_size, x.dtype)
    with _autocast_off(x.device.type):  # in x's dtype, as the fake below says
        return F.linear(x, weight)


@packed_matmul.register_fake
def _(x, qweight, scale, global_scale, in_features, group_size):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.custom_op("qerl::packed_matmul_input_grad", mutates_args=())
def packed_matmul_input_grad(grad_output: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                             global_scale: torch.Tensor | None, in_features: int, group_size: int) -> torch.Tensor:
    """dX = dY W."""
    weight = rebuilt_weight(qweight, scale, global_scale, in_features, group_size, grad_output.dtype)
    with _autocast_off(grad_output.device.type):
        return grad_output @ weight


@packed_matmul_input_grad.register_fake
def _(grad_output, qweight, scale, global_scale, in_features, group_size):
    return grad_output.new_empty(*grad_output.shape[:-1], in_features)


def _save_packed(ctx, inputs, output) -> None:
    _, qweight, scale, global_scale, ctx.in_features, ctx.group_size = inputs
    ctx.has_global_scale = global_scale is not None
    ctx.save_for_backward(qweight, scale, *((global_scale,) if ctx.has_global_scale else ()))


def _packed_matmul_backward(ctx, grad_output):
    qweight, scale, *global_scale = ctx.saved_tensors
    grad_x = packed_matmul_input_grad(grad_output, qweight, scale, global_scale[0] if global_scale else None,
                                      ctx.in_features, ctx.group_size)
    return grad_x, None, None, None, None, None


packed_matmul.register_autograd(_packed_matmul_backward, setup_context=_save_packed)


def packed_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    out = packed_matmul(x, layer.qweight, layer.scale, getattr(layer, "global_scale", None), layer.in_features,
                        layer.group_size)
    return out if layer.bias is None else out + layer.bias.to(out.dtype)


class Int4Linear(nn.Module):
    """Symmetric int4 weight-only linear layer, group scales (compressed-tensors pack-quantized)."""

    folder_tensors = {"qweight": "weight_packed", "scale": "weight_scale"}
    """Buffer -> the tensor's suffix in a compressed-tensors folder."""

    def __init__(self, in_features: int, out_features: int, group_size: int, scale_dtype: torch.dtype,
                 bias: bool = False, device: str | torch.device = "cpu"):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        # named qweight: peft's LoRA hook looks the base layer's device up under that name
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 8, dtype=torch.int32, device=device))
        self.register_buffer("scale", torch.zeros(out_features, in_features // group_size, dtype=scale_dtype,
                                                  device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return rebuilt_weight(self.qweight, self.scale, None, self.in_features, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self)


class Nvfp4Linear(nn.Module):
    """NVFP4 weight-only linear layer: e2m1 codes, fp8-e4m3 scales per 16 weights, a global scale."""

    group_size = 16
    folder_tensors = {"qweight": "weight_packed", "scale": "weight_scale", "global_scale": "weight_global_scale"}

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device: str | torch.device = "cpu"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn,
                                                  device=device))
        self.register_buffer("global_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return rebuilt_weight(self.qweight, self.scale, self.global_scale, self.in_features, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self)


PACKED_LAYERS = (Int4Linear, Nvfp4Linear, Fp8Linear)


def _replace_linears(model: nn.Module, make) -> list[str]:
    """Swap every nn.Linear but lm_head for `make(linear)`; returns the swapped names."""
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, name, make(child))
                swapped.append(f"{parent_name}.{name}" if parent_name else name)
    return swapped


def load_packed_base(folder: str | Path, device: str = "cpu", compute_dtype: torch.dtype = torch.float32):
    """The causal LM of a compressed-tensors int4/NVFP4/W8A8-FP8 folder, its linear layers kept
    quantized (not decompressed, as transformers would), the other tensors in `compute_dtype`,
    frozen."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = scheme_of(quant)
    group = next(iter(quant["config_groups"].values()))["weights"].get("group_size") or 16
    config.quantization_config = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt", device="cpu") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    scale_dtype = next(t.dtype for n, t in tensors.items() if n.endswith("weight_scale"))

    def packed(linear: nn.Linear) -> nn.Module:
        kwargs = dict(bias=linear.bias is not None, device="cpu")
        if scheme == "nvfp4":
            return Nvfp4Linear(linear.in_features, linear.out_features, **kwargs)
        if scheme == "w8a8":
            return Fp8Linear(linear.in_features, linear.out_features, scale_dtype, **kwargs)
        return Int4Linear(linear.in_features, linear.out_features, group, scale_dtype, **kwargs)

    swapped = _replace_linears(model, packed)
    _fill(model, swapped, tensors, compute_dtype)
    if config.tie_word_embeddings:
        model.tie_weights()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"quantized folder {folder} lacks {left[:3]}")
    model = model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model


def _fill(model: nn.Module, swapped: list[str], tensors: dict[str, torch.Tensor], compute_dtype: torch.dtype) -> None:
    """Copy the folder's tensors into the model: packed ones into the packed layers' buffers,
    the rest as parameters in `compute_dtype`."""
    layers = dict(model.named_modules())
    for name in swapped:
        layer = layers[name]
        for buffer, suffix in layer.folder_tensors.items():
            target = getattr(layer, buffer)
            target.copy_(tensors.pop(f"{name}.{suffix}").reshape(target.shape))
        tensors.pop(f"{name}.weight_shape", None)
        if layer.bias is not None:
            layer.bias.copy_(tensors.pop(f"{name}.bias"))
    state = {name: tensor.to(compute_dtype) for name, tensor in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)
               and not any(m.startswith(f"{s}.") for s in swapped)]
    if missing or unexpected:
        raise ValueError(f"quantized folder does not match its config: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}")
    # the model was built on the meta device: rebuild the modules whose buffers are computed,
    # not stored (rotary tables), for real
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(b is not None and b.is_meta for b in child.buffers(recurse=False)):
                if not type(child).__name__.endswith("RotaryEmbedding"):
                    raise ValueError(f"{type(child).__name__} {name} has uninitialised buffers")
                with torch.device("cpu"):
                    setattr(parent, name, type(child)(config=model.config))


def packed_lora_config(model: nn.Module, rank: int, alpha: int, target_modules: str | list[str]):
    """A peft LoraConfig whose LoRA wraps the packed layers ("all-linear": every packed layer;
    peft's own all-linear finds only nn.Linear)."""
    from peft import LoraConfig
    from peft.tuners.lora.gptq import GPTQLoraLinear

    if target_modules == "all-linear":
        target_modules = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                                 if isinstance(m, PACKED_LAYERS)})
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none")
    config._register_custom_module(dict.fromkeys(PACKED_LAYERS, GPTQLoraLinear))
    return config
