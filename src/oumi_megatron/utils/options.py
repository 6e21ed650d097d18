"""Oumi's option fields (``training.eval_strategy``, ``training.lr_scheduler_type``) hold an enum after Oumi parses
a YAML and a plain string where a config is built in Python (the GPU image has no Oumi): one reader for both."""

from __future__ import annotations


def option_value(option: object, default: str) -> str:
    """The option's string value (an enum's ``.value``, or the string itself); ``default`` when unset."""
    return str(getattr(option, "value", option) or default)
