"""The network preflight: before conversion, what the collectives will cross nodes over, and how fast.

The most reported multi-node failures in the peers' trackers are NCCL falling back to TCP sockets instead of
InfiniBand / EFA (or taking the wrong interface) and weight syncs that hang between nodes, found at step 1, hours of
conversion later. Here every rank, in seconds, before anything is converted:
- **the transport** NCCL will take between nodes, from what NCCL reads: ``NCCL_NET`` / ``NCCL_IB_DISABLE``, the
  RDMA devices in /sys/class/infiniband (InfiniBand HCAs, AWS EFA) and ``NCCL_SOCKET_IFNAME``;
- **one all-reduce** of ``preflight_bytes`` within each node, then over every rank (across the nodes), as bus
  bandwidth (NCCL-tests' ``2 (n - 1) / n x bytes / time``).
A run across nodes whose NCCL would use sockets, or whose cross-node bandwidth is under ``INTER_NODE_FLOOR_GBPS``, is
warned with the variables that fix it (``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``; ``NCCL_DEBUG=INFO`` shows NCCL's
choice). The numbers go in the first step's metrics (``preflight/*``). On CPU (gloo, the two-node simulation) the same
path measures and reports; sockets are all gloo has, so nothing is warned there.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("oumi")

INTER_NODE_FLOOR_GBPS = 10.0
"""Cross-node all-reduce bus bandwidth (GB/s) below which a GPU run is warned: a 100 Gb/s link gives ~12 GB/s; TCP
sockets on a cloud VM's Ethernet give 1-5 (and 200-400 Gb/s InfiniBand or EFA give 20-45)."""
PREFLIGHT_BYTES = {"cuda": 256 * 2**20, "cpu": 8 * 2**20}
"""The all-reduce's size: large enough to measure bandwidth, not latency; seconds at worst."""
RDMA_DEVICES = Path("/sys/class/infiniband")


@dataclass
class NetworkReport:
    nodes: int
    transport: str
    sockets: bool
    """Cross-node traffic goes over TCP sockets (NCCL's socket transport, or gloo)."""
    intra_gbps: float
    inter_gbps: float | None
    """Over every rank, across the nodes (None: one node)."""
    warnings: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        out = {"preflight/nodes": float(self.nodes), "preflight/sockets": float(self.sockets),
               "preflight/intra_node_busbw_gbps": self.intra_gbps}
        if self.inter_gbps is not None:
            out["preflight/inter_node_busbw_gbps"] = self.inter_gbps
        return out

    def describe(self) -> str:
        across = f", across nodes {self.inter_gbps:.2f}" if self.inter_gbps is not None else ""
        return (f"network preflight: {self.nodes} node(s), {self.transport}; all-reduce bus bandwidth within a node "
                f"{self.intra_gbps:.2f} GB/s{across}")


def nccl_transport(environ: dict[str, str] | None = None, devices: Path = RDMA_DEVICES) -> tuple[str, bool]:
    """(what NCCL will take between nodes, whether that is TCP sockets), from NCCL's variables and the RDMA devices."""
    env = dict(os.environ if environ is None else environ)
    names = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    efa = [n for n in names if n.startswith(("efa", "rdmap"))] or (["efa"] if env.get("FI_PROVIDER") == "efa" else [])
    iface = env.get("NCCL_SOCKET_IFNAME", "NCCL's choice of interface")
    if env.get("NCCL_NET", "").lower() == "socket":
        return f"TCP sockets ({iface}; NCCL_NET=Socket)", True
    if efa:
        return f"AWS EFA ({', '.join(efa)})", False
    if names and env.get("NCCL_IB_DISABLE", "0") != "1":
        return f"InfiniBand / RoCE ({', '.join(names)}{'; NCCL_IB_HCA=' + env['NCCL_IB_HCA'] if 'NCCL_IB_HCA' in env else ''})", False
    why = "NCCL_IB_DISABLE=1" if names else "no RDMA device in /sys/class/infiniband"
    return f"TCP sockets ({iface}; {why})", True


def _busbw(tensor: torch.Tensor, group: dist.ProcessGroup | None, ranks: int) -> float:
    """One all-reduce's bus bandwidth in GB/s (after a warm-up one), the slowest rank's."""
    dist.all_reduce(tensor, group=group)
    if tensor.is_cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    if tensor.is_cuda:
        torch.cuda.synchronize()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return 2 * (ranks - 1) / ranks * tensor.numel() * tensor.element_size() / max(float(seconds.item()), 1e-9) / 1e9


def network_preflight() -> NetworkReport:
    """Collective over every rank (torch.distributed initialized): the report; its warnings logged on rank 0."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(world // max(per_node, 1), 1)
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    tensor = torch.ones(PREFLIGHT_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)] if nodes > 1 else [None]
    mine = groups[dist.get_rank() // per_node] if nodes > 1 else None
    intra = _busbw(tensor, mine, per_node) if per_node > 1 else 0.0
    inter = _busbw(tensor, None, world) if nodes > 1 else None
    for group in groups:
        if group is not None:
            dist.destroy_process_group(group)
    if device.type == "cpu":
        transport, sockets = "gloo over TCP", True
    else:
        transport, sockets = nccl_transport()
    report = NetworkReport(nodes, transport, sockets, intra, inter)
    if nodes > 1 and device.type == "cuda":
        if sockets:
            report.warnings.append(
                f"NCCL will cross nodes over {transport}: collectives and weight syncs between nodes run at Ethernet "
                "speed. Where the nodes have InfiniBand or EFA, make NCCL see it (NCCL_IB_HCA=mlx5 or the EFA plugin, "
                "no NCCL_IB_DISABLE / NCCL_NET=Socket); else set NCCL_SOCKET_IFNAME to the fastest interface. "
                "NCCL_DEBUG=INFO prints NCCL's choice.")
        if inter is not None and inter < INTER_NODE_FLOOR_GBPS:
            report.warnings.append(
                f"an all-reduce across nodes ran at {inter:.1f} GB/s bus bandwidth, under {INTER_NODE_FLOOR_GBPS:g} "
                f"(within a node: {report.intra_gbps:.1f}): check NCCL_SOCKET_IFNAME / NCCL_IB_HCA (NCCL_DEBUG=INFO "
                "shows the transport NCCL took).")
    if dist.get_rank() == 0:
        logger.info(report.describe())
        for warning in report.warnings:
            logger.warning(warning)
    return report
