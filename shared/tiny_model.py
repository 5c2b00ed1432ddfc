"""The embedded default model: a character tokenizer and a tiny Qwen2, warm-started on addition.

Everything is built here, deterministically from a recipe, with no hub access. The result is a
normal Hugging Face model folder that vLLM, transformers and peft load as they are. It is cached
under the user cache directory, keyed by a hash of the recipe, and rebuilt only when missing or
when the recipe changes.

The warm start is short on purpose: the starting policy should be right sometimes, not always,
so that RL has something to improve.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
import time
from pathlib import Path
from random import Random

import torch

from shared.progress import progress
from shared.tasks.addition import make_addition_problem

# The tiny tokenizer's chat template: a system prompt on its own line, then the user's text as it
# is, so a lone user message renders as the raw prompt (the warm start's format: task.chat_template
# auto leaves the demo's prompts unchanged) while tests still go through apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% else %}{{ message['content'] + '<eos>' }}{% endif %}"
    "{% endfor %}"
)
RECIPE = {
    "version": 2,  # 2: the warm start never sees the held-out addition problems
    "chat_template": CHAT_TEMPLATE,
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "digits": 2,
    "warm_start_max_steps": 1500,
    "warm_start_batch": 128,
    "warm_start_lr": 1e-3,
    "warm_start_target_accuracy": 0.3,
    "warm_start_check_every": 10,
    "seed": 1234,
}
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARACTERS = string.printable[:95] + "\n"  # digits, letters, punctuation, space, newline
RECIPE_FILE = "qerl_tiny_recipe.json"


def cache_root() -> Path:
    if os.environ.get("QERL_CACHE_DIR"):
        return Path(os.environ["QERL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qerl"


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def tiny_model_path(recipe: dict = RECIPE, log=print) -> Path:
    """The cached model folder for `recipe`, built first if missing."""
    target = cache_root() / f"tiny-qwen2-{recipe_hash(recipe)}"
    if (target / RECIPE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"[qerl] building the embedded tiny model into {target} (once; about a minute)")
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_tiny_model(staging, recipe, log)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: theirs is as good as ours
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_model_report(folder: Path) -> dict:
    """The build report: recipe, greedy accuracy after the warm start, build seconds."""
    return json.loads((folder / RECIPE_FILE).read_text())


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )


def build_tiny_model(folder: Path, recipe: dict = RECIPE, log=print) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    started = time.time()
    tokenizer = build_tokenizer()
    torch.manual_seed(recipe["seed"])
    config = Qwen2Config(
        vocab_size=recipe["vocab_size"],
        hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"],
        num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"],
        max_position_embeddings=recipe["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).float()
    warm_start(model, tokenizer, recipe, log)
    accuracy = greedy_accuracy(model, tokenizer, Random(recipe["seed"] + 2), recipe["digits"], 512)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    report = {"recipe": recipe, "greedy_accuracy": accuracy, "build_s": round(time.time() - started, 1)}
    (folder / RECIPE_FILE).write_text(json.dumps(report, indent=2))
    params = sum(p.numel() for p in model.parameters())
    log(f"[qerl] tiny model: {params / 1e6:.2f}M params, starting greedy accuracy {accuracy:.0%}")


def _encode_examples(tokenizer, problems, with_answers: bool) -> list[list[int]]:
    texts = [p.prompt + (p.answer if with_answers else "") for p in problems]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [row + [tokenizer.eos_token_id] for row in ids] if with_answers else ids


def warm_start(model, tokenizer, recipe: dict, log=print) -> None:
    """Supervised steps on addition (loss on the answer tokens only) until the greedy accuracy
    on a fixed check set first reaches the target: a model that is right sometimes, not always."""
    rng = Random(recipe["seed"])
    check_rng_seed = recipe["seed"] + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["warm_start_lr"])
    model.train()
    with progress(recipe["warm_start_max_steps"], "warm start") as bar:
        _warm_start_steps(model, tokenizer, recipe, rng, check_rng_seed, optimizer, bar, log)
    model.eval()


def _warm_start_steps(model, tokenizer, recipe: dict, rng: Random, check_rng_seed: int, optimizer, bar,
                      log) -> None:
    for step in range(1, recipe["warm_start_max_steps"] + 1):
        bar.update()
        problems = [make_addition_problem(rng, recipe["digits"]) for _ in range(recipe["warm_start_batch"])]
        rows = _encode_examples(tokenizer, problems, with_answers=True)
        width = max(len(row) for row in rows)
        inputs = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for index, (row, problem) in enumerate(zip(rows, problems)):
            inputs[index, : len(row)] = torch.tensor(row)
            prompt_len = len(problem.prompt)
            labels[index, prompt_len : len(row)] = torch.tensor(row[prompt_len:])
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % recipe["warm_start_check_every"] == 0:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, Random(check_rng_seed), recipe["digits"], 128)
            model.train()
            reached = accuracy >= recipe["warm_start_target_accuracy"]
            if reached or step % 50 == 0:
                log(f"[qerl]   warm start step {step}: loss {loss.item():.3f}, greedy accuracy {accuracy:.0%}")
            if reached:
                break


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rng: Random, digits: int, count: int) -> float:
    """Batched greedy decoding; addition prompts of fixed digits all have the same length."""
    problems = [make_addition_problem(rng, digits) for _ in range(count)]
    ids = torch.tensor(_encode_examples(tokenizer, problems, with_answers=False))
    prompt_len = ids.shape[1]
    for _ in range(digits + 2):
        next_ids = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_ids], dim=1)
    correct = 0
    for problem, row in zip(problems, ids[:, prompt_len:].tolist()):
        answer = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else None
        correct += answer is not None and tokenizer.decode(answer) == problem.answer
    return correct / count
