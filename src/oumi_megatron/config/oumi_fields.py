"""Oumi's own training fields, honoured by MEGATRON_GRPO (the design document's Migration Guide).

A config migrated from TRL_GRPO / VERL_GRPO keeps Oumi's names for what MEGATRON_GRPO also has. They
are taken over once, right after the config is loaded (and again, idempotently, by validation):

| Oumi field                                              | MEGATRON_GRPO field                           |
| ------------------------------------------------------- | --------------------------------------------- |
| training.reward_functions (+ reward_function_kwargs)    | grpo.reward_functions                         |
| training.grpo.{num_generations, temperature, epsilon,   | grpo.<same name>                              |
|   max_prompt_length, max_completion_length,             |                                               |
|   log_completions}                                      |                                               |
| training.grpo.use_vllm / vllm_mode / vllm_gpu_memory_.. | megatron.inference_backend: vllm /            |
|                                                         |   rollout_placement / vllm_gpu_memory_util..  |
| training.enable_gradient_checkpointing                  | megatron.transformer_config: full recompute   |
| training.verl_config_overrides (keys with an equivalent)| grpo: / megatron: (see ``VERL_KEYS``)         |
| data.train dataset_name ``gsm8k`` / ``countdown``       | ``openai/gsm8k`` (subset main) / ``d1shs0ap/countdown`` |
| no reward function at all                               | the dataset's own reward (gsm8k -> gsm8k, ...) |
| data.validation + training.eval_strategy / eval_steps   | held-out eval during training (trainer/evaluation.py) |

Which wins: a field written in the ``megatron:`` / ``grpo:`` sections wins. An Oumi field fills the
MEGATRON_GRPO field only where those sections leave it unset; where both are set to different values
the config is rejected, naming both fields. Among Oumi's fields, ``verl_config_overrides`` win over
``training.grpo`` (as they do for VERL_GRPO). Oumi fields that have no meaning here and are set
(verl keys without an equivalent) are named in a warning; those that would change the
result and cannot be honoured (a non-Adam optimizer, repetition_penalty) are rejected. ``training.use_peft`` with the
``peft:`` section is LoRA (config/lora.py).

"Set" means written in the YAML or on the command line (``explicit_keys``); for configs built in
Python, a value different from the field's default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oumi_megatron.utils.options import option_value

if TYPE_CHECKING:
    from oumi_megatron.config.training_config import MegatronTrainingConfig

# Oumi's GrpoParams fields with the same meaning in our grpo: section.
SHARED_GRPO_FIELDS = ("num_generations", "temperature", "epsilon", "max_prompt_length", "max_completion_length",
                      "log_completions")

DATASET_ALIASES = {"gsm8k": ("openai/gsm8k", "main"), "countdown": ("d1shs0ap/countdown", None)}
"""Short names a user may write (the design document's Quick Start uses ``gsm8k``) -> Oumi's dataset."""

DEFAULT_REWARDS = {
    "openai/gsm8k": "gsm8k",
    "d1shs0ap/countdown": "countdown",
    "oumi-ai/oumi-letter-count": "count_letters",
    "oumi-ai/oumi-letter-count-clean": "count_letters",
    "oumi-megatron/char-class": "char_class",
}
"""A dataset's natural reward, used when no reward function is configured (verl picks by data source)."""

VERL_KEYS: dict[str, str] = {
    "data.max_prompt_length": "grpo.max_prompt_length",
    "data.max_response_length": "grpo.max_completion_length",
    "actor_rollout_ref.rollout.n": "grpo.num_generations",
    "actor_rollout_ref.rollout.temperature": "grpo.temperature",
    "actor_rollout_ref.rollout.top_p": "grpo.top_p",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "megatron.vllm_gpu_memory_utilization",
    "actor_rollout_ref.actor.ppo_epochs": "grpo.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio": "grpo.epsilon",
    "actor_rollout_ref.actor.clip_ratio_low": "grpo.epsilon",
    "actor_rollout_ref.actor.clip_ratio_high": "grpo.epsilon_high",
    "actor_rollout_ref.actor.clip_ratio_c": "grpo.clip_ratio_c",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "megatron.micro_batch_size",
    "algorithm.norm_adv_by_std_in_grpo": "grpo.scale_rewards",
    "algorithm.filter_groups.enable": "grpo.dynamic_sampling",  # groups compared by their summed reward
    "algorithm.filter_groups.max_num_gen_batches": "grpo.dynamic_sampling_max_rounds",
}
"""verl keys with a one-to-one equivalent. Handled separately (they combine several keys): the batch
sizes (data.train_batch_size, actor.ppo_mini_batch_size), the KL loss (actor.use_kl_loss,
kl_loss_coef, kl_loss_type) and actor.loss_agg_mode."""

_VERL_KL = {"kl": "k1", "k1": "k1", "abs": None, "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_VERL_AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean",
             "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}
_ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw", "adam", "adamw_hf", "adamw_apex_fused")


@dataclass
class Adoption:
    """What was taken over (notes), ignored (warnings) or cannot be honoured (problems: field, message)."""

    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def _flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": leaf}`` (lists are leaves; empty dicts have none)."""
    flat: dict[str, Any] = {}
    for k, v in node.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            flat.update(_flatten(v, path))
        else:
            flat[path] = v
    return flat


def explicit_keys(raw_yaml: dict[str, Any], overrides: list[str]) -> set[str]:
    """Dotted paths written in the YAML or given as ``a.b=v`` overrides, with all their prefixes."""
    paths = [*_flatten(raw_yaml), *(arg.lstrip("-").split("=", 1)[0] for arg in overrides)]
    keys: set[str] = set()
    for path in paths:
        parts = path.split(".")
        keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return keys


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _set(obj: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class _Adopter:
    def __init__(self, config: MegatronTrainingConfig, explicit: set[str] | None) -> None:
        self.config = config
        self.explicit = explicit
        self.out = Adoption()
        self.filled: set[str] = set()  # our fields filled from an Oumi field here (a later source may refill them)

    def is_set(self, path: str, cls: type, name: str) -> bool:
        """Written in the YAML / overrides; without that record, different from the default."""
        if path in self.filled:
            return False
        if self.explicit is not None:
            return path in self.explicit
        return _get(self.config, path) != _default(cls, name)

    def ours_set(self, path: str) -> bool:
        from oumi_megatron.config.grpo_params import MegatronGrpoParams
        from oumi_megatron.config.megatron_params import MegatronParams, MegatronTransformerConfig

        section, *rest = path.split(".")
        sections: dict[str, type[Any]] = {"grpo": MegatronGrpoParams, "megatron": MegatronParams}
        cls = sections[section]
        if rest[0] == "transformer_config":
            cls, rest = MegatronTransformerConfig, rest[1:]
        return self.is_set(path, cls, rest[-1])

    def take(self, target: str, value: Any, source: str) -> None:
        """``target`` (ours) <- ``value`` from Oumi's ``source``, unless ours is set: then it wins, and a
        different value is a conflict."""
        current = _get(self.config, target)
        if self.ours_set(target):
            if current != value:
                self.out.problems.append((target, f"is {current!r} but {source} is {value!r}; set one of them "
                                                  f"(or both to the same value)."))
            return
        if current != value:
            _set(self.config, target, value)
            self.out.notes.append(f"{target} = {value!r} (from {source})")
        self.filled.add(target)

    # -- the mappings -------------------------------------------------------------------------------
    def reward_functions(self) -> None:
        from oumi_megatron.config.grpo_params import RewardFunctionParams

        t = self.config.training
        # Oumi rejects training.reward_functions for this trainer type while building the config, so the
        # loader takes them out of the YAML first (integration/oumi_patches.py) and leaves them here
        taken = self.config.__dict__.get("_training_rewards") or {}
        given = taken.get("reward_functions") or t.reward_functions or []
        names = [n for n in ([given] if isinstance(given, str) else given) if n]  # one name may come as a string
        if names:
            kwargs = dict(taken.get("reward_function_kwargs") or t.reward_function_kwargs or {})
            wanted = [RewardFunctionParams(name=n, kwargs=dict(kwargs)) for n in names]
            ours = self.config.grpo.reward_functions
            if ours and [(r.name, dict(r.kwargs)) for r in ours] != [(r.name, r.kwargs) for r in wanted]:
                self.out.problems.append((
                    "grpo.reward_functions",
                    f"and training.reward_functions ({names}) both name reward functions; keep one list "
                    "(grpo.reward_functions also takes weights).",
                ))
            elif not ours:
                self.config.grpo.reward_functions = wanted
                self.out.notes.append(f"grpo.reward_functions = {names} (from training.reward_functions)")
        # Oumi's own check rejects training.reward_functions for trainer types other than TRL/VERL
        t.reward_functions = None
        t.reward_function_kwargs = {}

    def training_grpo(self) -> None:
        from oumi.core.configs.params.grpo_params import GrpoParams

        g = self.config.training.grpo
        for name in SHARED_GRPO_FIELDS:
            value = getattr(g, name)
            if value is not None and self.is_set(f"training.grpo.{name}", GrpoParams, name):
                self.take(f"grpo.{name}", value, f"training.grpo.{name}")
        if g.use_vllm:
            self.take("megatron.inference_backend", "vllm", "training.grpo.use_vllm")
            if self.is_set("training.grpo.vllm_gpu_memory_utilization", GrpoParams, "vllm_gpu_memory_utilization"):
                self.take("megatron.vllm_gpu_memory_utilization", g.vllm_gpu_memory_utilization,
                          "training.grpo.vllm_gpu_memory_utilization")
            if g.vllm_mode:
                placement = {"colocate": "colocated", "server": "separate"}.get(str(g.vllm_mode))
                if placement is None:
                    self.out.problems.append(("training.grpo.vllm_mode", f"unknown value {g.vllm_mode!r}; "
                                              "use colocate or server (megatron.rollout_placement)."))
                else:
                    self.take("megatron.rollout_placement", placement, "training.grpo.vllm_mode")
        if g.repetition_penalty not in (None, 1.0):
            self.out.problems.append(("training.grpo.repetition_penalty", f"is {g.repetition_penalty}, but "
                                      "MEGATRON_GRPO rollouts sample without a repetition penalty. Remove it."))
        if g.rollout_function:
            self.out.problems.append(("training.grpo.rollout_function", "custom rollout functions are a "
                                      "TRL_GRPO feature; MEGATRON_GRPO rollouts come from megatron.inference_backend. "
                                      "Remove it."))

    def verl_overrides(self) -> None:
        overrides = self.config.training.verl_config_overrides or {}
        if not overrides:
            return
        flat = _flatten(overrides)
        used: set[str] = set()
        source = "training.verl_config_overrides."
        for key, target in VERL_KEYS.items():
            if key in flat:
                self.take(target, flat[key], source + key)
                used.add(key)
        actor = "actor_rollout_ref.actor."
        if flat.get(actor + "use_kl_loss"):
            self.take("grpo.beta", float(flat.get(actor + "kl_loss_coef", 0.001)), source + actor + "kl_loss_coef")
            kind = str(flat.get(actor + "kl_loss_type", "low_var_kl"))
            if _VERL_KL.get(kind):
                self.take("grpo.kl_estimator", _VERL_KL[kind], source + actor + "kl_loss_type")
            else:
                self.out.problems.append((source + actor + "kl_loss_type", f"{kind!r} has no equivalent; use "
                                          "low_var_kl (k3), kl (k1) or mse (k2)."))
            used.update({actor + "use_kl_loss", actor + "kl_loss_coef", actor + "kl_loss_type"})
        elif actor + "use_kl_loss" in flat:
            used.add(actor + "use_kl_loss")
        if actor + "loss_agg_mode" in flat:
            mode = str(flat[actor + "loss_agg_mode"])
            if mode in _VERL_AGG:
                self.take("grpo.loss_aggregation", _VERL_AGG[mode], source + actor + "loss_agg_mode")
            else:
                self.out.problems.append((source + actor + "loss_agg_mode", f"{mode!r} has no equivalent; use one "
                                          f"of {sorted(_VERL_AGG)}."))
            used.add(actor + "loss_agg_mode")
        self._verl_batches(flat, used, source)
        ignored = sorted(k for k in flat if k not in used)
        if ignored:
            self.out.warnings.append(
                "training.verl_config_overrides: these VERL_GRPO settings have no MEGATRON_GRPO equivalent and are "
                f"ignored: {', '.join(ignored)} (the parallel layout comes from the launcher and the megatron: section)."
            )

    def _verl_batches(self, flat: dict[str, Any], used: set[str], source: str) -> None:
        """verl counts prompts: train_batch_size per step, ppo_mini_batch_size per optimizer step; ours
        counts completions: global_batch_size per optimizer step x num_mini_batches per step."""
        prompts = flat.get("data.train_batch_size")
        mini = flat.get("actor_rollout_ref.actor.ppo_mini_batch_size")
        if prompts is None:
            if mini is None:
                return
            prompts = mini
        elif mini is None:
            mini = prompts
        used.update({"data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"})
        n = self.config.grpo.num_generations
        prompts, mini = int(prompts), int(mini)
        if prompts % mini:
            self.out.problems.append((source + "data.train_batch_size", f"{prompts} prompts per step is not a "
                                      f"multiple of actor_rollout_ref.actor.ppo_mini_batch_size {mini}."))
            return
        self.take("megatron.global_batch_size", mini * n, source + "actor_rollout_ref.actor.ppo_mini_batch_size x n")
        self.take("grpo.num_mini_batches", prompts // mini, source + "data.train_batch_size / ppo_mini_batch_size")

    def gradient_checkpointing(self) -> None:
        if not self.config.training.enable_gradient_checkpointing:
            return
        t = self.config.megatron.transformer_config
        if self.ours_set("megatron.transformer_config.recompute_granularity"):
            if t.recompute_granularity is None:
                self.out.problems.append(("megatron.transformer_config.recompute_granularity", "is null (no "
                                          "recompute) but training.enable_gradient_checkpointing is true; set one."))
            return
        # HF gradient checkpointing = every layer's activations recomputed in backward
        for name, value in (("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1)):
            self.take(f"megatron.transformer_config.{name}", value, "training.enable_gradient_checkpointing")

    def datasets(self) -> None:
        for i, d in enumerate(self.config.data.train.datasets):
            if d.dataset_name in DATASET_ALIASES:
                name, subset = DATASET_ALIASES[d.dataset_name]
                self.out.notes.append(f"data.train.datasets[{i}].dataset_name = {name!r} (Oumi's dataset for "
                                      f"{d.dataset_name!r})")
                d.dataset_name = name
                d.subset = d.subset or subset
        if self.config.grpo.reward_functions:
            return
        from oumi_megatron.config.grpo_params import RewardFunctionParams

        names = [d.dataset_name for d in self.config.data.train.datasets]
        rewards = {DEFAULT_REWARDS.get(n) for n in names}
        reward = rewards.pop() if len(rewards) == 1 else None  # one default reward shared by every dataset
        if reward is not None:
            self.config.grpo.reward_functions = [RewardFunctionParams(name=reward)]
            self.out.notes.append(f"grpo.reward_functions = [{reward!r}] (no reward function configured; "
                                  f"{reward!r} is the reward of {names[0]!r})")

    def unsupported(self) -> None:
        t, data = self.config.training, self.config.data
        optimizer = str(getattr(t, "optimizer", "adamw_torch"))
        if optimizer not in _ADAM_OPTIMIZERS:
            self.out.problems.append(("training.optimizer", f"{optimizer!r}: MEGATRON_GRPO trains with Megatron-Core's "
                                      "Adam (decoupled weight decay, i.e. AdamW). Use adamw_torch."))
        eval_set = bool(getattr(data, "validation", None) and data.validation.datasets)
        eval_strategy = option_value(t.eval_strategy, "no")
        if eval_strategy != "no" and not eval_set:
            self.out.problems.append(("training.eval_strategy", f"{eval_strategy!r} evaluates on data.validation, which "
                                      "has no datasets. Add the held-out prompts under data.validation.datasets, or "
                                      "set training.eval_strategy: no."))
        elif eval_set and eval_strategy == "no":
            self.out.notes.append("data.validation is not evaluated during training (training.eval_strategy is 'no'; "
                                  "set it to steps with training.eval_steps: N); `oumi-megatron eval` uses it.")
        for name in ("compile", "enable_mlflow"):
            if getattr(t, name, False):
                self.out.warnings.append(f"training.{name} is not used by MEGATRON_GRPO and is ignored.")


def adopt_oumi_fields(config: MegatronTrainingConfig) -> Adoption:
    """Takes over Oumi's fields into the megatron:/grpo: sections (once; later calls return the record)."""
    done = config.__dict__.get("_oumi_adoption")
    if done is not None:
        return done
    adopter = _Adopter(config, config.__dict__.get("_explicit_keys"))
    if hasattr(config.training, "grpo"):
        adopter.training_grpo()
    adopter.verl_overrides()
    adopter.reward_functions()
    adopter.gradient_checkpointing()
    adopter.datasets()
    adopter.unsupported()
    config.__dict__["_oumi_adoption"] = adopter.out
    return adopter.out
