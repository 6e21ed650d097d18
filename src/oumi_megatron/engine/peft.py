"""LoRA on the policy's Megatron-Core chunks through Megatron-Bridge's ``peft/`` (``LoRA``, ``CanonicalLoRA``).

The chunks are built, the converted base weights loaded into them, and only then are the matched linear layers
wrapped by the adapters (``pre_wrap_hooks``: inside Bridge's ``provide_distributed_model``, before Megatron DDP wraps
the chunks): the base is frozen (``requires_grad`` False), so DDP holds gradient buffers and the distributed optimizer
fp32 master weights and Adam moments for the adapters alone. Switching the adapters off gives the base model, which
is GRPO's reference policy for the KL term (``adapters_off``: no second copy of the weights), as verl, ROLL and TRL do.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from oumi_megatron.config.lora import LoraSettings
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.config.training_config import MegatronTrainingConfig
    from oumi_megatron.model_shape import ModelShape


def check_lora_on_model(config: MegatronTrainingConfig, shape: ModelShape, found: Findings) -> None:
    """LoRA wraps dense layers here; on expert layers it is not built."""
    if shape.is_moe and getattr(config.training, "use_peft", False):
        found.add("training.use_peft", f"{shape.source} has mixture-of-experts layers, and LoRA on expert layers is not "
                                       "built or tested here (docs/lora.md). Use a dense model with LoRA, or full "
                                       "fine-tuning.")


def bridge_peft(settings: LoraSettings) -> Any:
    """Megatron-Bridge's PEFT object for ``settings``."""
    from oumi_megatron.bridge_utils import import_megatron_bridge

    import_megatron_bridge()
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA

    _merge_leaves_unadapted_projections_alone()
    _canonical_forward_takes_partial_targets()
    _adapter_output_in_one_gemm()
    cls = CanonicalLoRA if settings.canonical else LoRA
    return cls(target_modules=list(settings.targets), dim=settings.rank, alpha=settings.alpha, dropout=settings.dropout)


def _merge_leaves_unadapted_projections_alone() -> None:
    """Megatron-Bridge 0.6.2 merges a canonical LoRA (an adapter per HF projection) into the fused projection's HF
    tensors only when every one of them has an adapter: with q_proj and v_proj adapted and k_proj not (PEFT's default
    targets for Llama) it raises "Adapter name mapping not found for ...k_proj.weight", and with a single adapted one
    (q_proj alone) it takes the plain-LoRA path, which would add q's update to all of q, k and v. Here the projections
    without an adapter keep their base tensor and the others take Bridge's own canonical merge (installed once)."""
    from megatron.bridge.models.conversion import peft_bridge

    cls = peft_bridge.MegatronPeftBridge
    if getattr(cls, "_oumi_partial_canonical_merge", False):
        return
    original = cls._merge_lora_adapter_weights
    canonical = set(peft_bridge.ADAPTER_NAME_MAP.values())

    def merge(self: Any, megatron_model: Any, converted: dict[str, torch.Tensor], adapters: list[Any]) -> dict[str, torch.Tensor]:
        keys = {a.adapter_key for a in adapters}
        if not converted or not adapters or not keys <= canonical:
            return original(self, megatron_model, converted, adapters)
        adapted = {name: t for name, t in converted.items()
                   if any(name.endswith(suffix) and key in keys for suffix, key in peft_bridge.ADAPTER_NAME_MAP.items())}
        merged = dict(converted)
        if adapted:
            merged.update(self._merge_canonical_adapter_from_weights(megatron_model, adapted, adapters))
        return merged

    cls._merge_lora_adapter_weights = merge
    cls._oumi_partial_canonical_merge = True


def _canonical_forward_takes_partial_targets() -> None:
    """Megatron-Bridge 0.6.2's canonical LoRA builds no adapter for an unlisted projection (k_proj when q_proj and v_proj
    are the targets) but its forward calls every one ("'NoneType' object is not callable"), and it interleaves the q, k
    and v outputs with the model's global head counts, which is wrong for a TP rank's share of the heads. Here a
    missing adapter adds nothing and the outputs are interleaved per rank: Megatron's fused QKV holds, per query group
    of this rank, the group's query heads, then its key, then its value; fc1 holds gate then up (installed once)."""
    from megatron.bridge.peft import canonical_lora

    if getattr(canonical_lora, "_oumi_partial_targets", False):
        return

    def outputs(self: Any, names: tuple[str, ...], x: torch.Tensor, args: Any, kwargs: Any) -> dict[str, torch.Tensor]:
        return {n: self.adapter_forward(getattr(self.adapter, n), x, *args, **kwargs)
                for n in names if getattr(self.adapter, n, None) is not None}

    def qkv_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, bias, normed = self.base_linear_forward(x, *args, **kwargs)
        if not self._adapter_enabled:
            return out, bias
        got = outputs(self, ("adapter_q", "adapter_k", "adapter_v"), normed, args, kwargs)
        config, lead = self.to_wrap.config, out.shape[:-1]
        tp = config.tensor_model_parallel_size
        groups, per_group, size = config.num_query_groups // tp, config.num_attention_heads // config.num_query_groups, config.kv_channels
        widths = {"adapter_q": per_group * size, "adapter_k": size, "adapter_v": size}
        parts = [got[n].reshape(*lead, groups, w) if n in got else out.new_zeros(*lead, groups, w) for n, w in widths.items()]
        return out + torch.cat(parts, dim=-1).reshape(out.shape), bias

    def fc1_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, bias, normed = self.base_linear_forward(x, *args, **kwargs)
        if not self._adapter_enabled:
            return out, bias
        got = outputs(self, ("adapter_gate", "adapter_up"), normed, args, kwargs)
        half = out.shape[-1] // 2
        parts = [got.get(n, out.new_zeros(*out.shape[:-1], half)) for n in ("adapter_gate", "adapter_up")]
        return out + torch.cat(parts, dim=-1), bias

    canonical_lora.LoRALinearSplitQKV.forward = qkv_forward
    canonical_lora.LoRALinearSplitFC1UpGate.forward = fc1_forward
    canonical_lora._oumi_partial_targets = True


def _adapter_output_in_one_gemm() -> None:
    """Megatron-Bridge 0.6.2's ``LoRALinear`` returns ``base + (x A^T B^T) * (alpha / r)``: after the adapter's two thin
    GEMMs a multiply and an add each read and write the layer's whole output ([tokens, out]; fc1's 17,920 columns on
    the 1.5B shape), and backward runs the multiply again: ~7 full-width passes per adapted layer that full fine-tuning
    does not make (the 1.5B scale task's fwd+bwd on an H100 took 868 ms with LoRA against 766 without), and in a
    CUDA-graph decode step two more kernels per adapter. Here the second GEMM, the scale and the add are one ``addmm``
    (the base output its input, alpha / r its alpha: one rounding, and autograd scales only the thin [tokens, r] and
    [out, r] gradients). Only where B's GEMM is local and carries no communication, forward or backward: one
    tensor-parallel rank, no experts; anything else takes Bridge's forward unchanged (installed once)."""
    from megatron.bridge.peft import lora_layers
    from megatron.bridge.peft.utils import ParallelLinearAdapter
    from megatron.core.utils import get_pg_size

    cls = lora_layers.LoRALinear
    if getattr(cls, "_oumi_one_gemm", False):
        return
    unfused = cls.forward

    def local_b(adapter: Any) -> bool:  # decided once per adapter (a decode step asks 4 per layer)
        decided = getattr(adapter, "_oumi_local_b", None)
        if decided is None:
            out = adapter.linear_out
            decided = (type(adapter) is ParallelLinearAdapter and not adapter.is_expert and get_pg_size(out.tp_group) == 1
                       and isinstance(adapter.activation, torch.nn.Identity)
                       and (adapter.dropout_position == "pre" or isinstance(adapter.dropout, torch.nn.Identity))
                       and not out.config.defer_embedding_wgrad_compute and not out.config.cpu_offloading)
            adapter._oumi_local_b = decided
        return decided

    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        adapter = self.adapter
        if not (self._adapter_enabled and local_b(adapter)):
            return unfused(self, x, *args, **kwargs)
        out, bias, normed = self.base_linear_forward(x, *args, **kwargs)
        h, _ = adapter.linear_in(adapter.dropout(normed.contiguous()))  # Bridge's own A (its TP-1 path: no comms)
        b = adapter.linear_out.weight  # [out, r]
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), b.t(),
                           alpha=adapter.alpha / adapter.dim)
        return flat.view(out.shape), bias

    cls.forward = forward
    cls._oumi_unfused_forward = unfused  # scripts/bench_lora_layer.py times both in one call
    cls._oumi_one_gemm = True


def _drop_missing_adapters(chunks: list[torch.nn.Module]) -> None:
    """Bridge 0.6.2's canonical LoRA keeps a None entry for each projection left without an adapter, which its
    ``sharded_state_dict`` then calls (checkpointing fails): the entries go (the forward above reads them as absent)."""
    from megatron.bridge.peft.canonical_lora import ModuleDict

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, ModuleDict):
                for name in [n for n, m in module.items() if m is None]:
                    del module[name]


def pre_wrap_hooks(peft: Any, load_base: Callable[[list[torch.nn.Module]], None]) -> list[Callable[[Any], Any]]:
    """Bridge's pre-wrap hooks: the base weights loaded into the bare chunks, then the adapters applied (base frozen)."""

    def load(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        load_base(chunks)
        return chunks

    def adapt(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        adapted = peft(chunks, training=True)
        _drop_missing_adapters(adapted)
        peft.set_params_to_save(adapted)
        return adapted

    return [load, adapt]


def is_adapter(name: str) -> bool:
    """Whether a parameter (or sharded state key) of a LoRA-wrapped chunk is an adapter's."""
    return ".adapter." in name or ".lora_" in name


@contextlib.contextmanager
def adapters_off(peft: Any, chunks: list[torch.nn.Module]) -> Iterator[None]:
    """The base model: every adapter switched off while the block runs (GRPO's reference policy under LoRA)."""
    from oumi_megatron.engine.wrappers import unwrap

    with peft.disable_adapter([unwrap(c) for c in chunks]):
        yield


@contextlib.contextmanager
def adapters_merged(peft: Any, chunks: list[torch.nn.Module]) -> Iterator[int]:
    """The policy as one set of plain weights while the block runs: each adapted linear layer's base weight becomes
    W + (alpha / r) B A (summed in fp32, rounded once, as PEFT's ``merge_and_unload``) and its adapter is switched off;
    afterwards every base weight is restored bit-exactly from a copy kept aside, and the adapters are on again. A decode
    step then runs one GEMM per projection instead of three (rollouts: ``megatron.lora_sync: merged``). The weights are
    changed in place, so CUDA graphs captured on them stay valid. Yields the bytes kept aside: the adapted layers' base
    weights on this rank (what ``oumi-megatron plan`` counts). Collective over TP (Bridge's merge gathers the adapter
    shards); every rank of a model replica must enter it."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    from oumi_megatron.engine.wrappers import unwrap

    models = [unwrap(c) for c in chunks]
    wrappers = [m for model in models for m in model.modules() if isinstance(m, AdapterWrapper) and m._adapter_enabled]
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for wrapper in wrappers:
                weight = wrapper.to_wrap.weight
                merged = _lora_delta(wrapper, weight).add_(weight)
                kept.append((weight, weight.detach().clone()))
                weight.copy_(merged)
        with peft.disable_adapter(models):
            yield sum(copy.numel() * copy.element_size() for _, copy in kept)
    finally:
        with torch.no_grad():
            for weight, copy in kept:
                weight.copy_(copy)


def _lora_delta(wrapper: Any, weight: torch.Tensor) -> torch.Tensor:
    """(alpha / r) B A of ``wrapper``'s adapters in fp32, shaped as this rank's shard of its base ``weight``.
    Canonical LoRA's fused projections (an adapter per HF projection) place each projection's update where Megatron's
    fused weight holds it: per query group of this rank its query heads, key and value (linear_qkv); gate, then up
    (linear_fc1). A projection without an adapter adds nothing."""
    from megatron.bridge.peft import canonical_lora
    from megatron.bridge.peft.lora_layers import LoRALinear
    from megatron.bridge.peft.lora_merge import LoRAMerge

    def delta(adapter: Any, rows: int) -> torch.Tensor:  # Bridge's merge gathers A or B over TP as the layer needs
        base = weight.new_zeros(rows, weight.shape[1], dtype=torch.float32)
        return LoRAMerge().merge(base, adapter.linear_out.weight.float(), adapter.linear_in.weight.float(),
                                 adapter.alpha, adapter.dim, tp_group=getattr(adapter, "tp_group", None))

    def part(name: str, rows: int) -> torch.Tensor:
        adapter = getattr(wrapper.adapter, name, None)
        return weight.new_zeros(rows, weight.shape[1], dtype=torch.float32) if adapter is None else delta(adapter, rows)

    if isinstance(wrapper, canonical_lora.LoRALinearSplitQKV):
        config = wrapper.to_wrap.config
        groups = weight.shape[0] // ((config.num_attention_heads // config.num_query_groups + 2) * config.kv_channels)
        q, kv = weight.shape[0] // groups - 2 * config.kv_channels, config.kv_channels
        parts = [part(n, groups * w).view(groups, w, -1) for n, w in (("adapter_q", q), ("adapter_k", kv), ("adapter_v", kv))]
        return torch.cat(parts, dim=1).view_as(weight)
    if isinstance(wrapper, canonical_lora.LoRALinearSplitFC1UpGate):
        half = weight.shape[0] // 2
        return torch.cat([part("adapter_gate", half), part("adapter_up", half)])
    if not isinstance(wrapper, LoRALinear):  # LoRA on MoE routers or experts is refused at validation
        raise NotImplementedError(f"merging a {type(wrapper).__name__} adapter into its base is not built")
    return delta(wrapper.adapter, weight.shape[0])


@dataclass

class AdapterWeights:
    """The whole LoRA adapter as HF PEFT writes it: ``adapter_model.safetensors``'s tensors (CPU, PEFT's names,
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and ``adapter_config.json``'s dict."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def adapter_weights(bridge: Any, chunks: list[torch.nn.Module], peft: Any, base_model: str) -> AdapterWeights:
    """Collective over the training ranks: the whole adapter on every rank (Bridge gathers it over TP / PP / EP; its
    bytes are the adapter's, ~2 r (d_in + d_out) per adapted linear layer, not the model's). ``base_model``: the HF
    name or folder the adapter applies to (its config's ``base_model_name_or_path``)."""
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple
    from megatron.bridge.models.conversion.peft_bridge import (
        build_adapter_config_dict,
        convert_adapter_weights_to_peft_state,
        infer_rank_pattern_from_adapter_weights,
        infer_target_modules_from_adapter_weights,
    )

    from oumi_megatron.engine.wrappers import unwrap

    raw = [HFWeightTuple(w.param_name, w.weight.detach().clone())
           for w in bridge.export_adapter_weights([unwrap(c) for c in chunks], cpu=True, show_progress=False)]
    if not raw:
        raise RuntimeError("no LoRA adapter weights on the model: the adapters were not applied")
    state, module_keys, target_parameters = convert_adapter_weights_to_peft_state(raw)
    config = build_adapter_config_dict(
        peft, target_modules=infer_target_modules_from_adapter_weights(module_keys), target_parameters=target_parameters,
        base_model_name_or_path=base_model, rank_pattern=infer_rank_pattern_from_adapter_weights(raw, default_rank=peft.dim))
    return AdapterWeights({k: v.contiguous() for k, v in state.items()}, config)


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""The files of an HF PEFT adapter folder."""


def save_adapter(adapter: AdapterWeights, folder: str | Path) -> Path:
    """Collective: ``folder`` as an HF PEFT adapter (``peft.PeftModel.from_pretrained(base, folder)`` loads it),
    written by rank 0 and appearing complete or not at all."""
    from safetensors.torch import save_file

    from oumi_megatron.utils.atomic import HF_ADAPTER, atomic_directory
    from oumi_megatron.utils.ranks import global_rank

    with atomic_directory(folder, HF_ADAPTER) as tmp:
        if global_rank() == 0:
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter.config, indent=2))
            save_file(adapter.tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return Path(folder)
