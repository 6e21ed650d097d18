"""LoRA from Oumi's own fields: ``training.use_peft: true`` and the ``peft:`` section, resolved once into ``LoraSettings``.

Oumi's ``peft:`` fields that MEGATRON_GRPO honours: ``lora_r``, ``lora_alpha``, ``lora_dropout``,
``lora_target_modules`` and ``peft_save_mode``. Target modules take HF names (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) or Megatron's (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``); Megatron-Core fuses q/k/v into one projection and gate/up into another, so a subset of a fused
projection (``q_proj`` and ``v_proj`` alone, PEFT's default for Llama) takes Megatron-Bridge's canonical LoRA, one
adapter per HF projection. Unset (Oumi's default): every linear layer, as verl and Megatron-Bridge default to.
The other ``peft:`` fields (QLoRA, modules to save, excluded modules, target parameters, a LoRA bias, other
initializations: PiSSA, LoftQ, ...) are refused where they differ from Oumi's defaults, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oumi_megatron.config.problems import Problem

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings

FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
"""Megatron's fused projections and the HF projections they hold."""
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                  "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
CANONICAL = {"q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
             "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2"}
"""Megatron-Bridge's canonical LoRA: an adapter per HF projection."""
MEGATRON_TO_HF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
SAVE_MODES = ("adapter_only", "adapter_and_base_model", "merged")
LORA_SYNCS = ("adapter", "merged")
"""``megatron.lora_sync``'s values; which a rollout mode runs, it declares (rollout/registry.py ``lora_syncs``)."""
NOT_BUILT = {  # Oumi's peft: field -> its default (a value other than it is refused)
    "q_lora": False, "lora_modules_to_save": None, "lora_exclude_modules": None, "lora_target_parameters": None,
    "lora_bias": "none", "lora_init_weights": "default", "lora_task_type": "CAUSAL_LM",
}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA as the engine applies it (Megatron-Bridge's ``LoRA`` / ``CanonicalLoRA``) and the export writes it."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """Megatron module names (Bridge's ``target_modules``)."""
    canonical: bool
    """One adapter per HF projection (``CanonicalLoRA``) instead of one per fused Megatron projection."""
    save_mode: str
    """``adapter_only``, ``adapter_and_base_model`` or ``merged`` (Oumi's ``peft_save_mode``)."""

    def as_json(self) -> dict[str, Any]:
        """As a checkpoint records it (plain JSON types)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "canonical": self.canonical, "save_mode": self.save_mode}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoraSettings:
        return cls(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]), bool(d["canonical"]),
                   str(d["save_mode"]))

    @property
    def hf_targets(self) -> tuple[str, ...]:
        """The HF projections the adapters cover."""
        if self.canonical:
            return tuple(hf for hf, name in CANONICAL.items() if name in self.targets)
        return tuple(hf for name in self.targets for hf in MEGATRON_TO_HF[name])


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # Oumi's enums


def lora_settings(config: Any) -> tuple[LoraSettings | None, list[Problem]]:
    """``config``'s LoRA (None where ``training.use_peft`` is off) and the problems of its ``peft:`` fields."""
    if not getattr(getattr(config, "training", None), "use_peft", False):
        return None, []
    peft = getattr(config, "peft", None)
    if peft is None:
        return None, [Problem("training.use_peft", "is true but the config has no peft: section.")]
    problems = []
    for name, default in NOT_BUILT.items():
        value = _value(getattr(peft, name, default))
        if value not in (default, [], ()):
            problems.append(Problem(f"peft.{name}", f"{value!r} is not built for MEGATRON_GRPO (LoRA on Megatron-Bridge: "
                                    f"lora_r, lora_alpha, lora_dropout, lora_target_modules, peft_save_mode). Leave it at "
                                    f"{default!r}."))
    rank, alpha, dropout = peft.lora_r, peft.lora_alpha, peft.lora_dropout
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(Problem("peft.lora_r", f"must be an integer >= 1 (the adapters' rank), got {rank!r}. Typical: 8-64."))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        problems.append(Problem("peft.lora_alpha", f"must be > 0 (the adapters' scale is alpha / r), got {alpha!r}."))
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        problems.append(Problem("peft.lora_dropout", f"must be in [0, 1), got {dropout!r}."))
    save_mode = str(_value(getattr(peft, "peft_save_mode", "adapter_only")))
    if save_mode not in SAVE_MODES:
        problems.append(Problem("peft.peft_save_mode", f"unknown value {save_mode!r}. Use one of {SAVE_MODES}."))
    targets, canonical, target_problem = _targets(getattr(peft, "lora_target_modules", None))
    if target_problem is not None:
        problems.append(target_problem)
    if problems:
        return None, problems
    return LoraSettings(rank, float(alpha), float(dropout), targets, canonical, save_mode), []


def _targets(names: Any) -> tuple[tuple[str, ...], bool, Problem | None]:
    """(Megatron target modules, canonical or not, a problem) for ``peft.lora_target_modules``."""
    if names is None or list(names) in ([], ["all-linear"], ["all_linear"]):
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), False, None
    known = set(HF_TO_MEGATRON) | set(MEGATRON_TO_HF)
    unknown = [n for n in names if n not in known]
    if unknown:
        return (), False, Problem("peft.lora_target_modules", f"{unknown} are not projections of a transformer layer. "
                                  f"Use HF names {sorted(HF_TO_MEGATRON)} or Megatron's {sorted(MEGATRON_TO_HF)}.")
    hf = {h for n in names for h in (MEGATRON_TO_HF.get(n) or (n,))}
    partial = any(0 < len(hf & set(members)) < len(members) for members in FUSED.values())
    if partial:  # one adapter per HF projection
        return tuple(CANONICAL[h] for h in CANONICAL if h in hf), True, None
    return tuple(m for m, members in MEGATRON_TO_HF.items() if set(members) <= hf), False, None


def check_lora(config: Any, found: Findings) -> None:
    """``training.use_peft`` with ``peft:``: its fields, the layouts LoRA does not run under, ``megatron.lora_sync``
    (what the rollout mode runs of it: rollout/registry.py ``check_lora_sync``)."""
    _, problems = lora_settings(config)
    found.problems.extend(problems)
    found.problems.extend(layout_problems(config))
    if config.megatron.lora_sync not in LORA_SYNCS:
        found.add("megatron.lora_sync", f"unknown value {config.megatron.lora_sync!r}. Use merged (rollouts decode the base "
                                        "with the adapters merged in) or adapter (the base beside the adapter: vLLM engines "
                                        "take the adapter alone at each sync, the embedded backend runs it in its forward).")


def layout_problems(config: Any) -> list[Problem]:
    """What LoRA does not run under (refused at validation, with the reason)."""
    if not getattr(getattr(config, "training", None), "use_peft", False):
        return []
    m = config.megatron
    out = []
    if m.context_parallel_size > 1:
        out.append(Problem("megatron.context_parallel_size", "LoRA under context parallelism is not tested here. Use "
                           "context_parallel_size: 1 with training.use_peft, or full fine-tuning."))
    if m.expert_model_parallel_size > 1:
        out.append(Problem("megatron.expert_model_parallel_size", "LoRA on expert-parallel MoE layers is not tested here. "
                           "Use expert_model_parallel_size: 1 with training.use_peft."))
    if m.pipeline_schedule == "zb_h1":
        out.append(Problem("megatron.pipeline_schedule", "zb_h1 splits each linear layer's weight-gradient GEMM from its "
                           "backward, which LoRA's wrapped layers do not offer. Use 1f1b or interleaved with LoRA."))
    if m.enable_module_queue:
        out.append(Problem("megatron.enable_module_queue", "ModuleQueue offloads layer weights between forward and "
                           "backward; LoRA keeps the base frozen and small adapters, so there is little to gain. Set "
                           "enable_module_queue: false with training.use_peft."))
    if str(m.transformer_config.cuda_graph_impl) == "local":
        out.append(Problem("megatron.transformer_config.cuda_graph_impl", "training CUDA graphs are not tested with "
                           "LoRA's wrapped layers. Set cuda_graph_impl: none with training.use_peft."))
    return out
