"""ZB-H1, the zero-bubble pipeline schedule with 1F1B's memory (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024; seed 003).

A linear layer's backward is two GEMMs: B, the input gradient the previous stage waits for, and W, the
weight gradient nobody waits for within the step. 1F1B runs them together; ZB-H1 runs B at once and
defers W, so input gradients travel upstream sooner, and the deferred W fill the bubbles that 1F1B
leaves in its cool-down. Stage ``r`` (0 = first) keeps the W of its first ``r`` backward passes
queued and from then on runs the oldest queued W after each backward pass; what is left runs before the
gradient reduce and the optimizer step (``pop_all``). With F = B = W the step takes
``m (F + B + W) + (p - 1)(F + B - W)`` against 1F1B's ``(m + p - 1)(F + B + W)``.

How W is captured: Megatron-Core's linear layers, under ``gradient_accumulation_fusion``, hand their
weight gradient to ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(input, grad_output,
main_grad)``, which engine/kernels/fusions.py supplies (``TorchWgradAccumulation``). While a ZB-H1 backward pass
runs, that call is queued in ``WeightGradStore`` instead (the input and output-gradient tensors stay
alive until it runs), so zb_h1 turns gradient accumulation fusion on. Gradients of parameters outside
linear layers (norms, embeddings) and the chunked-logprob output layer are not deferred. Each
parameter's gradient is accumulated in the same microbatch order as under 1F1B, so the result is the
same: tests/test_engine.py compares losses, gradients and weights with the 1F1B run.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from oumi_megatron.bridge_utils import have_transformer_engine

if TYPE_CHECKING:
    from oumi_megatron.config.megatron_params import MegatronParams

WgradOp = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]]


def zb_h1_unsupported_reason(params: MegatronParams) -> str | None:
    """Why ZB-H1 cannot run with these settings (seed 003's ``WeightGradStore.is_supported``), or None."""
    if params.pipeline_model_parallel_size <= 1:
        return "pipeline_model_parallel_size is 1 (no pipeline)"
    if params.virtual_pipeline_model_parallel_size:
        return "virtual_pipeline_model_parallel_size is set (ZB-H1 does not interleave)"
    if params.ddp_config.overlap_grad_reduce:
        return "ddp_config.overlap_grad_reduce is on (its reduce hooks would fire before the deferred weight gradients)"
    if have_transformer_engine():
        return "TransformerEngine layers are in use (their weight-gradient work cannot be deferred)"
    return None


class WeightGradStore:
    """Deferred weight-gradient GEMMs (seed 003's API): ``put`` queues one during a deferring backward
    pass, ``flush`` closes the pass's group (one W), ``pop`` runs the oldest group, ``pop_all`` the rest.
    ``executed`` counts the GEMMs run from the store (the ``pipeline/deferred_wgrad_ops`` metric)."""

    _deferring = False
    _cache: list[WgradOp] = []
    _queue: deque[list[WgradOp]] = deque()
    executed = 0

    @classmethod
    def is_supported(cls, params: MegatronParams) -> bool:
        return zb_h1_unsupported_reason(params) is None

    @classmethod
    @contextlib.contextmanager
    def deferring(cls) -> Iterator[None]:
        """Weight-gradient GEMMs issued inside are queued instead of run."""
        cls._deferring = True
        try:
            yield
        finally:
            cls._deferring = False

    @classmethod
    def put(cls, total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor,
            func: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        if not cls._deferring:
            func(total_input, grad_output, main_grad)
            return
        cls._cache.append((total_input, grad_output, main_grad, func))

    @classmethod
    def flush(cls) -> None:
        cls._queue.append(cls._cache)
        cls._cache = []

    @classmethod
    def pop(cls) -> None:
        if not cls._queue:
            raise RuntimeError("WeightGradStore.pop: no deferred weight gradients (the schedule popped more W than it deferred)")
        with torch.no_grad(), PhaseTimes.measure("W"):  # no_grad: as inside autograd's backward
            for total_input, grad_output, main_grad, func in cls._queue.popleft():
                func(total_input, grad_output, main_grad)
                cls.executed += 1

    @classmethod
    def pop_all(cls) -> None:
        while cls._queue:
            cls.pop()

    @classmethod
    def reset(cls) -> None:
        """Drops queued work (after a failed step) and zeroes the counter."""
        cls._deferring, cls._cache, cls._queue, cls.executed = False, [], deque(), 0


class PhaseTimes:
    """Optional per-microbatch times of F, B and W on this rank (``PhaseTimes.enabled = True``, as
    scripts/bench_train_step.py sets it): CUDA events, read once at the end of the step."""

    enabled = False
    _marks: dict[str, list[tuple[Any, Any]]] = {}

    @classmethod
    @contextlib.contextmanager
    def measure(cls, phase: str) -> Iterator[None]:
        if not cls.enabled or not torch.cuda.is_available():
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        cls._marks.setdefault(phase, []).append((start, end))

    @classmethod
    def mean_ms(cls) -> dict[str, float]:
        """Mean milliseconds per occurrence of each phase since the last call (synchronizes the device)."""
        torch.cuda.synchronize()
        out = {k: sum(s.elapsed_time(e) for s, e in v) / len(v) for k, v in cls._marks.items() if v}
        cls._marks = {}
        return out


def forward_backward_zb_h1(
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Megatron-Core's forward-backward interface (as ``forward_backward_pipelining_without_interleaving``),
    running ZB-H1. Forward-only passes have no backward to split and run Megatron-Core's 1F1B."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    if forward_only:
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=True, **kwargs)
    step = _ZbH1Step(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size)
    no_sync = (step.config.no_sync_func or contextlib.nullcontext)()
    no_sync.__enter__()  # one gradient reduce per step, after every W (finalize_model_grads below)
    try:
        step.warmup_forwards()
        step.steady_1f1b()
        step.cooldown_backwards()
        WeightGradStore.pop_all()
    except BaseException:
        WeightGradStore.reset()
        raise
    finally:
        no_sync.__exit__(None, None, None)
    step.finalize_model_grads()
    return step.outputs


class _ZbH1Step:
    """One ZB-H1 training step on this pipeline stage: the state its phases share. The phases run in order
    (warm-up forwards, steady 1F1B, cool-down backwards); their p2p calls pair with the neighbouring stages'."""

    def __init__(self, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                 seq_length: int, micro_batch_size: int) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.pipeline_parallel.schedules import _build_default_pg_collection, get_tensor_shapes
        from megatron.core.utils import get_model_config

        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.model = model[0] if isinstance(model, list) else model
        self.data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        config = self.config = get_model_config(self.model)
        if config.defer_embedding_wgrad_compute or config.overlap_p2p_comm:
            raise ValueError("zb_h1 runs without defer_embedding_wgrad_compute and overlap_p2p_comm")
        comm = self.comm = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
        groups = self.groups = _build_default_pg_collection()
        self.shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=None,
                                        config=config, tp_group=groups.tp, cp_group=groups.cp)
        self.first, self.last = comm.is_pp_first_stage, comm.is_pp_last_stage
        self.rank = comm.current_stage
        self.warmup = min(comm.total_stages - self.rank - 1, num_microbatches)
        self.steady = num_microbatches - self.warmup
        WeightGradStore.reset()

        self.outputs: list[Any] = []  # the loss-function outputs of the last stage, as Megatron's schedules return them
        self.total_tokens = torch.zeros([], dtype=torch.int, device="cuda")
        self.in_flight: deque[tuple[Any, Any]] = deque()  # (input, output) of microbatches awaiting backward

    def forward(self, microbatch: int, input_tensor: Any) -> Any:
        """F of one microbatch; its output stays in ``in_flight`` (the caller's) until its backward."""
        from megatron.core.pipeline_parallel.schedules import forward_step

        with PhaseTimes.measure("F"):
            output, tokens = forward_step(self.forward_step_func, self.data_iterator, self.model, self.num_microbatches,
                                          input_tensor, self.outputs, self.config, cp_group_size=self.groups.cp.size(),
                                          is_first_microbatch=microbatch == 0, current_microbatch=microbatch,
                                          is_last_stage=self.last)
        self.total_tokens += tokens
        return output

    def backward(self, output_grad: Any) -> Any:
        """B of the oldest microbatch in flight now, its W queued as one group."""
        from megatron.core.pipeline_parallel.schedules import backward_step

        input_tensor, output = self.in_flight.popleft()
        with WeightGradStore.deferring(), PhaseTimes.measure("B"):
            input_grad = backward_step(input_tensor, output, output_grad, self.config)
        WeightGradStore.flush()
        return input_grad

    def warmup_forwards(self) -> None:
        """Stage r runs ``p - r - 1`` forwards before its first backward (as 1F1B)."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        comm, shapes = self.comm, self.shapes
        for i in range(self.warmup):
            input_tensor = comm.recv_forward(shapes, self.first)
            output = self.forward(i, input_tensor)
            comm.send_forward(output, self.last)
            self.in_flight.append((input_tensor, output))
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def steady_1f1b(self) -> None:
        """One forward, one B per microbatch (as 1F1B), and after each B the oldest deferred W, once this stage
        has deferred the W of its first r backward passes."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        comm, shapes, first, last, steady = self.comm, self.shapes, self.first, self.last, self.steady
        input_tensor = comm.recv_forward(shapes, first) if steady > 0 else None
        for i in range(steady):
            output = self.forward(self.warmup + i, input_tensor)
            output_grad = comm.send_forward_recv_backward(output, shapes, last)
            self.in_flight.append((input_tensor, output))
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
            input_grad = self.backward(output_grad)
            if i == steady - 1:
                comm.send_backward(input_grad, first)
                input_tensor = None
            else:
                input_tensor = comm.send_backward_recv_forward(input_grad, shapes, first)
            if i >= self.rank:  # stage r has deferred the W of its first r backward passes
                WeightGradStore.pop()

    def cooldown_backwards(self) -> None:
        """The warm-up microbatches' backwards; the deferred W fill the wait for the next output gradient."""
        comm = self.comm
        for i in range(self.warmup):
            output_grad = comm.recv_backward(self.shapes, self.last)
            comm.send_backward(self.backward(output_grad), self.first)
            if self.steady + i >= self.rank:
                WeightGradStore.pop()

    def finalize_model_grads(self) -> None:
        """The step's one gradient reduce (Megatron-Core's ``finalize_model_grads``), after every W ran."""
        config = self.config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func([self.model], self.total_tokens if config.calculate_per_token_loss else None,
                                             pg_collection=self.groups)
