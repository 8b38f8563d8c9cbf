"""Prompt text to the token ids the engine takes."""

from __future__ import annotations


def encode_prompt(tokenizer, prompt: str, *, raw: bool = False, system: str | None = None) -> list[int]:
    """Token ids of a prompt, through the model's chat template unless `raw` or it has none."""
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
