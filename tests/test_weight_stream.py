"""rollout/weight_stream.py: buckets and the wire format, on CPU over a real gloo pair group.

The vLLM tests (tests/test_vllm.py) stream into a real engine; these check the stream itself:
every tensor arrives bit-exact under its name, small tensors share buckets, a tensor of a bucket's
size or more travels as a view of its own bytes (no packing copy).
"""

from __future__ import annotations

import threading

import torch

from conftest import free_port
from oumi_megatron.rollout import weight_stream


def _pairs() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.norm.weight", torch.randn(7, generator=g)),
        ("model.layers.0.self_attn.qkv", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=g)),  # 8 KiB: alone
        ("model.layers.0.mlp.bias", torch.randn(3, generator=g).to(torch.float16)),
        ("step", torch.tensor([3], dtype=torch.int64)),
    ]


def test_buckets_roundtrip_and_big_tensors_are_not_copied() -> None:
    pairs = _pairs()
    out = list(weight_stream.buckets(pairs, bucket_bytes=4096))
    assert [len(b.meta) for b in out] == [2, 1, 2]  # the 8 KiB tensor flushes the pending two and goes alone
    big = out[1]
    assert big.buffer.untyped_storage().data_ptr() == pairs[2][1].untyped_storage().data_ptr()
    got = [p for b in out for p in b.tensors()]
    assert [n for n, _ in got] == [n for n, _ in pairs]
    for (_, want), (_, have) in zip(pairs, got):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


def test_gloo_stream_delivers_every_tensor_exactly() -> None:
    pairs = _pairs()
    port = free_port()
    received: list[tuple[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def engine_side() -> None:
        try:
            group = weight_stream.PairGroup("127.0.0.1", port, rank=1, timeout_s=60)
            for bucket in weight_stream.receive(group):
                received.extend(bucket)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=engine_side)
    thread.start()
    group = weight_stream.PairGroup("127.0.0.1", port, rank=0, timeout_s=60)
    stats = weight_stream.send(group, iter(pairs), bucket_bytes=4096)
    thread.join(timeout=60)
    assert not errors, errors
    assert stats.tensors == len(pairs)
    assert stats.bytes >= sum(t.numel() * t.element_size() for _, t in pairs)
    assert [n for n, _ in received] == [n for n, _ in pairs]
    for (_, want), (_, have) in zip(pairs, received):
        assert have.dtype == want.dtype and torch.equal(have, want)
