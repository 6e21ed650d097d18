"""The CPU demo's task: answer with characters of the class the prompt asks for (digits or letters).

Why a tiny random model can learn it from reward alone: the reward is dense (the fraction of the
completion's characters in the asked class, in [0, 1]), so every group of samples has reward variance
from the first step; the policy only has to (1) shift probability mass onto ~10 digit or ~52 letter
byte tokens and (2) condition that choice on one word of the prompt. Both are within reach of a
4-layer, 64-wide transformer in a few hundred updates, and a random model starts near 10/259 (digits)
and 52/259 (letters), far below 1.

Registers, in Oumi's registry, the dataset ``oumi-megatron/char-class`` (local jsonl via dataset_path;
see scripts/make_demo_data.py) and the reward function ``char_class``. Without Oumi (the GPU image)
the functions are used directly.
"""

from __future__ import annotations

from typing import Any

CLASSES = {"digits": str.isdigit, "letters": str.isalpha}


def char_class_score(completion: str, target: str) -> float:
    """Fraction of non-space characters of ``completion`` in class ``target`` (0 if empty)."""
    chars = [c for c in completion if not c.isspace()]
    if not chars:
        return 0.0
    test = CLASSES[target]
    return sum(1 for c in chars if c.isascii() and test(c)) / len(chars)


def char_class_reward(completions: list[str], target: list[str], **kwargs: Any) -> list[float]:
    """TRL-style reward function (one call per batch); ``target`` is the dataset column."""
    return [char_class_score(c, t) for c, t in zip(completions, target)]


def char_class_row(sample: dict[str, Any]) -> dict[str, Any]:
    """A jsonl row ``{"prompt": str, "target": ...}`` as the GRPO loop reads it (chat messages)."""
    return {"prompt": [{"role": "user", "content": sample["prompt"]}], "target": sample["target"]}


def _register_with_oumi() -> None:
    try:
        import oumi.datasets  # noqa: F401 - first, as Oumi's registry does (oumi.core.datasets alone is circular)
    except ImportError:  # engine-only machines (the GPU image): the functions above are used directly
        return
    from oumi.core.datasets import BaseExperimentalGrpoDataset
    from oumi.core.registry import REGISTRY, RegistryType

    if REGISTRY.get_reward_function("char_class") is None:
        REGISTRY.register("char_class", RegistryType.REWARD_FUNCTION, char_class_reward)
    if REGISTRY.get_dataset("oumi-megatron/char-class") is None:

        class CharClassGrpoDataset(BaseExperimentalGrpoDataset):
            """Rows ``{"prompt": str, "target": "digits"|"letters"}`` from a local jsonl (dataset_path)."""

            default_dataset = "oumi-megatron/char-class"

            def transform(self, sample: Any) -> dict:
                return char_class_row(sample)

        REGISTRY.register("oumi-megatron/char-class", RegistryType.DATASET, CharClassGrpoDataset)


_register_with_oumi()
