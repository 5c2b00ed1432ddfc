"""The one prompt encoder: a task's prompt text to the token ids the engines generate from.

Training rollouts, evaluation and the benchmarks all encode through `PromptEncoder`, so a model
is prompted the same way everywhere. With a chat template the prompt becomes one user message
(after task.system_prompt, when set) rendered with the generation prompt; without one, the raw
text. Special tokens come only from the template: a template that writes its own BOS would
otherwise get a second one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import TaskConfig
from shared.errors import QerlError


@dataclass(frozen=True)
class PromptEncoder:
    tokenizer: object
    chat: bool
    """Render through the tokenizer's chat template (task.chat_template resolved)."""
    system_prompt: str | None = None

    def text(self, prompt: str) -> str:
        """What the model sees, as text."""
        if not self.chat:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer([self.text(p) for p in prompts], add_special_tokens=False)["input_ids"]


def prompt_encoder(tokenizer, task: TaskConfig) -> PromptEncoder:
    """The encoder task.chat_template asks for; a one-line error where the tokenizer cannot do it."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if task.chat_template is True and not has_template:
        raise QerlError("task.chat_template is true but the model's tokenizer has no chat template "
                        "(set task.chat_template: false to prompt with the raw text)")
    chat = has_template if task.chat_template == "auto" else task.chat_template
    if task.system_prompt and not chat:
        raise QerlError("task.system_prompt needs a chat template (the model's tokenizer has none, or "
                        "task.chat_template is false)")
    return PromptEncoder(tokenizer, chat, task.system_prompt)


def load_prompt_encoder(model_path: str, task: TaskConfig) -> PromptEncoder:
    from transformers import AutoTokenizer

    return prompt_encoder(AutoTokenizer.from_pretrained(model_path), task)
