"""The embedded tiny model's tokenizer and its cache key, without building the model."""

from shared.tiny_model import RECIPE, build_tokenizer, recipe_hash


def test_character_tokenizer_round_trips():
    tokenizer = build_tokenizer()
    text = "Question: 12+34=?\nAnswer: 46 \\boxed{46}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_recipe_change_means_a_new_cache_entry():
    assert recipe_hash({**RECIPE, "seed": RECIPE["seed"] + 1}) != recipe_hash(RECIPE)
