"""An observation as the token ids appended to an episode (token-in / token-out: the model's own tokens are never
re-tokenized; only the observation is).

The chat template decides the text: the rendering of a conversation that ends with the assistant's turn, against the
same conversation plus the observation's message and the next assistant header. What the second adds after the
assistant's end-of-turn token (which the model sampled, and so is already in the episode) is the observation's
context: e.g. ChatML's ``\\n<|im_start|>tool\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``. The template's parts
around the text are tokenized apart from the text, so a per-observation token cap (``max_tokens``) cuts the text only.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from oumi_megatron.environments.base import Observation

_PLACEHOLDER = "\x00OBSERVATION\x00"


class TemplateCannotRender(ValueError):
    """The tokenizer's chat template cannot render an observation after an assistant turn."""


def _template_parts(tokenizer: Any, role: str) -> tuple[str, str]:
    """The template's text before and after an observation's text, after the assistant's end-of-turn token."""
    turn = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    try:
        before = tokenizer.apply_chat_template(turn, tokenize=False)
        after = tokenizer.apply_chat_template([*turn, {"role": role, "content": _PLACEHOLDER}], tokenize=False,
                                              add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises its own types (e.g. templates that refuse unknown roles)
        raise TemplateCannotRender(f"the chat template cannot render a {role!r} message: {e}") from e
    if not isinstance(before, str) or not after.startswith(before) or after.count(_PLACEHOLDER) != 1:
        raise TemplateCannotRender(f"the chat template does not render a {role!r} message as an addition to the "
                                   "conversation before it")
    eos = tokenizer.eos_token or ""
    end = before.rfind("A" + eos)
    cut = end + 1 + len(eos) if end >= 0 else len(before)
    head, tail = after[cut:].split(_PLACEHOLDER)
    return head, tail


@lru_cache(maxsize=16)
def _cached_parts(tokenizer: Any, role: str) -> tuple[list[int], list[int]]:
    head, tail = _template_parts(tokenizer, role)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"] if s else []  # noqa: E731
    return encode(head), encode(tail)


def observation_ids(tokenizer: Any, observation: Observation, max_tokens: int | None = None) -> tuple[list[int], bool]:
    """(the ids to append after the assistant's turn, whether the text was cut to ``max_tokens``)."""
    head, tail = _cached_parts(tokenizer, observation.role)
    text, truncated = inline_ids(tokenizer, observation, max_tokens)
    return [*head, *text, *tail], truncated


def inline_ids(tokenizer: Any, observation: Observation, max_tokens: int | None = None) -> tuple[list[int], bool]:
    """(the ids of the observation's text alone, as is: what continues the assistant's message after a stop string,
    and what a template's message holds; whether the text was cut to ``max_tokens``)."""
    # special tokens' text in an observation (a tool echoing "<|im_end|>") is read as text: a tool cannot end a turn
    ids = tokenizer(observation.text, add_special_tokens=False, split_special_tokens=True)["input_ids"] \
        if observation.text else []
    truncated = max_tokens is not None and len(ids) > max_tokens
    return (ids[:max_tokens] if truncated else ids), truncated


@lru_cache(maxsize=16)
def stop_token_ids(tokenizer: Any, stop_strings: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary's tokens whose text ends with one of ``stop_strings`` (special tokens excepted): where a turn
    stops for an environment's ``stop_strings``. Read once per tokenizer (a decode per token)."""
    if not stop_strings:
        return ()
    special = set(tokenizer.all_special_ids)
    return tuple(i for i in range(len(tokenizer)) if i not in special
                 and tokenizer.decode([i], skip_special_tokens=False).endswith(stop_strings))


def check_renders(tokenizer: Any, role: str = "tool") -> None:
    """``TemplateCannotRender`` when the tokenizer's chat template cannot render an observation (validation)."""
    _template_parts(tokenizer, role)
