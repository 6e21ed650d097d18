"""The optimizer kernels that replace Megatron-Core's no-apex fallbacks (engine/optimizer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oumi_megatron.engine.optimizer import _fused_kernels_on, foreach_l2norm, foreach_scale, use_fused_kernels


def _tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in [(7, 3), (11,), (4, 5, 2), (1,)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_l2norm_is_the_norm_of_all_tensors_together(dtype: torch.dtype) -> None:
    tensors = _tensors(dtype)
    norm, per_tensor = foreach_l2norm(2048, torch.zeros(1, dtype=torch.int), [tensors], False)
    expected = torch.cat([t.double().flatten() for t in tensors]).norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item()  # accumulated in fp32 for bf16 too


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_foreach_scale_writes_scaled_copies(scale: float) -> None:
    src = _tensors(torch.float32)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    foreach_scale(2048, torch.zeros(1, dtype=torch.int), [src, dst], scale)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d, (s * scale).to(torch.bfloat16))


def test_foreach_scale_scales_in_place_when_source_is_destination() -> None:
    """Gradient clipping calls it with the gradients as both lists: they are scaled in place (no copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewTensors(TorchDispatchMode):  # every tensor an op returns that is not one of the gradients
        def __init__(self, grads: list[torch.Tensor]):
            super().__init__()
            self.owned, self.new = {t.untyped_storage().data_ptr() for t in grads}, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, list | tuple) else [out]:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self.owned:
                    self.new.append((str(func), tuple(t.shape)))
            return out

    grads = _tensors(torch.float32)
    expected = [t * 0.37 for t in grads]
    flag = torch.zeros(1, dtype=torch.int)
    with NewTensors(grads) as mode:
        foreach_scale(2048, flag, [grads, grads], 0.37)
    assert mode.new == []
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


def test_fused_kernels_default_follows_the_device_and_forcing_needs_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert _fused_kernels_on(None) is False and _fused_kernels_on(False) is False
    with pytest.raises(ValueError, match="megatron.optimizer_config.fused_kernels"):
        _fused_kernels_on(True)


def test_cpu_param_groups_keep_their_adam_path() -> None:
    """Optimizer CPU offload puts some groups on the host: those are not switched to the CUDA kernel."""
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    use_fused_kernels(SimpleNamespace(optimizer=adam))
    assert not adam.param_groups[0]["fused"]
