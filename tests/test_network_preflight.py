"""The network preflight's transport, from NCCL's variables and the RDMA devices (engine/parallel/network.py); its
measurement runs in the two-node simulation (tests/test_two_nodes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oumi_megatron.engine.parallel.network import NetworkReport, nccl_transport


def _devices(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    for name in names:
        (root / name).mkdir()
    return root


@pytest.mark.parametrize(("devices", "env", "expected", "sockets"), [
    (("mlx5_0", "mlx5_1"), {}, "InfiniBand / RoCE (mlx5_0, mlx5_1)", False),
    (("rdmap16s27",), {}, "AWS EFA (rdmap16s27)", False),
    ((), {"FI_PROVIDER": "efa"}, "AWS EFA (efa)", False),
    ((), {}, "TCP sockets (NCCL's choice of interface; no RDMA device in /sys/class/infiniband)", True),
    (("mlx5_0",), {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}, "TCP sockets (eth0; NCCL_IB_DISABLE=1)", True),
    (("mlx5_0",), {"NCCL_NET": "Socket"}, "TCP sockets (NCCL's choice of interface; NCCL_NET=Socket)", True),
])
def test_the_transport_nccl_will_take_between_nodes(tmp_path: Path, devices: tuple[str, ...], env: dict[str, str],
                                                     expected: str, sockets: bool) -> None:
    assert nccl_transport(env, _devices(tmp_path, *devices)) == (expected, sockets)


def test_the_report_s_metrics() -> None:
    one = NetworkReport(1, "gloo over TCP", True, 2.5, None)
    assert one.metrics() == {"preflight/nodes": 1.0, "preflight/sockets": 1.0, "preflight/intra_node_busbw_gbps": 2.5}
    two = NetworkReport(2, "InfiniBand / RoCE (mlx5_0)", False, 300.0, 40.0)
    assert two.metrics()["preflight/inter_node_busbw_gbps"] == 40.0 and "across nodes 40.00" in two.describe()
