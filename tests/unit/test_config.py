from pathlib import Path

import pytest

from shared.config import QerlConfig, load_config
from shared.errors import QerlError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_configs_folder_is_not_empty():
    assert CONFIGS, "no shipped configs found"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert isinstance(config, QerlConfig)


def test_overrides_apply_with_yaml_types():
    config = load_config(None, ["train.steps=3", "learner.lr=1e-4", "aqn.enabled=false", "model.path=null"])
    assert config.train.steps == 3 and config.learner.lr == 1e-4
    assert config.aqn.enabled is False and config.model.path is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "train.stepz: Extra inputs are not permitted"),
        ("train.steps=many", "train.steps: Input should be a valid integer"),
        ("rollout.num_workers=0", "rollout.num_workers: Input should be greater than or equal to 1"),
        ("task.name=jsonl", "task.path is required"),
        ("steps", "not of the form section.key=value"),
        ("rollout.lora_kernel_configs=/no/such/qerl-folder",
         "rollout.lora_kernel_configs: no such folder"),
        ("rollout.kv_cache_dtype=int4", "rollout.kv_cache_dtype: Input should be 'auto' or 'fp8'"),
    ],
)
def test_bad_config_is_one_line_error(override, message):
    with pytest.raises(QerlError) as error:
        load_config(None, [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(QerlError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(QerlError, match="not valid YAML"):
        load_config(bad)


def test_lora_kernel_configs_folder_is_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["rollout.lora_kernel_configs=kernels"])
    assert config.rollout.lora_kernel_configs == str(tmp_path / "kernels")


@pytest.mark.parametrize(("overrides", "backend"), [
    # a GPU int4 engine with 2 prompts x 8 samples in flight: Marlin (it wins at 16 sequences)
    (["rollout.num_gpus_per_worker=1", "train.prompts_per_step=4", "rollout.num_workers=2"], "marlin"),
    # 16 prompts x 8 = 128 sequences on the one engine: vLLM's own choice (Machete)
    (["rollout.num_gpus_per_worker=1", "train.prompts_per_step=16", "rollout.num_workers=1",
      "rollout.chunk_sequences=128"], "vllm"),
    # the same in chunks of 32 sequences: Marlin
    (["rollout.num_gpus_per_worker=1", "train.prompts_per_step=16", "rollout.num_workers=1",
      "rollout.chunk_sequences=32"], "marlin"),
    # equal slices: 8 prompts x 8 on each of 2 engines
    (["rollout.num_gpus_per_worker=1", "train.prompts_per_step=16", "rollout.dispatch=slices"], "vllm"),
    # CPU workers have one int4 kernel: nothing to choose
    (["train.prompts_per_step=4"], "vllm"),
    # a forced choice is kept whatever the concurrency
    (["rollout.num_gpus_per_worker=1", "train.prompts_per_step=64", "rollout.linear_backend=marlin"], "marlin"),
])
def test_the_linear_kernel_follows_the_engines_concurrency(overrides, backend):
    config = load_config(None, ["policy.format=int4", "rollout.dtype=bfloat16", *overrides])
    assert config.engine_rollout().linear_backend == backend


def test_a_dense_engine_leaves_the_kernel_to_vllm():
    config = load_config(None, ["policy.format=bf16", "rollout.dtype=bfloat16", "rollout.num_gpus_per_worker=1",
                                "train.prompts_per_step=2"])
    assert config.seqs_per_engine() == 16 and config.engine_rollout().linear_backend == "vllm"


def test_an_unknown_linear_backend_is_one_line():
    with pytest.raises(QerlError, match="rollout.linear_backend"):
        load_config(None, ["rollout.linear_backend=cutlass"])


def test_the_cosine_schedule_decays_over_the_run_unless_told_otherwise():
    assert load_config(None, ["train.steps=77"]).learner_settings().decay_steps == 77
    assert load_config(None, ["train.steps=77", "learner.decay_steps=30"]).learner_settings().decay_steps == 30
