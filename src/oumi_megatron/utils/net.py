"""Sockets bound to one interface: the listeners a run opens (a store's master, gloo's connections) are reachable on
the network that leads to their peers only, never on every interface of the host (torch's defaults). Torch only: the
engine processes of a rollout fleet import it too."""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on this host right now (for a rendezvous), below Linux's ephemeral range (32768-60999):
    a port that bind(0) hands out can be taken by another process's outgoing connection (gloo opens many)
    before the rendezvous binds it (seen in CI: EADDRINUSE); a random port below that range cannot."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port in 20000-31999 for the rendezvous; set MASTER_PORT")


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the way to ``host``: the local end of a route to it (no packet is sent); 127.0.0.1 for
    a loopback ``host``. What a rank binds its listeners to, so they are reachable on that network alone."""
    if host in (LOOPBACK, "localhost", "::1") or host.startswith("127."):
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host`` alone, for a store's master (``bound_store``): torch's TCPStore listens on
    every interface of the host when it opens its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def bound_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta,
                wait_for_workers: bool = True) -> tuple[dist.TCPStore, socket.socket | None]:
    """A TCPStore whose master listens on ``host`` only (the others connect to it there): (the store, the master's
    listening socket, which must live as long as the store)."""
    listener = listening_socket(host, port) if is_master else None
    store = dist.TCPStore(host, port, world_size=world_size, is_master=is_master, timeout=timeout,
                          wait_for_workers=wait_for_workers, master_listen_fd=listener.fileno() if listener else None)
    return store, listener


def gloo_options(host: str, timeout: timedelta) -> Any:
    """A gloo group's options with its device on ``host``'s interface: its peers' connections are accepted there only
    (gloo's default device takes the address the host name resolves to)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from torch's stub
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return options
