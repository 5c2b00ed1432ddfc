"""`qerl eval` refuses an adapter that does not fit the model, before any engine starts (vLLM
would load it and report an accuracy). Real peft adapter folders on the embedded tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deploy.adapter_fit import check_adapter_fits
from deploy.cli import main
from shared.errors import QerlError


@pytest.fixture(scope="module")
def peft_adapter(tiny_model, tmp_path_factory):
    """A rank-4 peft LoRA of the tiny model's attention and MLP projections, saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets)).save_pretrained(folder)
    return folder


def test_a_peft_adapter_of_the_model_fits(peft_adapter, tiny_model):
    check_adapter_fits(peft_adapter, tiny_model)


def _edited(peft_adapter, tmp_path, tensors=None, config=None):
    folder = tmp_path / "edited"
    shutil.copytree(peft_adapter, folder)
    if tensors:
        weights = load_file(str(folder / "adapter_model.safetensors"))
        save_file(tensors(weights), str(folder / "adapter_model.safetensors"))
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    return folder


def test_wrong_tensor_shapes_are_refused(peft_adapter, tiny_model, tmp_path):
    def widen(weights):
        return {k: (v.repeat(1, 2) if "q_proj.lora_A" in k else v) for k, v in weights.items()}

    expected = r"q_proj.lora_A.weight has shape \[4, 256\], the model's q_proj needs \[4, 128\]"
    with pytest.raises(QerlError, match=expected):
        check_adapter_fits(_edited(peft_adapter, tmp_path, tensors=widen), tiny_model)


def test_a_rank_that_disagrees_with_adapter_config_is_refused(peft_adapter, tiny_model, tmp_path, capsys):
    folder = _edited(peft_adapter, tmp_path, config=lambda c: {**c, "r": 8})
    code = main(["eval", "--config", "configs/tiny_cpu.yaml", "--adapter", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "has rank 4, its adapter_config.json says r=8" in err[0]
