"""rollout/weight_sync/stream.py: buckets and the wire format, on CPU over a real gloo pair group.

The vLLM tests (tests/test_vllm.py) stream into a real engine; these check the stream itself:
every tensor arrives bit-exact under its name, small tensors share buckets, a tensor of a bucket's
size or more travels as a view of its own bytes (no packing copy).
"""

from __future__ import annotations

import sys
import threading

import torch

from conftest import free_port, run_cli
from oumi_megatron.rollout.weight_sync import stream


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
    out = list(stream.buckets(pairs, bucket_bytes=4096))
    assert [len(b.meta) for b in out] == [2, 1, 2]  # the 8 KiB tensor flushes the pending two and goes alone
    big = out[1]
    assert big.buffer.untyped_storage().data_ptr() == pairs[2][1].untyped_storage().data_ptr()
    got = [p for b in out for p in b.tensors()]
    assert [n for n, _ in got] == [n for n, _ in pairs]
    for (_, want), (_, have) in zip(pairs, got):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


def test_the_push_snapshot_is_a_host_copy_that_later_updates_do_not_reach() -> None:
    """rollout/weight_sync/push.py's snapshot: every tensor copied into host memory with its name, dtype and values, sharing
    no storage with the exporter's tensors (the next optimizer step changes them in place while the push is sent)."""
    from oumi_megatron.rollout.weight_sync.push import host_snapshot

    source = [("a", torch.arange(6, dtype=torch.bfloat16).view(2, 3)), ("b", torch.ones(4, dtype=torch.float32))]
    snapshot = host_snapshot((n, t) for n, t in source)
    for _, t in source:
        t.add_(100)  # the update after the export
    assert [n for n, _ in snapshot] == ["a", "b"]
    assert all(t.device.type == "cpu" for _, t in snapshot) and snapshot[0][1].dtype == torch.bfloat16
    assert torch.equal(snapshot[0][1], torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    assert torch.equal(snapshot[1][1], torch.ones(4))


def test_gloo_stream_delivers_every_tensor_exactly() -> None:
    pairs = _pairs()
    port = free_port()
    received: list[tuple[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def engine_side() -> None:
        try:
            group = stream.WeightSyncGroup("127.0.0.1", port, rank=1, timeout_s=60)
            for bucket in stream.receive(group):
                received.extend(bucket)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=engine_side)
    thread.start()
    group = stream.WeightSyncGroup("127.0.0.1", port, rank=0, timeout_s=60)
    stats = stream.send(group, iter(pairs), bucket_bytes=4096)
    thread.join(timeout=60)
    assert not errors, errors
    assert stats.tensors == len(pairs)
    assert stats.bytes >= sum(t.numel() * t.element_size() for _, t in pairs)
    assert [n for n, _ in received] == [n for n, _ in pairs]
    for (_, want), (_, have) in zip(pairs, received):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_senders_split_a_stream_by_bytes_and_an_engine_receives_them_all_at_once() -> None:
    """rollout/weight_sync/senders.py's layout in one process: three senders (threads) walk the same export in lockstep (a
    barrier per tensor, as the TP all-gathers of a collective export hold them), each sending its share
    (``share_of``) over a gloo group of its own; the engine receives the three groups at once (``receive_all``) with
    room for one bucket only. Every tensor arrives exactly once, bit-exact; each sender's bytes are within one
    tensor of a third."""
    g = torch.Generator().manual_seed(1)
    # 1-8 MiB each: more than a socket buffers, so a sender's broadcast waits for its receiver
    pairs = [(f"t{i}", torch.randn(int(torch.randint(2**18, 2**21, (1,), generator=g)), generator=g)) for i in range(24)]
    senders, ports = 3, [free_port() for _ in range(3)]
    lockstep = threading.Barrier(senders)
    sent: list[int] = [0] * senders
    received: list[tuple[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def export() -> object:
        for name, t in pairs:
            lockstep.wait(timeout=60)
            yield name, t

    def sender(k: int) -> None:
        try:
            group = stream.WeightSyncGroup("127.0.0.1", ports[k], rank=0, timeout_s=60)
            stats = stream.send(group, stream.share_of(export(), k, senders), bucket_bytes=2**22)
            sent[k] = stats.bytes
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    def engine() -> None:
        try:
            groups = [stream.WeightSyncGroup("127.0.0.1", port, rank=1, timeout_s=60) for port in ports]
            for bucket in stream.receive_all(groups, max_buffered=1):
                received.extend((n, t.clone()) for n, t in bucket)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)] + [threading.Thread(target=engine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a sender or the engine is stuck"
    assert sorted(n for n, _ in received) == sorted(n for n, _ in pairs)  # each exactly once
    want = dict(pairs)
    assert all(torch.equal(t, want[n]) for n, t in received)
    total, largest = sum(t.numel() * 4 for _, t in pairs), max(t.numel() * 4 for _, t in pairs)
    shares = [sum(t.numel() * 4 for _, t in stream.share_of(iter(pairs), k, senders)) for k in range(senders)]
    assert sum(shares) == total and max(shares) - min(shares) <= largest, shares
    assert all(b >= s for b, s in zip(sent, shares)), (sent, shares)  # on the wire: the share, 64-byte aligned


_EXPORT_TWICE = """
import torch
from oumi_megatron.config.megatron_params import MegatronParams
from oumi_megatron.engine.builder import build_engine_from_hf_config
from oumi_megatron.engine.optimizer import OptimSettings
from oumi_megatron.engine.parallel.layout import engine_layout
from oumi_megatron.engine.state import hf_weights
from oumi_megatron.examples.tiny_models import tiny_config

cfg = tiny_config("llama", num_layers=2)
cfg.architectures = ["LlamaForCausalLM"]
params = MegatronParams()
bridge, engine = build_engine_from_hf_config(cfg, engine_layout(params), params, OptimSettings(), dtype=torch.float32)
from megatron.bridge.models.conversion import param_mapping
bridges_own = param_mapping.remove_non_pickleables
export = hf_weights.HFWeightExporter(bridge, engine.model)
for step in range(2):
    ours = {n: t.clone() for n, t in export()}
    assert param_mapping.remove_non_pickleables is bridges_own, "Bridge's function not restored"
    reference = {n: t.clone() for n, t in bridge.export_hf_weights(engine.model, cpu=True, show_progress=False)}
    assert ours.keys() == reference.keys(), sorted(set(ours) ^ set(reference))
    bad = [n for n in ours if not torch.equal(ours[n], reference[n])]
    assert not bad, (step, bad)
    with torch.no_grad():  # an optimizer step's in-place update, on every parameter
        for p in engine.model[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
assert len(export.stripped_configs) >= 1
print("OK", len(ours), "tensors; stripped configs kept:", len(export.stripped_configs))
"""


def test_exporter_equals_bridges_export_after_in_place_updates() -> None:
    """HFWeightExporter (cached conversion plan, each config stripped once and kept across exports)
    yields exactly what Bridge's own export_hf_weights yields, before and after the weights change in
    place, and leaves Bridge's functions as it found them. Its own process: it sets up Megatron's
    parallel state."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = run_cli([sys.executable, "-c", _EXPORT_TWICE], env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
