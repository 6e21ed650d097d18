"""``MegatronEngine``: one policy model on Megatron-Core, trained one optimizer step at a time.

The caller hands the engine this data-parallel rank's microbatches (every rank of a DP replica gets
the same ones) and a per-token loss function; the engine runs the pipeline schedule by name
(engine/parallel/schedules.py: no pipeline, 1F1B, interleaved or ZB-H1), the DP gradient reduce, gradient
clipping and the optimizer step. It also computes per-token log-probabilities without gradients.

Loss contract. ``loss_fn(logprobs, batch) -> (loss_sum, count, metrics)`` where ``logprobs[b, t]`` is
log p(``target_ids[b, t]`` | tokens up to t) at the sampling temperature, ``loss_sum`` a scalar summed
over the microbatch, ``count`` an integer tensor (tokens for a token mean, sequences for a sequence
mean) and ``metrics`` a dict of scalar sums. The gradient of a step is that of
sum(loss_sum) / sum(count) over every microbatch of every DP rank: Megatron-Core's per-token-loss
path (``calculate_per_token_loss``) divides the reduced gradients by the global count.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from oumi_megatron.engine.kernels.cuda_graphs import cuda_graphs_enabled
from oumi_megatron.engine.kernels.token_logprobs import shift_targets, token_entropy, token_logprobs
from oumi_megatron.engine.parallel.schedules import SCHEDULES, schedule_function
from oumi_megatron.engine.parallel.sequence_parallel import sequence_parallel_off
from oumi_megatron.engine.wrappers import unwrap

if TYPE_CHECKING:
    from pathlib import Path

    from oumi_megatron.config.megatron_params import MegatronParams

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """Reduced over the whole global batch (all microbatches, all DP ranks); same on every rank."""

    loss: float
    count: float
    grad_norm: float
    lr: float
    update_successful: bool
    metrics: dict[str, float] = field(default_factory=dict)
    """Sums of the loss function's metrics over the global batch."""
    schedule: str = "none"
    """The pipeline schedule that ran (engine/parallel/schedules.py)."""
    deferred_wgrad_ops: int = 0
    """Weight-gradient GEMMs ZB-H1 deferred and ran in this step, summed over all ranks (0 for other schedules)."""
    module_queue_active: bool = False
    """Whether ModuleQueue streamed the last stage's weights in this step (engine/parallel/module_queue.py)."""
    module_queue_offloaded_mib: float = 0.0
    """MiB of weights ModuleQueue released from the GPU in this step (every microbatch), summed over all ranks."""
    forward_backward_s: float = 0.0
    """Seconds of this rank's forward and backward passes (the schedule, the gradients' reduction included), up to
    the device finishing them."""
    optimizer_s: float = 0.0
    """Seconds of this rank's optimizer step (the gradient norm, the update, the distributed optimizer's gathers)."""


def forward_only(fn: Callable) -> Callable:
    """A forward-only pass of the engine (``fn``'s first argument) without autograd or sequence parallelism. With CUDA
    graphs (engine/kernels/cuda_graphs.py) it runs under ``torch.inference_mode``, which keeps Megatron-Core's layers
    eager (they would otherwise replay the fixed-shape training graphs), and its tensors are copied out of inference
    mode for later autograd use."""

    @functools.wraps(fn)
    def wrapper(self: MegatronEngine, *args: Any, **kwargs: Any) -> Any:
        with sequence_parallel_off(self.model, self.config):
            if not cuda_graphs_enabled(self.params):
                with torch.no_grad():
                    return fn(self, *args, **kwargs)
            with torch.inference_mode():
                out = fn(self, *args, **kwargs)
        return _clone_tensors(out)

    return wrapper


def _pad_sequence(v: torch.Tensor, pad: int) -> torch.Tensor:
    """A microbatch tensor padded by ``pad`` positions: [b, s] per-token values with zeros (out of the loss),
    a [b, 1, s, s] attention mask (True = not allowed) with masked rows and columns, except that a padding
    position attends to itself (as in ``block_causal_mask``: SDPA turns an empty softmax row into NaN)."""
    if not pad or v.dim() not in (2, 4):
        return v
    if v.dim() == 4:
        out = torch.nn.functional.pad(v, (0, pad, 0, pad), value=True)
        new = torch.arange(v.shape[-1], v.shape[-1] + pad)
        out[..., new, new] = False
        return out
    return torch.nn.functional.pad(v, (0, pad))


def _unpad_sequence(v: torch.Tensor, width: int) -> torch.Tensor:
    """``_pad_sequence`` undone: the first ``width`` positions of a [b, s] per-token tensor or a [b, 1, s, s]
    attention mask (views; other tensors as they are)."""
    if not torch.is_tensor(v) or v.dim() not in (2, 4) or v.shape[-1] == width:
        return v
    return v[..., :width, :width] if v.dim() == 4 else v[:, :width]


def _clone_tensors(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tensors(v) for v in value)
    return value


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> GPU without blocking the host: a pageable copy waits for the GPU to drain its queue."""
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)  # contiguous: expanded position ids


def _on_device(value: Any, device: torch.device) -> torch.Tensor:
    """A loss function's count as a tensor on ``device``; a host value becomes a fill, not a blocking copy."""
    if torch.is_tensor(value) and value.device == device:
        return value
    return torch.full((), int(value), dtype=torch.int64, device=device)


@dataclass
class _RunSettings:
    """What the forward steps and loss functions of one ``MegatronEngine._run`` call share."""

    loss_fn: LossFn
    temperature: float
    widths: list[int]
    """The caller's width of each microbatch: the loss function and what it returns see these, not the padding."""
    micro_batch_size: int
    cp: int
    """The context-parallel size: each CP rank runs its part of every sequence, the loss sees whole ones."""
    chunked: bool
    """Logprobs straight from the last hidden states (engine/kernels/chunked_logprobs.py), not from full logits."""
    chunk_tokens: int | None
    fused_logprobs: bool
    """The chunked path's statistics in compiled kernels (``megatron.logprob_fusion``)."""
    with_entropy: bool
    packing: dict[int, Any]
    """Microbatch index -> PackedSeqParams of its packed rows (the varlen kernel)."""
    keep_logits: dict[int, torch.Tensor] | None
    inference_context: Any


def _model_inputs(batch: dict[str, torch.Tensor], cp: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The model's inputs and attention mask: this CP rank's two chunks of each sequence
    (engine/parallel/context_parallel.py)."""
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "target_ids")}
    mask = batch.get("attention_mask")
    if cp > 1:
        from oumi_megatron.engine.parallel.context_parallel import cp_group, split_sequence

        inputs = {k: split_sequence(v, 1, cp, cp_group().rank()) for k, v in inputs.items()}
        if mask is not None:  # packed rows: this rank's queries against every key
            mask = split_sequence(mask, 2, cp, cp_group().rank())
    return inputs, mask


def _loss_func(run: _RunSettings, batch: dict[str, torch.Tensor], index: int, targets: torch.Tensor,
               processed: dict[str, Any]) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """Microbatch ``index``'s loss function: the caller's ``loss_fn`` on the logprobs (and entropy) of the whole
    sequence, at the caller's width; ``targets`` are this CP rank's, ``processed`` the chunked path's context."""
    from oumi_megatron.engine.parallel.context_parallel import cp_group, gather_sequence

    cp = run.cp

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if run.chunked:  # the last stage returned logprobs [b, s]
            logprobs = output
            entropy = {"entropy": processed["entropy"]} if run.with_entropy else {}
        else:  # logits [b, s, V/tp]
            if run.keep_logits is not None:
                # a copy: vocab_parallel_cross_entropy below works in place on ``logits``
                run.keep_logits[index] = output[:, run.widths[index] - 1, :].detach().float().clone()
            # before the cross entropy, which overwrites ``logits``
            entropy = {"entropy": token_entropy(output.detach(), run.temperature)} if run.with_entropy else {}
            logprobs = token_logprobs(output, targets, run.temperature)
        if cp > 1:  # the full sequence on every CP rank: the loss sees what CP = 1 sees
            logprobs = gather_sequence(logprobs, 1, cp_group())
            entropy = {k: gather_sequence(v, 1, cp_group(), differentiable=False) for k, v in entropy.items()}
        # the padding off again: the loss (and what it returns) has the caller's width
        width = run.widths[index]
        unpadded = {k: _unpad_sequence(v, width) for k, v in {**batch, "logprobs": logprobs, **entropy}.items()}
        logprobs = unpadded.pop("logprobs")
        loss_sum, count, metrics = run.loss_fn(logprobs, unpadded)
        count = _on_device(count, logprobs.device).to(torch.int)
        # Megatron-Core sums this count over DP x CP to divide the gradients: one CP rank reports it
        # (each CP rank's backward carries only its own tokens' share of the same loss)
        grad_count = count if cp == 1 or cp_group().rank() == 0 else torch.zeros_like(count)
        return loss_sum, grad_count, {"loss_sum": loss_sum.detach(), "count": count.detach(), **metrics}

    return loss_func


class MegatronEngine:
    """Model chunks + optimizer + LR schedule for one layout. Build with ``engine.builder``."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, params: MegatronParams,
                 schedule: str, peft: Any = None, lora: Any = None, base_dir: Path | None = None) -> None:
        """``peft``: Megatron-Bridge's LoRA applied to ``model`` (engine/peft.py; None: full fine-tuning), ``lora`` its
        settings (config/lora.py), ``base_dir`` the converted checkpoint its frozen base was loaded from."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        self.model = model
        self.peft, self.lora, self.base_dir = peft, lora, base_dir
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = params
        self.step_count = 0
        self.schedule = schedule  # resolved once, in engine/parallel/layout.py; looked up by name in engine/parallel/schedules.py
        self._graph_mbs: int | None = None  # the micro batch size CUDA graphs were captured for
        self.cp_whole_sequences = 1
        """The CP size while generation runs whole sequences on every CP rank (rollout/decoding/generation_mode.py)."""
        from oumi_megatron.engine.parallel.module_queue import module_queues

        self._module_queues = module_queues(model)  # the last stage's ModuleQueue, where enabled
        config = get_model_config(model[0])
        config.finalize_model_grads_func = finalize_model_grads
        if optimizer is not None:
            config.grad_scale_func = optimizer.scale_loss
        self.config = config
        from oumi_megatron.engine.kernels.attention import core_attention_name, resolve_packed_attention

        self.packed_attention, why = resolve_packed_attention(params.transformer_config.packed_attention,
                                                              core_attention_name(model[0]), config.params_dtype,
                                                              torch.cuda.is_available(), cp=config.context_parallel_size > 1)
        logger.info("packed rows attend through: %s", why)
        chunk = self.logprob_chunk_tokens()
        logger.info("token logprobs: %s", "full logits" if chunk is None else
                    f"chunked from the hidden states ({chunk} tokens per chunk)" if chunk else
                    "chunked from the hidden states where a microbatch's fp32 logits pass 512 MiB (auto), full logits below")

    # ----------------------------------------------------------------------------------------------
    # Running the schedule
    # ----------------------------------------------------------------------------------------------
    def _prepare(self, microbatches: list[dict[str, torch.Tensor]],
                 pad_to: int | None = None) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """Same sequence length for every microbatch (pipeline p2p shapes are fixed per step): the longest,
        or ``pad_to`` (CUDA graphs' fixed length); a multiple of 2 x CP under context parallelism and of TP
        under sequence parallelism (each rank holds equal parts; the padding is out of the loss)."""
        seq_len = max(mb["input_ids"].shape[1] for mb in microbatches)
        # each CP rank holds 2 chunks of the sequence, and under SP each TP rank an equal slice of those
        multiple = 2 * self.config.context_parallel_size if self.config.context_parallel_size > 1 else 1
        if self.config.sequence_parallel:
            multiple *= self.config.tensor_model_parallel_size
        seq_len = -(-seq_len // multiple) * multiple
        if pad_to is not None:
            if seq_len > pad_to:
                raise ValueError(
                    f"a microbatch has {seq_len} tokens, more than megatron.transformer_config.cuda_graph_seq_length="
                    f"{pad_to} (CUDA graphs have fixed shapes): raise cuda_graph_seq_length to the longest prompt + completion")
            seq_len = pad_to
        mbs = microbatches[0]["input_ids"].shape[0]
        out = []
        for mb in microbatches:
            if mb["input_ids"].shape[0] != mbs:
                raise ValueError("all microbatches of a step must have the same micro batch size")
            pad = seq_len - mb["input_ids"].shape[1]
            padded = {k: _pad_sequence(v, pad) for k, v in mb.items() if v is not None}
            ids = padded["input_ids"]
            padded.setdefault("target_ids", shift_targets(ids))
            if "position_ids" not in mb:
                padded["position_ids"] = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
            out.append(padded)
        return out, seq_len, mbs

    def logprob_chunk_tokens(self) -> int | None:
        """Tokens per chunk of the chunked logprob path (0 = auto-sized), or None for full logits."""
        value = self.params.logprob_chunk_tokens
        if value is None:
            return 0 if torch.cuda.is_available() else None
        return int(value) or None

    def logprob_fusion(self) -> bool:
        """Whether the chunked logprob path compiles its statistics (``megatron.logprob_fusion``; null: with CUDA)."""
        value = self.params.logprob_fusion
        return torch.cuda.is_available() if value is None else bool(value)

    def chunks_logprobs(self, tokens_per_microbatch: int) -> bool:
        """Whether a training / logprob pass over microbatches of this many tokens takes the chunked logprob
        path (auto: only where one microbatch's fp32 logits would pass one chunk, engine/kernels/chunked_logprobs.py)."""
        chunk = self.logprob_chunk_tokens()
        if chunk is None or chunk > 0:
            return chunk is not None
        from megatron.core import parallel_state

        from oumi_megatron.engine.kernels.chunked_logprobs import worth_chunking

        vocab_shard = unwrap(self.model[0]).vocab_size // parallel_state.get_tensor_model_parallel_world_size()
        return worth_chunking(tokens_per_microbatch, vocab_shard)

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: its current CUDA device, or the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _run(
        self,
        microbatches: list[dict[str, torch.Tensor]],
        loss_fn: LossFn,
        temperature: float,
        forward_only: bool,
        keep_logits: dict[int, torch.Tensor] | None = None,
        with_entropy: bool = False,
        inference_context: Any = None,
    ) -> list[dict[str, Any]]:
        """Run the schedule. ``keep_logits`` receives each microbatch's last-position logits;
        ``inference_context`` (a KV cache) is handed to the model, microbatch i using cache rows
        from i * micro_batch_size."""
        # The caller's widths: _prepare pads every microbatch to one length (a multiple of 2 x CP, of TP under SP,
        # CUDA graphs' fixed length); the loss function and everything returned see these widths again.
        widths = [mb["input_ids"].shape[1] for mb in microbatches]
        batches, seq_len, mbs = self._pad_microbatches(microbatches, forward_only)
        device = self.device
        # not under training CUDA graphs: PackedSeqParams is no graph input (Megatron-Core made a graph per microbatch
        # of it and its capture failed); padded rows take the causal path there, the same attention for them
        varlen = self.packed_attention == "varlen" and inference_context is None and not self._graphed(forward_only)
        packing = self._varlen_packing(batches, seq_len) if varlen else {}
        batches = [{**{k: _to_device(v, device) for k, v in b.items()}, "_index": torch.tensor(i)} for i, b in enumerate(batches)]
        # Logprobs straight from the last hidden states (no full logits) unless the logits themselves are
        # wanted (generation keeps the last position's) or a KV cache is in use.
        chunk = self.logprob_chunk_tokens()
        cp = self.config.context_parallel_size
        chunked = keep_logits is None and inference_context is None and self.chunks_logprobs(mbs * seq_len // cp)
        if cp > 1 and (keep_logits is not None or inference_context is not None):  # generation runs whole sequences
            raise ValueError("context parallelism splits training and logprob passes; generation runs whole sequences")
        run = _RunSettings(loss_fn=loss_fn, temperature=temperature, widths=widths, micro_batch_size=mbs, cp=cp,
                           chunked=chunked, chunk_tokens=chunk, fused_logprobs=self.logprob_fusion(),
                           with_entropy=with_entropy, packing=packing,
                           keep_logits=keep_logits, inference_context=inference_context)
        return self._run_schedule(partial(self._forward_step, run), batches, seq_len, mbs, forward_only)

    def _pad_microbatches(self, microbatches: list[dict[str, torch.Tensor]],
                          forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], int, int]:
        """``_prepare``, at CUDA graphs' fixed length where training runs through them (graphs also fix the
        micro batch size: the one they were captured for)."""
        graphs = self._graphed(forward_only)
        batches, seq_len, mbs = self._prepare(microbatches, self.params.transformer_config.cuda_graph_seq_length if graphs else None)
        if graphs:
            if self._graph_mbs is not None and mbs != self._graph_mbs:
                raise ValueError(f"CUDA graphs were captured for micro batch size {self._graph_mbs}; this step has {mbs}. "
                                 "Keep megatron.micro_batch_size fixed, or set cuda_graph_impl: none")
            self._graph_mbs = mbs
        return batches, seq_len, mbs

    def _graphed(self, forward_only: bool) -> bool:
        """Whether a pass runs through the training CUDA graphs: training passes with them on; forward-only passes
        stay eager (``forward_only``)."""
        return not forward_only and cuda_graphs_enabled(self.params)

    def _varlen_packing(self, batches: list[dict[str, torch.Tensor]], seq_len: int) -> dict[int, Any]:
        """Packed rows through the varlen kernel: microbatch index -> PackedSeqParams, the sequence boundaries
        from the segment ids (on the host). Their [T x T] masks are dropped from ``batches``: nothing to move or read."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from oumi_megatron.engine.kernels.attention import cumulative_seqlens

        device = self.device
        packing: dict[int, Any] = {}
        for i, b in enumerate(batches):
            if "segment_ids" in b:
                cu = _to_device(cumulative_seqlens(b["segment_ids"]), device)
                # max_seqlen = the row length: an upper bound is all the kernel needs (no device sync
                # for the true longest), and GPTModel sizes its rotary table by it (RoPE runs over the
                # row's positions, as on the mask path: relative, so a sequence's offset cancels)
                packing[i] = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                             max_seqlen_q=seq_len, max_seqlen_kv=seq_len)
                b.pop("attention_mask", None)
        return packing

    def _forward_step(self, run: _RunSettings, data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        """Megatron-Core's forward step: the next microbatch (this CP rank's part of it) through ``model``, and
        the loss function the schedule applies to the last stage's output."""
        batch = next(data_iterator)
        index = int(batch["_index"])
        extra: dict[str, Any] = {}
        if run.inference_context is not None:
            run.inference_context.batch_size_offset = index * run.micro_batch_size  # the cache rows of this microbatch
            extra["inference_context"] = run.inference_context
        if index in run.packing:
            extra["packed_seq_params"] = run.packing[index]
        inputs, mask = _model_inputs(batch, run.cp)
        processed: dict[str, Any] = {}  # the chunked path's output processor leaves the entropy here
        if run.chunked:
            from oumi_megatron.engine.kernels.chunked_logprobs import logprob_output_processor

            extra["output_processor"] = logprob_output_processor
            extra["output_processor_context"] = processed = {
                "targets": inputs["target_ids"], "temperature": run.temperature, "chunk_tokens": run.chunk_tokens,
                "fused": run.fused_logprobs,
                "with_entropy": run.with_entropy}
        output = model(
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            attention_mask=mask,
            **extra,
        )
        return output, _loss_func(run, batch, index, inputs["target_ids"], processed)

    def _run_schedule(self, forward_step: Callable, batches: list[dict[str, torch.Tensor]], seq_len: int, mbs: int,
                      forward_only: bool) -> list[dict[str, Any]]:
        """The pipeline schedule named at build time over ``batches``; what the last stage's loss functions returned."""
        # One iterator per model chunk (interleaved schedules pull from each).
        n = len(batches)
        iterators = [iter(batches) for _ in self.model] if len(self.model) > 1 else iter(batches)
        return schedule_function(self.schedule)(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=self.model,
            num_microbatches=n,
            # Megatron-Core divides the p2p length by the CP group's size; generation runs whole sequences
            seq_length=seq_len * self.cp_whole_sequences,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    # ----------------------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict[str, torch.Tensor]], loss_fn: LossFn, temperature: float = 1.0,
                   with_entropy: bool = False) -> StepResult:
        """One optimizer step over this DP rank's microbatches (each: ``input_ids`` [mbs, seq] + loss inputs).
        ``with_entropy``: the loss function also sees ``entropy`` [b, T] (no gradient) in its batch."""
        for chunk in self.model:
            chunk.train()
            # Megatron-Core's DDP wrapper method; torch types a Module's attributes as Tensor | Module
            chunk.zero_grad_buffer()  # type: ignore[operator]
        self.optimizer.zero_grad()
        for queue, param_buffers in self._module_queues:
            queue.begin_step(param_buffers)
        started = time.perf_counter()
        try:
            outputs = self._run(microbatches, loss_fn, temperature, forward_only=False, with_entropy=with_entropy)
        finally:  # every weight back on the GPU before the optimizer step (also after an error)
            for queue, _ in self._module_queues:
                queue.end_step()
        if self.device.type == "cuda":  # costs nothing: the optimizer step waits for the gradients anyway
            torch.cuda.synchronize(self.device)
        forward_backward_s = time.perf_counter() - started
        deferred = self._deferred_wgrad_ops()
        mq_active, mq_mib = self._module_queue_stats()
        started = time.perf_counter()
        update_successful, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        optimizer_s = time.perf_counter() - started  # its device time is in: the step reads the gradient norm on the host
        self.step_count += 1
        totals = self._reduce_metrics(outputs)
        count = totals.pop("count")
        loss_sum = totals.pop("loss_sum")
        return StepResult(
            loss=loss_sum / max(count, 1.0),
            count=count,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            update_successful=bool(update_successful),
            metrics=totals,
            schedule=self.schedule,
            deferred_wgrad_ops=deferred,
            module_queue_active=mq_active,
            module_queue_offloaded_mib=mq_mib,
            forward_backward_s=forward_backward_s,
            optimizer_s=optimizer_s,
        )

    def _module_queue_stats(self) -> tuple[bool, float]:
        """(ModuleQueue ran on some rank, MiB it released over all ranks) for the step just run."""
        if not self.params.enable_module_queue:
            return False, 0.0
        stats = torch.tensor([float(len(self._module_queues)),
                              sum(q.module_queue_offloaded_bytes for q, _ in self._module_queues) / 2**20],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(stats)
        return bool(stats[0] > 0), float(stats[1])

    def _deferred_wgrad_ops(self) -> int:
        """Deferred weight-gradient GEMMs (ZB-H1's count) in the step just run, summed over all ranks."""
        if not SCHEDULES.get(self.schedule).defers_weight_gradients:
            return 0
        from oumi_megatron.engine.parallel.zero_bubble import WeightGradStore

        count = torch.tensor([WeightGradStore.executed], dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        return int(count.item())

    @forward_only
    def compute_logprobs(self, microbatches: list[dict[str, torch.Tensor]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token logprobs of each microbatch's ``input_ids`` (targets = next tokens), on every rank
        of this DP replica; shape of each: its own ``input_ids``' [mbs, seq] (the padding the engine adds is removed)."""
        return self._forward_only_per_token(microbatches, temperature, with_entropy=False)[0]

    @forward_only
    def compute_logprobs_and_entropy(
        self, microbatches: list[dict[str, torch.Tensor]], temperature: float = 1.0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``compute_logprobs`` plus the entropy of the sampling distribution softmax(logits / T) at every position."""
        return self._forward_only_per_token(microbatches, temperature, with_entropy=True)

    def _forward_only_per_token(
        self, microbatches: list[dict[str, torch.Tensor]], temperature: float, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from megatron.core import parallel_state as ps

        for chunk in self.model:
            chunk.eval()
        names = ["logprobs", "entropy"] if with_entropy else ["logprobs"]

        def keep(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
            values = {"logprobs": logprobs.detach(), "entropy": batch.get("entropy")}
            return logprobs.new_zeros(()), torch.ones((), dtype=torch.int), {k: values[k] for k in names}

        outputs = self._run(microbatches, keep, temperature, forward_only=True, with_entropy=with_entropy)
        result: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        for i, mb in enumerate(microbatches):
            for name in names:
                if ps.is_pipeline_last_stage(ignore_virtual=True):
                    t = outputs[i][name].float().contiguous()
                else:
                    t = torch.empty(mb["input_ids"].shape, dtype=torch.float32, device=self.device)
                result[name].append(self.from_last_stage(t).cpu())
        return result["logprobs"], result.get("entropy", [])

    def last_position_logits(self, microbatches: list[dict[str, torch.Tensor]],
                             inference_context: Any = None) -> dict[int, torch.Tensor]:
        """A forward-only pass (the caller holds ``forward_only``'s state) of ``microbatches`` (``input_ids``,
        ``position_ids``, ``attention_mask``) keeping each one's last-position logits: microbatch index -> its fp32
        (vocab-parallel) logits, on the last pipeline stage ({} elsewhere). ``inference_context`` (a Megatron-Core KV
        cache) is handed to the model, microbatch i using cache rows from i * micro_batch_size."""

        def no_loss(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple:
            return logprobs.new_zeros(()), torch.ones((), dtype=torch.int), {}

        captured: dict[int, torch.Tensor] = {}
        self._run(microbatches, no_loss, 1.0, forward_only=True, keep_logits=captured, inference_context=inference_context)
        return captured

    @staticmethod
    def from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as filled on the last pipeline stage, on every rank of the pipeline group
        (other ranks pass a buffer of the same shape and dtype)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return tensor

    def _reduce_metrics(self, outputs: list[dict[str, Any]]) -> dict[str, float]:
        """Sum metric dicts over microbatches (last stage), then over DP, then share with all PP ranks. Keys
        ending in ``_max`` are maxima instead (over microbatches and DP)."""
        from megatron.core import parallel_state as ps

        keys = sorted(outputs[0].keys()) if outputs else []
        n_keys = self.from_last_stage(torch.tensor([len(keys)], dtype=torch.int64, device=self.device))
        sums = torch.zeros(int(n_keys.item()), dtype=torch.float64, device=self.device)
        maxima = torch.full_like(sums, -math.inf)
        if outputs:
            for out in outputs:
                v = torch.stack([torch.as_tensor(out[k], dtype=torch.float64, device=sums.device) for k in keys])
                sums += v
                maxima = torch.maximum(maxima, v)
        # both collectives on every rank (a first stage does not know the keys); a non-last stage's result is
        # replaced by the last stage's below
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        is_max = torch.tensor([k.endswith("_max") for k in keys], dtype=torch.bool, device=sums.device)
        values = torch.where(is_max, maxima, sums) if outputs else sums
        self.from_last_stage(values)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            keys = self._broadcast_keys(keys)
        return dict(zip(keys, values.tolist()))

    @staticmethod
    def _broadcast_keys(keys: list[str]) -> list[str]:
        from megatron.core import parallel_state as ps

        box = [keys]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return box[0]
