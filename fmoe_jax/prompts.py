"""Prompts to token ids for `generate`, and the token-id checks `generate` and `forward` share.

A prompt is a string, a list of token ids or a chat conversation (`[{"role": ..., "content": ...}, ...]`,
rendered by the tokenizer's chat template); `generate` takes one prompt or a list of them.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(m, Mapping) for m in value)
    )


def as_prompt_list(prompts: Any) -> list:
    """One prompt (a string, token ids, a conversation) as a batch of one; a batch as a list."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2):
            raise ValueError(f"a token-id array prompt must be [T] or [B, T], got shape {prompts.shape}")
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, str) or _is_conversation(prompts):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts must be a string, a list of token ids, a chat conversation "
            "([{'role': ..., 'content': ...}, ...]) or a list of these; got "
            f"{type(prompts).__name__}: {prompts!r:.80}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass a string, token ids, a conversation or a list of them")
    if all(isinstance(t, numbers.Number) for t in prompts):  # token ids (checked as such later)
        return [list(prompts)]
    return list(prompts)


def check_token_ids(ids: Any, vocab_size: int, what: str) -> np.ndarray:
    """`ids` as an int32 array after checking that every entry is an integer in `[0, vocab_size)`.

    Args:
      ids: array-like of token ids, any shape (a ragged nesting is refused).
      vocab_size: the model's vocabulary.
      what: how an error names `ids` ("prompt 2", "token_ids").
    """
    try:
        array = np.asarray(ids)
    except ValueError:  # NumPy refuses ragged nestings
        raise ValueError(
            f"{what} must be a rectangular array of token ids; its rows differ in length"
        ) from None
    if array.size == 0:  # NumPy makes `[[]]` float64: no value is wrong, the shape is (the caller says)
        return array.astype(np.int32)
    if array.dtype.kind in "iu" and not hasattr(ids, "dtype"):  # NumPy turns a list's True into 1
        bad = next(
            (v for v in np.asarray(ids, dtype=object).ravel() if isinstance(v, (bool, np.bool_))), None
        )
        if bad is not None:
            raise ValueError(f"{what} must hold integer token ids, got {bad!r}")
    if array.dtype == object:
        bad = next((v for v in np.ravel(array) if not _is_token_id(v)), None)
        if bad is not None:
            raise ValueError(f"{what} must hold integer token ids, got {bad!r:.80}")
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        flat = np.ravel(array)
        if array.dtype.kind == "f" and flat.size:
            fractional = flat[np.floor(flat) != flat]
            flat = fractional if fractional.size else flat
        shown = f" such as {flat[0].item()!r}" if flat.size else ""
        raise ValueError(
            f"{what} must hold integer token ids, got {array.dtype} values{shown}; token ids are ints in "
            f"[0, {vocab_size})"
        )
    outside = array[(array < 0) | (array >= vocab_size)]
    if outside.size:
        raise ValueError(
            f"{what} has token ids outside [0, {vocab_size}) (the model's vocabulary): {outside[:5].tolist()}"
        )
    return array.astype(np.int32)


def encode_prompt(model: Any, prompt: Any, index: int) -> list[int]:
    """Token ids of prompt `index` of a batch: tokenized, rendered by the chat template, or checked ids."""
    is_text, is_chat = isinstance(prompt, str), _is_conversation(prompt)
    if is_chat:
        check_conversation(prompt, index)
    if (is_text or is_chat) and model.tokenizer is None:
        raise ValueError(
            f"prompt {index} is {'a string' if is_text else 'a chat conversation'} but the model at "
            f"{model.source} has no tokenizer; pass token-id lists instead"
        )
    if is_text:
        check_text(prompt, f"prompt {index}")
        ids = model.tokenizer(prompt)["input_ids"]
    elif is_chat:
        ids = chat_ids(model, prompt)
    elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, bytes):
        ids = prompt
    else:
        raise ValueError(
            f"prompt {index} must be a string, a list of token ids or a chat conversation, got "
            f"{type(prompt).__name__}: {prompt!r:.80}"
        )
    if len(ids) == 0:
        raise ValueError(f"prompt {index} is empty after tokenization")
    array = check_token_ids(ids, model.config.vocab_size, f"prompt {index}")
    if array.ndim != 1:
        raise ValueError(f"prompt {index} must be a flat list of token ids, got shape {array.shape}")
    return array.tolist()


def chat_ids(model: Any, conversation: Sequence[Mapping[str, Any]]) -> list[int]:
    """A checked conversation rendered by the tokenizer's chat template, the assistant's turn opened."""
    tokenizer = model.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "a prompt is a chat conversation but the tokenizer of {model.source} has no chat "
            "template; set model.tokenizer.chat_template to a Jinja template, or pass the prompt as a string"
        )
    encoded = tokenizer.apply_chat_template(
        list(conversation), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def check_conversation(conversation: Sequence[Mapping[str, Any]], index: int) -> None:
    """ValueError unless every message of prompt `index` has a 'role' string and a 'content', and every
    string in it is text a tokenizer can encode."""
    for i, message in enumerate(conversation):
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(
                f"prompt {index}, message {i} must be a dict with a 'role' string and a 'content', "
                f"got {message!r:.80}"
            )
        for key, value in message.items():
            if isinstance(value, str):
                check_text(value, f"prompt {index}, message {i}, {key!r}")


def check_text(text: str, what: str) -> None:
    """ValueError when `text` cannot be encoded as UTF-8 (a lone surrogate such as '\\ud800', which a
    JSON body's escapes can carry): tokenizers raise a TypeError on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{what} is not valid Unicode text: it holds {text[err.start : err.end]!a} at character "
            f"{err.start}, a lone surrogate; send text encoded as UTF-8"
        ) from None


def encode_prompts(model: Any, prompts: Any) -> list[list[int]]:
    """Token ids of every prompt of `prompts` (one prompt or a list, see `as_prompt_list`)."""
    return [encode_prompt(model, p, i) for i, p in enumerate(as_prompt_list(prompts))]
