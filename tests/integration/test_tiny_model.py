"""The embedded tiny model as the suite uses it: built once into the cache, small, and right
sometimes but far from always (its warm start stops on purpose)."""

from shared.tiny_model import RECIPE, tiny_model_path, tiny_model_report


def test_tiny_model_is_cached_small_and_partly_right(tiny_model):
    from transformers import AutoConfig

    report = tiny_model_report(tiny_model)
    assert report["recipe"] == RECIPE
    # the warm start stops on purpose: right sometimes, far from always
    assert 0.3 <= report["greedy_accuracy"] <= 0.9
    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    weights_mb = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors")) / 2**20
    assert weights_mb < 16  # a few million fp32 parameters at most
    assert tiny_model_path() == tiny_model  # second call: cache hit, same folder
