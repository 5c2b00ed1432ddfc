"""The Learner: one process holding the base (NF4 by default) with a peft LoRA and its optimizer.

Used as a Ray actor by the driver; a plain class so tests can also use it in-process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from learner.logprobs import completion_logprobs
from learner.losses import aggregate, policy_loss_terms
from learner.model import add_lora, export_rollout_base, load_base
from shared.adapter_payload import encode_adapter
from shared.config import LearnerConfig, LoraConfig
from shared.types import AdapterUpdate, TrainSample

_ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Learner:
    def __init__(
        self,
        model_path: str,
        lora: LoraConfig,
        config: LearnerConfig,
        run_dir: str,
        rollout_dtype: str = "float32",
        seed: int = 0,
        device: str = "cpu",
    ):
        torch.manual_seed(seed)
        base = load_base(model_path, config.base_format, device, compute_dtype=_ROLLOUT_DTYPES[rollout_dtype])
        self.rollout_base_path = str(
            export_rollout_base(base, model_path, Path(run_dir) / "rollout_base", _ROLLOUT_DTYPES[rollout_dtype])
        )
        self._attach_lora(base, lora, config)
        self.adapter_dtype = _ROLLOUT_DTYPES[rollout_dtype]

    @classmethod
    def from_base(cls, base, lora: LoraConfig, config: LearnerConfig) -> Learner:
        """A learner around an already built base (benchmarks with random weights)."""
        learner = cls.__new__(cls)
        learner.rollout_base_path = None
        learner.adapter_dtype = torch.float32
        learner._attach_lora(base, lora, config)
        return learner

    def _attach_lora(self, base, lora: LoraConfig, config: LearnerConfig) -> None:
        self.config = config
        self.pad_id = base.config.pad_token_id or 0
        self.model = add_lora(base, lora.rank, lora.alpha, lora.target_modules)
        self.lora_params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (config.warmup_steps + 1))
        )
        self.version = 0

    def rollout_base(self) -> str:
        return self.rollout_base_path

    def train_step(self, samples: list[TrainSample], temperature: float) -> dict[str, float]:
        """One optimizer step over `samples`, in micro-batches; returns flat metrics."""
        started = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_seqs = len(samples)
        total_tokens = sum(len(s.completion_ids) for s in samples)
        sums = {"loss": 0.0, "entropy": 0.0, "kl": 0.0, "tis": 0.0, "clipped": 0.0, "max_diff": 0.0}
        for first in range(0, total_seqs, self.config.micro_batch_size):
            chunk = samples[first : first + self.config.micro_batch_size]
            scores = completion_logprobs(
                self.model, [(s.prompt_ids, s.completion_ids) for s in chunk], temperature, self.pad_id
            )
            rollout = _padded([s.rollout_logprobs for s in chunk], scores.mask.shape).to(scores.mask.device)
            advantages = torch.tensor([s.advantage for s in chunk], device=scores.mask.device)
            old = scores.logprobs.detach()
            per_token, weight, clipped = policy_loss_terms(
                scores.logprobs, old, rollout, advantages, self.config.clip_eps, self.config.tis_cap
            )
            loss = aggregate(per_token, scores.mask, self.config.loss_agg, total_seqs, total_tokens)
            loss.backward()
            mask = scores.mask
            log_ratio = old - rollout  # log pi_learner / pi_rollout on rollout samples
            sums["loss"] += loss.item()
            sums["entropy"] += (scores.entropy * mask).sum().item()
            sums["kl"] += (((log_ratio.exp() - 1) - log_ratio) * mask).sum().item()
            sums["tis"] += (weight * mask).sum().item()
            sums["clipped"] += (clipped * mask).sum().item()
            sums["max_diff"] = max(sums["max_diff"], (log_ratio.abs() * mask).max().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.lora_params, self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        tokens = max(total_tokens, 1)
        return {
            "learner/loss": sums["loss"],
            "learner/entropy": sums["entropy"] / tokens,
            "learner/grad_norm": float(grad_norm),
            "learner/tis_weight_mean": sums["tis"] / tokens,
            "learner/clip_frac": sums["clipped"] / tokens,
            "learner/tokens": float(total_tokens),
            "learner/step_ms": (time.perf_counter() - started) * 1e3,
            "mismatch/kl": sums["kl"] / tokens,
            "mismatch/max_abs_logprob_diff": sums["max_diff"],
        }

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
        return json.loads(json.dumps(config, default=lambda value: sorted(value) if isinstance(value, set) else str(value)))

    def save_adapter(self, folder: str) -> str:
        self.model.save_pretrained(folder)
        return folder

    def parameters_snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of the LoRA parameters and of the (packed) base weights, for tests."""
        lora, base = {}, {}
        for name, param in self.model.named_parameters():
            (lora if param.requires_grad else base)[name] = param.detach().cpu().clone()
        return {"lora": lora, "base": base}


def lora_state_dict(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The trainable LoRA tensors under peft's saved names (what `get_peft_model_state_dict`
    returns for a plain LoRA), without its walks over every module and, on an NF4 base, the
    packing of every quantization state: those cost tens of ms per export."""
    return {
        name.replace(f".{adapter_name}.", "."): param.detach()
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def _padded(rows: list[list[float]], shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row)
    return out
