"""Rollout modes: ``megatron.inference_backend`` x ``megatron.rollout_placement``, resolved once into an entry.

A mode carries everything the rest of the program asks of it: its builder, its config checks and warnings, where its
memory lives (the plan), its preflight (before conversion) and its capabilities: whether it can generate while the
trainer trains (asynchronous GRPO), run episodes that way, which ``megatron.lora_sync`` it runs, whether its decoder
captures CUDA graphs. Validation, the plan, the composition root (assembly.py), the trainer and ``oumi-megatron eval``
ask the entry; this module is the only one that reads ``rollout_placement`` or ``inference_backend``, and it checks the
rollout fields every mode shares (``check_rollout``).

| mode | inference_backend / rollout_placement | engines | asynchronous |
| --- | --- | --- | --- |
| embedded | megatron (placement not read) | the trainer's own model (rollout/megatron_backend.py) | no |
| vllm colocated | vllm / colocated | one per TP group, in the trainer's processes, on its GPUs | no |
| vllm separate | vllm / separate | one per replica, its own process and GPU | yes |
| vllm ray | vllm / ray | a Ray fleet on any node | yes |
| sglang colocated | sglang / colocated | one per trainer rank (Megatron TP 1, PP 1), on its GPU | no |
| sglang separate | sglang / separate | one per replica, on a GPU of its own | yes |

A new backend registers a builder with ``@register_rollout_backend("name")`` (here, or in a ``grpo.plugins``
module) and implements rollout/base.py's ``RolloutBackend``; it places its own engines (one mode, placement not read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.config.megatron_params import (
    ROLLOUT_CUDA_GRAPHS,
    ROLLOUT_DECODE_KERNELS,
    ROLLOUT_PLACEMENTS,
    WEIGHT_SYNC_METHODS,
)
from oumi_megatron.config.problems import Problem, choices
from oumi_megatron.rollout.base import AsyncRolloutBackend, RolloutBackend
from oumi_megatron.utils.disk import GIB
from oumi_megatron.utils.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.engine.engine import MegatronEngine
    from oumi_megatron.model_shape import ModelShape


@dataclass
class RolloutContext:
    """What a backend may need: the training engine, the config, the tokenizer, the dtype and a folder for the
    backend's files. Weights reach a backend through ``sync_weights`` (the engine's exporter), never from here."""

    engine: MegatronEngine
    config: MegatronTrainingConfig
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    work_dir: Path


RolloutBuilder = Callable[[RolloutContext], RolloutBackend]

# Where a mode's memory lives, for the plan (plan.py): turns with training on the trainer's GPUs (the embedded
# decoder's static KV cache), a vLLM engine's share of each trainer GPU, or GPUs of its own.
DECODER_CACHE, ENGINE_SHARE, OWN_GPUS = "decoder cache", "engine share", "own GPUs"


def _no_problems(params: MegatronParams) -> list[Problem]:
    return []


def _no_warnings(params: MegatronParams) -> list[str]:
    return []


def _no_adapter_problems(params: MegatronParams, rank: int) -> list[Problem]:
    return []


def _no_preflight(config: Any) -> None:
    return None


def _never_resident(params: MegatronParams) -> bool:
    return False


@dataclass(frozen=True)
class EngineShare:
    """How much of a GPU an engine takes: a KV cache of ``kv_cache_gib`` beside its weights where that is set (> 0),
    else at least ``fraction`` of the GPU (the field ``fraction_field`` sets it)."""

    kv_cache_gib: float
    fraction: float
    fraction_field: str


@dataclass(frozen=True)
class RolloutMode:
    name: str
    build: RolloutBuilder
    asynchronous: bool = False
    """Its engines generate while the trainer trains: ``grpo.max_staleness`` > 0 may use it."""
    memory: str = OWN_GPUS
    """Where its memory lives: DECODER_CACHE, ENGINE_SHARE or OWN_GPUS."""
    resident_while_training: Callable[[MegatronParams], bool] = _never_resident
    """An ENGINE_SHARE engine that keeps its memory while the trainer trains (it does not sleep)."""
    check: Callable[[MegatronParams], list[Problem]] = _no_problems
    """The mode's own config rules (validation reports them)."""
    warnings: Callable[[MegatronParams], list[str]] = _no_warnings
    """Settings that run under this mode, but perhaps not as meant (validation reports them)."""
    preflight: Callable[[Any], None] = _no_preflight
    """Collective, before the model is converted: what must exist outside the trainer (e.g. a Ray cluster)."""
    engine_gpus: Callable[[MegatronParams], int] | None = None
    """The GPUs one engine splits the whole model over (its tensor parallelism); None: no such engine."""
    gpu_share: Callable[[MegatronParams], EngineShare] | None = None
    """An engine's memory on a GPU it runs on (ENGINE_SHARE and OWN_GPUS engines): what the plan counts."""
    partial_rollouts: bool = False
    """``grpo.partial_rollouts``: its episode jobs send each turn's pieces as requests of their own, so a weight push
    lands between two of them."""
    streaming_groups: bool = False
    """``grpo.streaming_groups``: its owner runs one stream of episodes that groups join and leave at any time
    (``StreamingEpisodeBackend``)."""
    lora_syncs: tuple[str, ...] = ("merged",)
    """The ``megatron.lora_sync`` values it runs under LoRA: ``merged`` (whole weights), ``adapter`` (the base beside
    the adapter: its engines take the adapter alone at a sync, or its decoder runs it in its forward)."""
    adapter_check: Callable[[MegatronParams, int], list[Problem]] = _no_adapter_problems
    """With ``lora_sync: adapter``: what its engines need to take an adapter of this rank at a sync."""
    decoder_cuda_graphs: bool = False
    """Its decoder (the embedded one) captures CUDA graphs of the policy's decode steps (``megatron.rollout_cuda_graphs``)
    and runs the decode step's kernels (``megatron.rollout_decode_kernels``)."""


@dataclass(frozen=True)
class BackendModes:
    """A backend's modes by ``rollout_placement``; ``None``: the one mode of a backend that places its own engines."""

    modes: dict[str | None, RolloutMode] = field(default_factory=dict)


ROLLOUT_BACKENDS: Registry[BackendModes] = Registry(
    "rollout backend", "megatron.inference_backend",
    "your own: @register_rollout_backend('name') in a module named in grpo.plugins, docs/rollouts.md")


def register_rollout_backend(name: str) -> Callable[[RolloutBuilder], RolloutBuilder]:
    """A plugin backend: one mode, its engines placed by the backend itself (``rollout_placement`` not read)."""
    def add(builder: RolloutBuilder) -> RolloutBuilder:
        ROLLOUT_BACKENDS.add(name, BackendModes({None: RolloutMode(name, builder)}))
        return builder

    return add


def _lookup(params: MegatronParams) -> tuple[RolloutMode | None, list[Problem]]:
    """The mode of ``params`` (None where the backend or placement is unknown: the problems say why), unchecked."""
    problems: list[Problem] = []
    backend, placement = params.inference_backend, params.rollout_placement
    if backend not in ROLLOUT_BACKENDS:  # the live registry: plugins are imported already
        problems.append(Problem(ROLLOUT_BACKENDS.field, ROLLOUT_BACKENDS.unknown_message(backend)))
    if placement not in ROLLOUT_PLACEMENTS:
        problems.append(Problem("megatron.rollout_placement",
                                f"unknown value {placement!r}. Use one of {choices(ROLLOUT_PLACEMENTS)}."))
    if problems:
        return None, problems
    modes = ROLLOUT_BACKENDS.get(backend).modes
    mode = modes.get(placement) or modes.get(None)
    if mode is None:
        return None, [Problem("megatron.rollout_placement", f"{placement!r} is not a placement of the {backend!r} "
                              f"backend. Use one of {sorted(p for p in modes if p)}.")]
    return mode, []


def resolve_rollout_mode(params: MegatronParams) -> tuple[RolloutMode | None, list[Problem]]:
    """The mode of ``params`` and the problems of its fields (None where the backend or placement is unknown)."""
    mode, problems = _lookup(params)
    return mode, problems if mode is None else mode.check(params)


def selected_mode(params: MegatronParams) -> RolloutMode | None:
    """The mode of ``params`` for its capabilities, without its checks; None where the backend or placement is unknown
    (``check_rollout`` reports that)."""
    return _lookup(params)[0]


def rollout_mode(params: MegatronParams) -> RolloutMode:
    """The mode of ``params``; ``ValueError`` naming every problem of its fields (validation reports them earlier)."""
    mode, problems = resolve_rollout_mode(params)
    if mode is None or problems:
        raise ValueError("; ".join(str(p) for p in problems))
    return mode


def build_rollout_backend(ctx: RolloutContext) -> RolloutBackend:
    return rollout_mode(ctx.config.megatron).build(ctx)


def as_asynchronous(backend: RolloutBackend, params: MegatronParams) -> AsyncRolloutBackend:
    """``backend`` for asynchronous GRPO; ``ValueError`` naming the fields when its mode cannot generate while the
    trainer trains (validation says so first)."""
    mode = rollout_mode(params)
    if not mode.asynchronous or not isinstance(backend, AsyncRolloutBackend):
        raise ValueError(f"grpo.max_staleness > 0 needs a rollout mode whose engines generate while the trainer trains; "
                         f"{mode.name} does not. Set megatron.inference_backend: vllm (rollout_placement: separate or "
                         "ray) or sglang (rollout_placement: separate), or grpo.max_staleness: 0.")
    return backend


# -- the rules of the rollout fields (validation.py runs them in its order) ------------------------------------------
def check_rollout(config: MegatronTrainingConfig, found: Findings) -> None:
    """The mode (backend, placement) with its own rules and warnings, then the fields every mode shares: weight sync,
    the decoder's CUDA graphs, vLLM's memory (checked whatever the backend: Oumi's TRL fields may set them)."""
    m = config.megatron
    mode, problems = resolve_rollout_mode(m)
    found.problems.extend(problems)
    if mode is not None:
        found.warnings.extend(mode.warnings(m))
    if m.weight_sync_method not in WEIGHT_SYNC_METHODS:
        found.add("megatron.weight_sync_method",
                  f"unknown value {m.weight_sync_method!r}. Use one of {choices(WEIGHT_SYNC_METHODS)}.")
    graphs = m.rollout_cuda_graphs_choice
    if graphs not in ROLLOUT_CUDA_GRAPHS:
        found.add("megatron.rollout_cuda_graphs",
                  f"unknown value {m.rollout_cuda_graphs!r}. Use one of {choices(ROLLOUT_CUDA_GRAPHS)}.")
    elif graphs == "true" and mode is not None and mode.decoder_cuda_graphs and m.pipeline_model_parallel_size > 1:
        found.add("megatron.rollout_cuda_graphs", "true cannot run with pipeline_model_parallel_size > 1: pipeline "
                  "stages exchange activations every token, so decode steps run eagerly. Set it to auto.")
    kernels = m.rollout_decode_kernels_choice
    if kernels not in ROLLOUT_DECODE_KERNELS:
        found.add("megatron.rollout_decode_kernels",
                  f"unknown value {m.rollout_decode_kernels!r}. Use one of {choices(ROLLOUT_DECODE_KERNELS)}.")
    elif kernels == "true" and mode is not None and not mode.decoder_cuda_graphs:
        found.add("megatron.rollout_decode_kernels", f"true is the embedded decoder's (inference_backend: megatron); "
                  f"{m.inference_backend}'s engines decode with their own kernels. Set it to auto.")
    elif kernels == "true" and m.transformer_config.attention_backend == "local":
        found.add("megatron.rollout_decode_kernels", "true needs the layers on SDPA (the decode attention kernel replaces "
                  "it); megatron.transformer_config.attention_backend is local. Set attention_backend: sdpa (or auto on "
                  "a GPU), or rollout_decode_kernels: auto.")
    if not (isinstance(m.rollout_cuda_graphs_kept, int) and m.rollout_cuda_graphs_kept >= 0):
        found.add("megatron.rollout_cuda_graphs_kept", f"must be an integer >= 0 (0: capture the decode step's graph in "
                  f"every generation and free its KV cache after it), got {m.rollout_cuda_graphs_kept!r}.")
    if not m.weight_sync_bucket_mb > 0:
        found.add("megatron.weight_sync_bucket_mb", f"must be > 0, got {m.weight_sync_bucket_mb!r}. Typical: 256-1024.")
    if not m.vllm_kv_cache_gib >= 0.0:
        found.add("megatron.vllm_kv_cache_gib", f"must be >= 0 (0: sized from vllm_gpu_memory_utilization), got "
                                                f"{m.vllm_kv_cache_gib!r}.")
    if not 0.0 < m.vllm_gpu_memory_utilization <= 1.0:
        found.add("megatron.vllm_gpu_memory_utilization",
                  f"must be in (0, 1], got {m.vllm_gpu_memory_utilization!r}.")


def check_lora_sync(config: MegatronTrainingConfig, found: Findings) -> None:
    """``megatron.lora_sync: adapter`` under LoRA: whether the mode runs it, and what its engines need for it."""
    from oumi_megatron.config.lora import lora_settings

    m = config.megatron
    lora, _ = lora_settings(config)
    if lora is None or m.lora_sync != "adapter" or not m.enable_weight_sync:
        return
    mode = selected_mode(m)
    if mode is None:
        return  # the backend's own problems are reported
    if "adapter" not in mode.lora_syncs:
        found.add("megatron.lora_sync", f"adapter is not built for {mode.name} engines (they take whole weights). Set "
                                        "megatron.lora_sync: merged, or use vLLM engines (colocated or separate).")
    else:
        found.problems.extend(mode.adapter_check(m, lora.rank))


def asynchronous_problem(params: MegatronParams, staleness: int) -> str | None:
    """Why ``grpo.max_staleness`` = ``staleness`` cannot run on this mode (its engines do not generate while the
    trainer trains), or None (also where the mode is unknown: ``check_rollout`` says why)."""
    mode = selected_mode(params)
    if mode is None or mode.asynchronous:
        return None
    return (f"{staleness} (asynchronous GRPO) needs rollout engines that generate while the trainer trains: set "
            "megatron.inference_backend: vllm (rollout_placement: separate or ray) or sglang (rollout_placement: "
            f"separate) (now {params.inference_backend!r} / {params.rollout_placement!r}), or max_staleness: 0.")


def _asynchronous_feature_problem(params: MegatronParams, staleness: int, capability: str, synchronous: str,
                                  runs_as: str) -> str | None:
    """Why an asynchronous GRPO feature (``capability``: the grpo field and the mode's flag of the same name) cannot
    run here, or None: ``synchronous`` why it needs ``max_staleness`` > 0, ``runs_as`` what other modes' episodes do."""
    if not (isinstance(staleness, int) and staleness > 0):
        return f"needs asynchronous GRPO (grpo.max_staleness > 0): {synchronous}"
    mode = selected_mode(params)
    if mode is None or getattr(mode, capability):
        return None
    return (f"is not built for {mode.name} engines: their episodes {runs_as}. Use rollout_placement: separate "
            f"(vllm or sglang), or {capability}: false.")


def partial_rollouts_problem(params: MegatronParams, staleness: int) -> str | None:
    """Why ``grpo.partial_rollouts`` cannot run here, or None."""
    return _asynchronous_feature_problem(params, staleness, "partial_rollouts",
                                         "a synchronous step's weights do not change during it.",
                                         "run whole between weight pushes")


def streaming_groups_problem(params: MegatronParams, staleness: int) -> str | None:
    """Why ``grpo.streaming_groups`` cannot run here, or None."""
    return _asynchronous_feature_problem(params, staleness, "streaming_groups",
                                         "a synchronous step trains on the groups it generated.",
                                         "run as one job per step")


def check_own_gpu_engines(config: MegatronTrainingConfig, shape: ModelShape, found: Findings) -> None:
    """Engines on GPUs of their own (separate, ray) hold the whole model: on a machine with GPUs, against this one's
    (``oumi-megatron plan --gpu-memory-gib`` checks it for any GPU)."""
    if not torch.cuda.is_available():
        return
    problem = own_gpu_engine_problem(config.megatron, shape, torch.cuda.get_device_properties(0).total_memory / GIB)
    if problem is not None:
        found.add("megatron.rollout_placement", problem)


# -- the built-in modes ---------------------------------------------------------------------------------------------
def _embedded_warnings(m: MegatronParams) -> list[str]:
    """Context parallelism splits training's sequences; the decoder generates whole ones on each CP rank."""
    cp = m.context_parallel_size
    if not (isinstance(cp, int) and cp > 1):
        return []
    return [f"megatron.context_parallel_size {cp} with the embedded megatron rollout backend: training and logprob passes "
            "split sequences over CP ranks; generation (KV cache) runs whole sequences on each CP rank, the "
            f"{cp} ranks of a replica generating the same rollouts. inference_backend: vllm generates on its own engines."]


def _embedded(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.decoding.generation_mode import expert_peers
    from oumi_megatron.rollout.megatron_backend import MegatronRolloutBackend

    backend = MegatronRolloutBackend(ctx.engine, vocab_size=len(ctx.tokenizer), seed=ctx.config.training.seed,
                                     cuda_graphs=ctx.config.megatron.rollout_cuda_graphs_choice,
                                     cuda_graphs_kept=ctx.config.megatron.rollout_cuda_graphs_kept,
                                     decode_kernels=ctx.config.megatron.rollout_decode_kernels_choice)
    if ctx.config.grpo.environment is not None and backend.decoder is None and expert_peers() > 1:
        from oumi_megatron.errors import UserInputError

        # the schedule path generates each turn from the whole history, one generate per replica, and a replica whose
        # episodes have ended would leave its expert peers waiting in an all-to-all
        raise UserInputError(f"grpo.environment: multi-turn episodes under expert parallelism (megatron."
                             f"expert_model_parallel_size = {expert_peers()}) run on the embedded static-cache "
                             f"decoder, which does not cover this model ({backend.decoder_unsupported}). Set "
                             "megatron.inference_backend: vllm, or megatron.expert_model_parallel_size: 1.")
    return backend


def _vllm(colocated: bool) -> RolloutBuilder:
    def build(ctx: RolloutContext) -> RolloutBackend:
        from oumi_megatron.config.lora import lora_settings
        from oumi_megatron.rollout.vllm_backend import ColocatedVllmBackend, SeparateVllmBackend

        c = ctx.config
        cls = ColocatedVllmBackend if colocated else SeparateVllmBackend
        lora, _ = lora_settings(c)
        return cls(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed, work_dir=ctx.work_dir,
                   trust_remote_code=bool(c.model.trust_remote_code),
                   adapter_sync=lora if lora is not None and c.megatron.lora_sync == "adapter" else None,
                   trainer_engine=ctx.engine, vocab_size=len(ctx.tokenizer))

    return build


def _vllm_warnings(m: MegatronParams) -> list[str]:
    if m.enable_weight_sync:
        return []
    return ["megatron.enable_weight_sync is False: vLLM keeps generating with the initial weights "
            "(rollouts use stale weights and GRPO is off-policy)."]


def _vllm_adapter(m: MegatronParams, rank: int) -> list[Problem]:
    """vLLM engines take the adapter alone, in memory, at a sync: up to vLLM's largest LoRA rank."""
    from oumi_megatron.rollout.vllm_engine import VLLM_LORA_RANKS, vllm_lora_rank

    if m.weight_sync_method == "checkpoint":
        return [Problem("megatron.lora_sync", "adapter sends the adapter in memory, and weight_sync_method: checkpoint "
                                              "writes whole models to disk. Set weight_sync_method to nccl (GPUs) or "
                                              "gloo (CPU), or lora_sync: merged.")]
    if vllm_lora_rank(rank) is None:
        return [Problem("peft.lora_r", f"{rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}), which "
                                       "megatron.lora_sync: adapter needs. Lower it, or set lora_sync: merged.")]
    return []


def _ray(ctx: RolloutContext) -> RolloutBackend:
    from oumi_megatron.rollout.ray_fleet import RayRolloutBackend

    c = ctx.config
    return RayRolloutBackend(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed,
                             trust_remote_code=bool(c.model.trust_remote_code))


def _ray_preflight(config: Any) -> None:
    from oumi_megatron.rollout.ray_fleet import preflight

    preflight(config.megatron, config.model.model_name)


def _ray_fields(m: MegatronParams) -> list[Problem]:
    """The fleet's fields (whether the cluster has the GPUs is checked when it is reached, before conversion)."""
    out = []
    if not isinstance(m.ray_address, str) or not m.ray_address.strip():
        out.append(Problem("megatron.ray_address", "is empty. Use local (a Ray head for this node's spare GPUs), auto, "
                                                   "or the address `ray start --head` printed."))
    if not isinstance(m.rollout_engines, int) or m.rollout_engines < 1:
        out.append(Problem("megatron.rollout_engines", f"must be a positive integer, got {m.rollout_engines!r}."))
    restarts = m.rollout_engine_restarts
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        out.append(Problem("megatron.rollout_engine_restarts",
                           f"must be an integer >= 0 (0: a dead engine stops the run), got {restarts!r}."))
    g = m.rollout_gpus_per_engine
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        out.append(Problem("megatron.rollout_gpus_per_engine", f"must be a positive integer (an engine's GPUs, its vLLM "
                                                               f"tensor parallelism, on one node), got {g!r}."))
    if m.weight_sync_method == "checkpoint":
        out.append(Problem("megatron.weight_sync_method", "checkpoint needs a folder every node of the Ray cluster reads, "
                                                          "which is not built; use nccl (GPUs) or gloo (CPU) for "
                                                          "rollout_placement: ray."))
    return out


def _awake_while_training(m: MegatronParams) -> bool:
    return not m.vllm_sleep


def _megatron_tp(m: MegatronParams) -> int:  # a colocated engine's TP is Megatron's, over the same ranks
    return m.tensor_model_parallel_size


def _one_gpu(m: MegatronParams) -> int:  # a separate engine: one process, one GPU
    return 1


def _fleet_gpus(m: MegatronParams) -> int:
    return m.rollout_gpus_per_engine


def own_gpu_engine_problem(params: MegatronParams, shape: Any, gpu_memory_gib: float) -> str | None:
    """Why an engine on GPUs of its own (separate, ray) cannot hold the model on ``gpu_memory_gib`` GPUs, or None: its
    bf16 weights over its GPUs plus its KV cache (where sized) against its share of one GPU."""
    mode, problems = resolve_rollout_mode(params)
    if mode is None or problems or mode.memory != OWN_GPUS or mode.engine_gpus is None or mode.gpu_share is None:
        return None  # no such engine, or fields validation reports already
    gpus, share = mode.engine_gpus(params), mode.gpu_share(params)
    weights = shape.vllm_weight_bytes(gpus) / GIB
    need, allowed = weights + share.kv_cache_gib, share.fraction * gpu_memory_gib
    if need <= allowed:
        return None
    fix = ("raise megatron.rollout_gpus_per_engine (the engine's vLLM tensor parallelism)" if params.rollout_placement == "ray"
           else "use rollout_placement: ray with rollout_gpus_per_engine > 1 (an engine's tensor parallelism over "
           "GPUs of its own), or colocated engines (Megatron's TP)")
    field = share.fraction_field.removeprefix("megatron.")
    return (f"each {mode.name} engine holds the whole model over {gpus} GPU(s): {weights:.1f} GiB of bf16 weights"
            + (f" + {share.kv_cache_gib:g} GiB KV cache" if share.kv_cache_gib else "")
            + f", more than {field} {share.fraction} x {gpu_memory_gib:g} GiB = {allowed:.1f} GiB. Fix: {fix}; raise "
            f"{field} (an engine with a GPU of its own may take 0.9)"
            + (", or lower vllm_kv_cache_gib." if share.kv_cache_gib else "."))


def _vllm_share(m: MegatronParams) -> EngineShare:
    return EngineShare(m.vllm_kv_cache_gib or 0.0, m.vllm_gpu_memory_utilization, "megatron.vllm_gpu_memory_utilization")


def _sglang_share(m: MegatronParams) -> EngineShare:  # mem_fraction_static holds its weights and its KV pool
    return EngineShare(0.0, m.sglang_mem_fraction_static, "megatron.sglang_mem_fraction_static")


def _sglang(colocated: bool) -> RolloutBuilder:
    def build(ctx: RolloutContext) -> RolloutBackend:
        from oumi_megatron.rollout.sglang_backend import ColocatedSglangBackend, SeparateSglangBackend

        c = ctx.config
        cls = ColocatedSglangBackend if colocated else SeparateSglangBackend
        # the most rows of one call: a training step's completions, or an evaluation batch (the CPU KV pool holds them)
        step = (c.megatron.global_batch_size or c.grpo.num_generations) * c.grpo.num_mini_batches
        rows = max(step, c.training.per_device_eval_batch_size or 1)
        return cls(c.model.model_name, ctx.dtype, c.megatron, c.grpo, seed=c.training.seed, engine=ctx.engine,
                   vocab_size=len(ctx.tokenizer), rows_per_step=rows, trust_remote_code=bool(c.model.trust_remote_code))

    return build


def _sglang_fields(colocated: bool) -> Callable[[MegatronParams], list[Problem]]:
    def check(m: MegatronParams) -> list[Problem]:
        """SGLang installed, its own fields, and what its placements run on."""
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            from oumi_megatron.rollout.sglang_backend import SGLANG_INSTALL

            return [Problem("megatron.inference_backend", f"sglang is not installed. Install it: {SGLANG_INSTALL}.")]

        from oumi_megatron.rollout.sglang_backend import OWNED_ENGINE_ARGS, sglang_engine_fields

        out = []
        if not isinstance(m.sglang_mem_fraction_static, (int, float)) or not 0.0 < m.sglang_mem_fraction_static <= 1.0:
            out.append(Problem("megatron.sglang_mem_fraction_static", f"must be in (0, 1], got {m.sglang_mem_fraction_static!r}."))
        args = m.sglang_engine_args or {}
        if not isinstance(args, dict):
            out.append(Problem("megatron.sglang_engine_args", f"must be a mapping of sglang.Engine arguments, got {args!r}."))
        elif args:
            known = sglang_engine_fields()
            for name in sorted(args):
                if name in OWNED_ENGINE_ARGS:
                    out.append(Problem("megatron.sglang_engine_args", f"{name!r} is set by the backend itself; use its own "
                                       "field (model.model_name, model.torch_dtype_str, model.trust_remote_code, "
                                       "megatron.sglang_mem_fraction_static, megatron.sglang_attention_backend, ...) or "
                                       "leave it out."))
                elif name not in known:
                    out.append(Problem("megatron.sglang_engine_args", f"{name!r} is not an argument of sglang.Engine "
                                       "(sglang.srt.server_args.ServerArgs). Check its spelling against SGLang 0.5.17."))
        if colocated and (m.tensor_model_parallel_size > 1 or m.pipeline_model_parallel_size > 1):
            out.append(Problem("megatron.rollout_placement", "colocated SGLang engines run one per trainer rank, on Megatron "
                               "TP 1 and PP 1 (an engine spread over several trainer GPUs is not built). Use "
                               "rollout_placement: separate (an engine per replica on a GPU of its own), or vllm."))
        if not colocated and m.weight_sync_method not in ("gloo", "nccl"):
            out.append(Problem("megatron.weight_sync_method", f"{m.weight_sync_method!r}: a separate SGLang engine takes "
                               "the weights over its update group: use nccl (GPUs) or gloo (CPU)."))
        return out

    return check


# the embedded decoder runs LoRA's adapters in its forward (lora_sync: adapter) or decodes merged weights
ROLLOUT_BACKENDS.add("megatron", BackendModes({None: RolloutMode(
    "embedded", _embedded, memory=DECODER_CACHE, warnings=_embedded_warnings, lora_syncs=("merged", "adapter"),
    decoder_cuda_graphs=True)}))
ROLLOUT_BACKENDS.add("vllm", BackendModes({
    "colocated": RolloutMode("vllm colocated", _vllm(colocated=True), memory=ENGINE_SHARE, warnings=_vllm_warnings,
                             resident_while_training=_awake_while_training, engine_gpus=_megatron_tp, gpu_share=_vllm_share,
                             lora_syncs=("merged", "adapter"), adapter_check=_vllm_adapter),
    "separate": RolloutMode("vllm separate", _vllm(colocated=False), asynchronous=True, partial_rollouts=True,
                            streaming_groups=True,
                            warnings=_vllm_warnings,
                            engine_gpus=_one_gpu, gpu_share=_vllm_share, lora_syncs=("merged", "adapter"),
                            adapter_check=_vllm_adapter),
    # the fleet's rank 0 runs every replica's episodes: one stream of groups for them all is not built
    "ray": RolloutMode("vllm ray", _ray, asynchronous=True, partial_rollouts=True, check=_ray_fields,
                       warnings=_vllm_warnings, preflight=_ray_preflight, engine_gpus=_fleet_gpus, gpu_share=_vllm_share),
}))
ROLLOUT_BACKENDS.add("sglang", BackendModes({
    "colocated": RolloutMode("sglang colocated", _sglang(colocated=True), memory=ENGINE_SHARE, check=_sglang_fields(True),
                             engine_gpus=_megatron_tp, gpu_share=_sglang_share),
    "separate": RolloutMode("sglang separate", _sglang(colocated=False), asynchronous=True, partial_rollouts=True,
                            streaming_groups=True, check=_sglang_fields(False),
                            engine_gpus=_one_gpu, gpu_share=_sglang_share),
}))
