"""ModuleQueue (seed 000): the last pipeline stage's GPTModel, streaming weights between GPU and host.

The last stage holds its transformer layers and the output layer (vocabulary x hidden) at once, and in
GRPO with 128k-152k vocabularies it is the memory peak. During a training forward pass ModuleQueue
releases each transformer layer's weights as soon as the layer is done (they are next needed in that
microbatch's backward pass) while the output layer, kept on the host between microbatches, streams
back in ``num_chunks`` row chunks. In the backward pass the output layer is released once its backward
is done, and the layers come back last-first, each one prefetched while the layer after it runs its
backward.

How storage is really released. Each offloaded parameter must own its storage: the tensor's
``untyped_storage()`` is resized to 0 bytes (the memory goes back to the caching allocator) and later
resized back and filled from the host copy, in place, so every reference (autograd's saved tensors,
the optimizer, DDP's hooks) sees the same tensor again. Without the distributed optimizer Megatron-Core's DDP
leaves parameters in their own storage. The distributed optimizer keeps them as views into one contiguous
buffer: for the forward and backward passes of a step the buffer is copied to the host and freed and each
parameter gets its own storage; before the optimizer step the buffer comes back from the host copy and
the parameters point into it again. Gradients (DDP's contiguous fp32 ``main_grad`` buffer) and the
optimizer state stay where they are.

Invariants. Between training steps every weight is on the GPU (checkpoints, export, weight sync and
inference passes see the model as it is); ``begin_step`` marks the host copies stale (the optimizer has
changed the weights), so the first microbatch of a step copies to the host and later ones only release.
Before any use a weight is resident: a forward pass first makes released layers resident (schedules
other than 1F1B may run two forward passes before a backward), and the output layer's and each layer's
backward wait for their loads. ``end_step`` (also on errors) makes everything resident again.
Under full recompute the step's forward runs without gradients inside Megatron's checkpoint and each
layer's forward runs again in the backward pass: there the layer is not released (its backward follows)
and its pre-hook prefetches the layer the backward pass needs next.

Copies run on side streams (device -> host and host -> device separately, pinned host memory); the
compute stream waits on an event before it reads a loaded weight, and a released weight's memory is
not reused before its device -> host copy ends (``record_stream``). On the CPU (tests) the same
release and restore happen with synchronous copies.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel  # importers load this module lazily: Megatron-Core imports are heavy

from oumi_megatron.engine.wrappers import unwrap

logger = logging.getLogger("oumi")  # Oumi's logger where Oumi is installed


class StreamedWeights:
    """The parameters of one module, releasable from the GPU and restorable in place from a host copy."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], check_owned: bool = True):
        for p in params if check_owned else ():
            storage = p.data.untyped_storage()
            if p.data.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
                raise ValueError(
                    f"ModuleQueue: a parameter of {name} shares its storage with other tensors and no DDP parameter "
                    "buffer holds it; ModuleQueue cannot release it alone. Set megatron.enable_module_queue: false.")
        self.name = name
        self.params = params
        self.nbytes = sum(p.numel() * p.element_size() for p in params)
        self.resident = True
        self.host_current = False  # the host copies hold the current weights
        self._host: list[torch.Tensor] | None = None
        self._loaded: torch.cuda.Event | None = None  # the host -> device copy the compute stream must wait for
        self._stored: torch.cuda.Event | None = None  # the device -> host copy a later load must wait for
        self._loading_rows: tuple[int, int] | None = None  # (rows issued, total) while a chunked load is under way

    @property
    def on_cuda(self) -> bool:
        return self.params[0].is_cuda

    def release(self, d2h: torch.cuda.Stream | None) -> int:
        """Frees the GPU storage (copying to the host first when the host copy is stale); bytes released."""
        if not self.resident:
            return 0
        self.wait()
        if not self.host_current:
            if self._host is None:
                self._host = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self.on_cuda) for p in self.params]
            if d2h is not None:
                d2h.wait_stream(torch.cuda.current_stream())  # the weights as the compute stream left them
                with torch.cuda.stream(d2h):
                    for h, p in zip(self._host, self.params):
                        h.copy_(p.data, non_blocking=True)
                    self._stored = torch.cuda.Event()
                    self._stored.record(d2h)
            else:
                for h, p in zip(self._host, self.params):
                    h.copy_(p.data)
            self.host_current = True
        for p in self.params:
            if d2h is not None:
                p.data.record_stream(d2h)  # the memory is reused only after the copy to the host ends
            p.data.untyped_storage().resize_(0)
        self.resident, self._loading_rows = False, None
        return self.nbytes

    def load(self, h2d: torch.cuda.Stream | None, chunk: int = 0, num_chunks: int = 1) -> None:
        """Starts restoring the weights (or row chunk ``chunk`` of ``num_chunks`` of a single 2-D weight)."""
        if self.resident and self._loading_rows is None:
            return
        if not self.resident:  # allocate in place, on the compute stream (its earlier work may still use the memory)
            for p in self.params:
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
            self.resident = True
            self._loading_rows = (0, num_chunks)
        assert self._loading_rows is not None  # set above, or by the chunked load under way
        done, total = self._loading_rows
        if chunk < done:
            return
        if h2d is not None:
            h2d.wait_stream(torch.cuda.current_stream())  # the memory was allocated on the compute stream
            if self._stored is not None:
                h2d.wait_event(self._stored)
        assert self._host is not None  # released before (release or adopt_host), so the host copy exists
        with torch.cuda.stream(h2d) if h2d is not None else contextlib.nullcontext():
            for c in range(done, chunk + 1):
                for h, p in zip(self._host, self.params):
                    if total == 1:
                        p.data.copy_(h, non_blocking=h2d is not None)
                    else:
                        rows = _rows(p.shape[0], c, total)
                        p.data[rows].copy_(h[rows], non_blocking=h2d is not None)
            if h2d is not None:
                self._loaded = torch.cuda.Event()
                self._loaded.record(h2d)
        self._loading_rows = None if chunk + 1 >= total else (chunk + 1, total)

    def ensure(self, h2d: torch.cuda.Stream | None) -> None:
        """Resident and readable by the compute stream (loads whatever is missing, then waits)."""
        if not self.resident or self._loading_rows is not None:
            total = self._loading_rows[1] if self._loading_rows else 1
            self.load(h2d, total - 1, total)
        self.wait()

    def adopt_host(self, host: list[torch.Tensor], stored: torch.cuda.Event | None) -> None:
        """Released state with the given host copies (current; ``stored``: the copy still in flight)."""
        self._host, self._stored = host, stored
        self.resident, self.host_current, self._loading_rows, self._loaded = False, True, None, None

    def wait(self) -> None:
        if self._loaded is not None:
            torch.cuda.current_stream().wait_event(self._loaded)
            self._loaded = None


def _on_grad(tensor: Any, callback: Callable[[], None]) -> None:
    """Runs ``callback`` when autograd reaches ``tensor``: after the backward of everything that used it,
    before the backward of the module that produced it (a tensor hook; the gradient is left unchanged)."""
    if torch.is_tensor(tensor) and tensor.requires_grad:
        tensor.register_hook(lambda grad: callback())


def _rows(n: int, chunk: int, num_chunks: int) -> slice:
    return slice(n * chunk // num_chunks, n * (chunk + 1) // num_chunks)


class ModuleQueue(GPTModel):
    """Drop-in GPTModel for the stage with ``post_process=True`` (seed 000). Configured by
    ``config.enable_module_queue`` and ``config.module_queue_num_chunks``; inactive on other stages and in
    forward passes without gradients. Debugging attributes: ``_module_queue_enabled``, ``num_chunks``,
    ``num_layers``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._setup_module_queue()

    @classmethod
    def adopt(cls, model: Any) -> Any:
        """Turns a built GPTModel (Megatron-Bridge's provider builds GPTModel) into a ModuleQueue, in place."""
        model.__class__ = cls
        model._setup_module_queue()
        return model

    def _setup_module_queue(self) -> None:
        self.num_chunks = int(getattr(self.config, "module_queue_num_chunks", 4))
        self.num_layers = len(self.decoder.layers)
        self._module_queue_enabled = bool(getattr(self.config, "enable_module_queue", False)) and self.post_process
        self._mq_in_step = False
        self._mq_backward = False  # between the output layer's backward and the next forward (recompute runs here)
        self._mq_layers: list[StreamedWeights] | None = None  # built on first use: after .cuda() and DDP
        self._mq_output: StreamedWeights | None = None
        self._mq_streams: tuple[Any, Any] = (None, None)
        self.module_queue_offloaded_bytes = 0  # released from the GPU since begin_step
        self._mq_buffers: list[Any] = []  # DDP parameter buffers detached for the step (distributed optimizer)
        self._mq_buffer_host: dict[int, torch.Tensor] = {}
        if self._module_queue_enabled:
            for i, layer in enumerate(self.decoder.layers):
                layer.register_forward_pre_hook(self._make_layer_pre_hook(i))
                layer.register_forward_hook(self._make_layer_hook(i))
            self.decoder.register_forward_hook(self._decoder_hook)

    # -- step boundaries (the engine's train_step) ------------------------------------------------
    def begin_step(self, param_buffers: Iterable[Any] = ()) -> None:
        """A training step starts: the optimizer changed the weights, so the host copies are stale.
        ``param_buffers``: DDP's parameter buffers of this model chunk; under the distributed optimizer
        the parameters are views into them and are detached for the step (``_detach_from_buffers``)."""
        if not self._module_queue_enabled:
            return
        self._mq_buffers = [b for b in param_buffers if getattr(b, "param_data", None) is not None]
        if self._mq_buffers:
            self._detach_from_buffers()
        else:
            self._build_streamed()
            for w in self._all_streamed():
                w.host_current = False
        self.module_queue_offloaded_bytes = 0
        self._mq_in_step, self._mq_backward = True, False

    def end_step(self) -> None:
        """Every weight back on the GPU (before the optimizer step, checkpoints, export, weight sync)."""
        self._mq_in_step = False
        if self._mq_layers is None:
            return
        if self._mq_buffers:  # the buffer comes back whole from its host copy: no per-layer loads
            self._attach_to_buffers()
            return
        for w in self._all_streamed():
            w.ensure(self._mq_streams[1])

    # -- the distributed optimizer's contiguous parameter buffer ------------------------------------
    # Its parameters are views into one buffer per dtype, so a layer cannot be released alone. For the
    # forward/backward passes the buffer is copied to the host once and freed, each parameter gets its
    # own storage (released for the streamed ones, filled at once for the rest), and ``end_step``
    # restores the buffer from the host copy (the weights do not change within the passes) and points
    # the parameters back into it before the optimizer step, which reads and writes the buffer.
    def _detach_from_buffers(self) -> None:
        d2h = self._mq_streams[0] if self._mq_streams[0] is not None else self._make_streams()[0]
        streamed = {p: (w, i) for w in self._streamed_groups() for i, p in enumerate(w.params)}
        hosts: dict[Any, list] = {w: [None] * len(w.params) for w, _ in streamed.values()}
        stored = None
        for buf in self._mq_buffers:
            data = buf.param_data
            host = self._mq_buffer_host.get(id(buf))
            if host is None:
                host = self._mq_buffer_host[id(buf)] = torch.empty(data.shape, dtype=data.dtype, device="cpu",
                                                                   pin_memory=data.is_cuda)
            if d2h is not None:
                d2h.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(d2h):
                    host.copy_(data, non_blocking=True)
                    stored = torch.cuda.Event()
                    stored.record(d2h)
            else:
                host.copy_(data)
            for p, (start, end, _) in buf.param_index_map.items():
                if p in streamed:
                    own = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                    own.untyped_storage().resize_(0)
                    w, i = streamed[p]
                    hosts[w][i] = host[start:end].view(p.shape)
                else:  # not streamed (norms, embedding): its own copy, resident
                    own = p.data.clone()
                p.data = own
            if d2h is not None:
                data.record_stream(d2h)
            data.untyped_storage().resize_(0)
        self._build_streamed()
        for w, host_views in hosts.items():
            w.adopt_host(host_views, stored)

    def _attach_to_buffers(self) -> None:
        h2d = self._mq_streams[1]
        for w in self._all_streamed():  # the host copy is current: release without copying (after any load in flight)
            w.release(None)
        for buf in self._mq_buffers:
            data, host = buf.param_data, self._mq_buffer_host[id(buf)]
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.copy_(host, non_blocking=h2d is not None)  # on the compute stream: the optimizer reads it next
            for p, (start, end, _) in buf.param_index_map.items():
                p.data = data[start:end].view(p.shape)
        self._mq_buffers = []

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._mq_active():
            return super().forward(*args, **kwargs)
        # Layers released by another forward since the last backward (schedules other than 1F1B) come
        # back through the layer pre-hooks, one ahead, as they do at the start of a detached step.
        self._mq_backward = False
        if self._mq_output is not None:
            self.module_queue_offloaded_bytes += self._mq_output.release(self._mq_streams[0])
        out = super().forward(*args, **kwargs)
        _on_grad(out, self._before_output_backward)
        return out

    def _mq_active(self) -> bool:
        # Only the training step's passes (begin_step .. end_step): its forward runs without gradients
        # under full recompute (Megatron's checkpoint), and logprob/generation passes are outside a step.
        return self._module_queue_enabled and self._mq_in_step and self.training

    def _make_layer_pre_hook(self, i: int) -> Callable:
        def hook(_module: Any, _inputs: Any) -> None:
            if not self._mq_active():
                return
            h2d = self._mq_streams[1]
            self._streamed_layers[i].ensure(h2d)  # resident already unless the step began with every layer released
            if self._mq_backward:  # full recompute re-runs this forward inside the backward pass
                nxt = self._next_released_for_backward(i)
                if nxt is not None:
                    self._streamed_layers[nxt].load(h2d)
            elif i + 1 < self.num_layers and not self._streamed_layers[i + 1].resident:
                self._streamed_layers[i + 1].load(h2d)

        return hook

    def _next_released_for_backward(self, i: int) -> int | None:
        """The layer the backward pass needs after layer ``i``'s recomputed forward: the next one of the same
        recompute block (re-run upward) or else the top of the block below (the layers above are resident)."""
        layers = self._streamed_layers
        if i + 1 < self.num_layers and not layers[i + 1].resident:
            return i + 1
        return next((j for j in range(i - 1, -1, -1) if not layers[j].resident), None)

    def _make_layer_hook(self, i: int) -> Callable:
        def hook(_module: Any, _inputs: Any, output: Any) -> Any:
            if not self._mq_active() or self._mq_backward:  # a recomputed layer stays for its backward
                return output
            d2h, h2d = self._mq_streams
            self.module_queue_offloaded_bytes += self._streamed_layers[i].release(d2h)
            if self._mq_output is not None:  # the output layer's chunks due after layer i
                last_due = (i + 1) * self.num_chunks // self.num_layers - 1
                if last_due >= 0:
                    self._mq_output.load(h2d, min(last_due, self.num_chunks - 1), self.num_chunks)
            _on_grad(output[0] if isinstance(output, tuple) else output, lambda: self._before_layer_backward(i))
            return output

        return hook

    def _decoder_hook(self, _module: Any, _inputs: Any, output: Any) -> Any:
        if not self._mq_active() or not torch.is_tensor(output):
            return output
        if self._mq_output is not None:
            self._mq_output.ensure(self._mq_streams[1])  # all chunks issued and arrived
        _on_grad(output, self._after_output_backward)
        return output

    # -- backward ---------------------------------------------------------------------------------
    def _before_output_backward(self) -> None:
        self._mq_backward = True
        h2d = self._mq_streams[1]
        if self._mq_output is not None:
            self._mq_output.ensure(h2d)
        self._streamed_layers[-1].load(h2d)  # arrives while the output layer runs its backward

    def _after_output_backward(self) -> None:
        if self._mq_output is not None:
            self.module_queue_offloaded_bytes += self._mq_output.release(self._mq_streams[0])

    def _before_layer_backward(self, i: int) -> None:
        h2d = self._mq_streams[1]
        self._streamed_layers[i].ensure(h2d)
        if i > 0:
            self._streamed_layers[i - 1].load(h2d)  # prefetch while layer i runs its backward

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def _streamed_layers(self) -> list[StreamedWeights]:
        """The decoder layers' weights; built by ``begin_step``, so present whenever a hook is active."""
        assert self._mq_layers is not None, "ModuleQueue: begin_step builds the streamed layers"
        return self._mq_layers

    def _build_streamed(self, check_owned: bool = True) -> None:
        if self._mq_layers is not None:
            return
        self._mq_layers = [StreamedWeights(f"decoder.layers.{i}", list(layer.parameters()), check_owned)
                           for i, layer in enumerate(self.decoder.layers)]
        # With tied embeddings on a single stage the output weight is the input embedding, needed at the
        # start of the forward pass: it stays resident.
        tied = self.pre_process and self.share_embeddings_and_output_weights
        weight = None if tied else getattr(self.output_layer, "weight", None)
        self._mq_output = StreamedWeights("output_layer", [weight], check_owned) if weight is not None else None
        self._make_streams()
        logger.info("ModuleQueue on the last pipeline stage: %d layers streamed (%.1f MiB), output layer %s in %d chunks",
                    self.num_layers, sum(w.nbytes for w in self._mq_layers) / 2**20,
                    f"{self._mq_output.nbytes / 2**20:.1f} MiB" if self._mq_output else "tied to the embedding (resident)",
                    self.num_chunks)

    def _make_streams(self) -> tuple[Any, Any]:
        if self._mq_streams[0] is None and next(self.parameters()).is_cuda:
            self._mq_streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._mq_streams

    def _streamed_groups(self) -> list[StreamedWeights]:
        """The streamed groups, built once (the caller gives each parameter its own storage)."""
        self._build_streamed(check_owned=False)
        return self._all_streamed()

    def _all_streamed(self) -> list[StreamedWeights]:
        return [*(self._mq_layers or []), *([self._mq_output] if self._mq_output is not None else [])]


def stage_model_class(config: Any, post_process: bool) -> type:
    """The model class a pipeline stage gets (the model-variant hook of the builder): ModuleQueue on the
    stage with ``post_process`` when ``config.enable_module_queue``, GPTModel elsewhere."""
    return ModuleQueue if post_process and getattr(config, "enable_module_queue", False) else GPTModel


def module_queue_pre_wrap_hook(models: list[Any]) -> list[Any]:
    """Megatron-Bridge pre-wrap hook: each model chunk becomes the class its stage gets."""
    out = []
    for model in models:
        cls = stage_model_class(model.config, model.post_process)
        out.append(cls.adopt(model) if cls is ModuleQueue and type(model) is not ModuleQueue else model)
    return out


def module_queues(chunks: list[torch.nn.Module]) -> list[tuple[Any, list[Any]]]:
    """(ModuleQueue, its chunk's DDP parameter buffers) for the active ModuleQueue models among an engine's
    (DDP-wrapped) model chunks."""
    return [(unwrap(c), list(getattr(c, "buffers", []))) for c in chunks
            if getattr(unwrap(c), "_module_queue_enabled", False)]
