"""The one prompt encoder (shared/prompts.py) on the embedded tiny model's real tokenizer and its
chat template: what training, evaluation and the benchmarks send the engines."""

from __future__ import annotations

import pytest

from shared.config import TaskConfig, load_config
from shared.errors import QerlError
from shared.prompts import prompt_encoder
from shared.tiny_model import CHAT_TEMPLATE, build_tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_tiny_template_keeps_the_demo_prompts_and_adds_a_system_line(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)  # the template travels with the model folder
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    auto = prompt_encoder(loaded, TaskConfig())
    assert auto.chat  # "auto": the tokenizer has a template
    assert auto.encode(["12+34="]) == [_ids(loaded, "12+34=")]  # the warm start's format, unchanged
    system = prompt_encoder(loaded, TaskConfig(system_prompt="Add."))
    assert system.text("12+34=") == "Add.\n12+34="
    assert system.encode(["1+2=", "3+4="]) == [_ids(loaded, "Add.\n1+2="), _ids(loaded, "Add.\n3+4=")]


def test_chat_template_false_sends_the_raw_text():
    tokenizer = build_tokenizer()
    raw = prompt_encoder(tokenizer, TaskConfig(chat_template=False))
    assert not raw.chat and raw.text("Q: 1+2=") == "Q: 1+2="


def test_impossible_template_settings_are_one_line_errors():
    bare = build_tokenizer()
    bare.chat_template = None
    assert not prompt_encoder(bare, TaskConfig()).chat  # auto without a template: the raw text
    with pytest.raises(QerlError, match="task.chat_template is true but the model's tokenizer has no chat template"):
        prompt_encoder(bare, TaskConfig(chat_template=True))
    with pytest.raises(QerlError, match="task.system_prompt needs a chat template"):
        prompt_encoder(build_tokenizer(), TaskConfig(chat_template=False, system_prompt="Be brief."))


def test_chat_template_setting_takes_yaml_booleans_and_auto():
    assert load_config(None, ["task.chat_template=true"]).task.chat_template is True
    assert load_config(None, ["task.chat_template=false"]).task.chat_template is False
    assert load_config(None, []).task.chat_template == "auto"
    with pytest.raises(QerlError, match="task.chat_template"):
        load_config(None, ["task.chat_template=sometimes"])
