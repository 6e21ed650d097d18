"""``TrainerType.MEGATRON_GRPO``: the member oumi-megatron adds to Oumi's closed ``TrainerType`` enum.

Part of the config layer, so that both callers depend on it and not on each other: the integration adds the
member when Oumi's module is imported (integration/oumi_patches.py, through the import hook), and
``MegatronTrainingConfig`` adds it on its own import, for programs that never load the hook.
"""

from __future__ import annotations

from enum import Enum

MEGATRON_GRPO = "MEGATRON_GRPO"
MEGATRON_GRPO_VALUE = "megatron_grpo"


def add_megatron_grpo(trainer_type: type[Enum]) -> None:
    """Adds ``MEGATRON_GRPO`` to Oumi's ``TrainerType`` (idempotent)."""
    if MEGATRON_GRPO in trainer_type.__members__:
        return
    # Enums are closed after class creation; add the member the way EnumType itself records one.
    member = object.__new__(trainer_type)
    member._name_ = MEGATRON_GRPO
    member._value_ = MEGATRON_GRPO_VALUE
    # EnumType sets _sort_order_ on every member (CPython 3.12); typeshed's Enum does not declare it
    member._sort_order_ = len(trainer_type._member_names_)  # type: ignore[attr-defined]
    member.__doc__ = "Megatron-Core GRPO trainer from the oumi-megatron package (TP/PP/CP/EP/DP)."
    type.__setattr__(trainer_type, MEGATRON_GRPO, member)
    trainer_type._member_map_[MEGATRON_GRPO] = member
    trainer_type._value2member_map_[MEGATRON_GRPO_VALUE] = member
    trainer_type._member_names_.append(MEGATRON_GRPO)
