from shared.tiny_model import RECIPE, build_tokenizer, recipe_hash, tiny_model_path, tiny_model_report


def test_character_tokenizer_round_trips():
    tokenizer = build_tokenizer()
    text = "Question: 12+34=?\nAnswer: 46 \\boxed{46}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


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


def test_recipe_change_means_a_new_cache_entry():
    assert recipe_hash({**RECIPE, "seed": RECIPE["seed"] + 1}) != recipe_hash(RECIPE)
