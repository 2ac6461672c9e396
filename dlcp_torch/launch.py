"""Start DLCP for a training process: under ``torchrun`` or with an explicit peer list.

One script runs unchanged on localhost, in the Mininet testbed and on real machines:

* **torchrun / env://**: rank and world size come from ``RANK`` and ``WORLD_SIZE``; every
  process publishes its DLCP address in a key-value store at ``MASTER_ADDR`` (port
  ``DLCP_STORE_PORT``, default ``MASTER_PORT + 1``) and reads the others'. A process's own
  address is ``DLCP_HOST`` if set, else the local address that routes to ``MASTER_ADDR``.
* **explicit peers**: ``peers=["10.0.0.1:17649:17650", ...]`` (host:data_port:control_port per
  worker rank; with ``pattern="ps"`` one more entry for the server).

**The job secret** that control connections must prove (:mod:`dlcp.hostagent.auth`): ``secret=``
if given, else ``DLCP_SECRET`` (hex) if set, else, under env://, one that rank 0 draws and
publishes in the rendezvous store for the others; with explicit peers and neither, there is
none (control connections are then checked by address only). The store is as trusted as
torchrun's own: whoever can read it during the rendezvous learns the secret.

The parameter server (``pattern="ps"``) runs beside worker 0 by default (its own endpoint,
a thread of that process), or wherever ``peers`` says when it is started separately.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field, fields
from datetime import timedelta
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dlcp_torch.state import WIRE_DTYPES, DLCPState, start_server
from dlcp.hostagent.auth import new_secret, parse_secret
from dlcp.hostagent.policy import Policy
from dlcp.hostagent.ratecontrol import RateConfig
from dlcp.hostagent.transport import Endpoint, LossInjection, Peer, TransportConfig, reserve_ports

log = logging.getLogger(__name__)


@dataclass
class DLCPSession:
    """Everything :func:`init` started; ``close()`` stops it all."""

    state: DLCPState
    endpoint: Endpoint
    server_endpoint: Endpoint | None = None
    _server: tuple = field(default=(), repr=False)

    def ddp(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
        """``model`` in PyTorch's ``DistributedDataParallel`` with :func:`~dlcp_torch.hooks.dlcp_hook`
        registered, so its gradients go through DLCP.

        Raises:
            RuntimeError: no ``torch.distributed`` process group, naming the call that makes one
                (DDP itself needs it, for its broadcasts; DLCP carries only the gradients).
        """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from dlcp_torch.hooks import dlcp_hook

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DDP needs a torch.distributed process group for its own broadcasts: call "
                               "torch.distributed.init_process_group('gloo') first (DLCP's hook replaces its "
                               "gradient all-reduce), or use init_process_group('dlcp') without a hook")
        wrapped = DistributedDataParallel(model, **ddp_kwargs)
        wrapped.register_comm_hook(self.state, dlcp_hook)
        return wrapped

    def close(self) -> None:
        self.state.close()
        if self._server:
            thread, stop = self._server
            stop.set()
            thread.join(timeout=5)
        for ep in (self.endpoint, self.server_endpoint):
            if ep is not None:
                ep.close()


Bound = tuple[socket.socket, socket.socket]


def _address(host: str, bound: Bound) -> str:
    return f"{host}:{bound[0].getsockname()[1]}:{bound[1].getsockname()[1]}"


def _local_address(master: str) -> str:
    if os.environ.get("DLCP_HOST"):
        return os.environ["DLCP_HOST"]
    if master in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((master, 9))  # picks the route; sends nothing
        return s.getsockname()[0]
    finally:
        s.close()


def _parse_peer(rank: int, text: str) -> Peer:
    try:
        host, data, ctl = text.rsplit(":", 2)
        return Peer(rank, host, int(data), int(ctl))
    except ValueError:
        raise ValueError(f"peer {rank}: {text!r} is not host:data_port:control_port") from None


def peers_from_env(rank: int, world: int, with_server: bool, timeout: float = 60.0, secret: bytes | None = None
                   ) -> tuple[tuple[Peer, ...], dict[int, Bound], bytes]:
    """Exchange DLCP addresses (and, without ``secret``, the job secret) through a TCPStore at
    MASTER_ADDR (torchrun's environment).

    Returns the peers, the sockets this process already holds for its own ranks (its worker
    rank, and the server's on rank 0 with a colocated server): the ports announced are the
    ones held, to be handed to :meth:`Endpoint.start`; and the job secret (``secret``, or the
    one rank 0 drew and published). The store's host (rank 0) leaves last: every rank says it
    is done reading, and the host waits for all of them, so nobody is still waiting on a store
    that has gone.
    """
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("DLCP_STORE_PORT", int(os.environ.get("MASTER_PORT", "29500")) + 1))
    try:
        store = torch.distributed.TCPStore(master, port, world, rank == 0, timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        taken = "address already in use" in str(exc).lower() or "eaddrinuse" in str(exc).lower()
        raise RuntimeError(
            f"DLCP's rendezvous store at {master}:{port} "
            + ("could not listen: the port is taken. Set DLCP_STORE_PORT to a free port (the default is "
               "MASTER_PORT + 1)" if taken else f"failed ({exc}); DLCP_STORE_PORT sets its port "
               "(default MASTER_PORT + 1)")) from exc
    return exchange_addresses(store, rank, world, _local_address(master), with_server, secret)


def exchange_addresses(store: torch.distributed.Store, rank: int, world: int, host: str, with_server: bool = False,
                       secret: bytes | None = None) -> tuple[tuple[Peer, ...], dict[int, Bound], bytes]:
    """Publish this process's DLCP address in ``store`` and read every other one's (see
    :func:`peers_from_env`, which calls it on its own store; the torch.distributed backend calls
    it on the process group's)."""
    held: dict[int, Bound] = {rank: reserve_ports(host)}
    if with_server and rank == 0:
        held[world] = reserve_ports(host)
    try:
        if secret is None:
            if rank == 0:
                store.set("dlcp/secret", new_secret())
            secret = parse_secret(store.get("dlcp/secret").decode())
        for r, bound in held.items():
            store.set(f"dlcp/peer/{r}", _address(host, bound))
        n = world + (1 if with_server else 0)
        peers = tuple(_parse_peer(r, store.get(f"dlcp/peer/{r}").decode()) for r in range(n))
        store.set(f"dlcp/ready/{rank}", "1")
        store.wait([f"dlcp/ready/{r}" for r in range(world)])  # everyone has read every address
        store.set(f"dlcp/done/{rank}", "1")
        if rank == 0:  # the host leaves last
            store.wait([f"dlcp/done/{r}" for r in range(world)])
    except BaseException:
        for udp, tcp in held.values():
            udp.close()
            tcp.close()
        raise
    assert secret is not None
    return peers, held, secret


def _from_env(name: str, arg: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: run under torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR and "
                           f"MASTER_PORT), or pass {arg}= (and peers=) to dlcp_torch.init")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer") from None


def init(pattern: str = "ps", *, rank: int | None = None, world_size: int | None = None,
         peers: Sequence[str] | None = None, policy: Policy | None = None, loss: LossInjection | None = None,
         server_loss: LossInjection | None = None, mtu: int = 1500, model: torch.nn.Module | None = None,
         error_feedback: bool = False, colocated_server: bool = True, message_deadline: float = 30.0,
         connect_timeout: float = 30.0, rate: RateConfig | None = None, offload: bool = True,
         secret: str | bytes | None = None, timers: Mapping[str, float] | None = None,
         wire_dtype: str = "float32") -> DLCPSession:
    """Start this process's DLCP endpoint (and, on worker 0, the parameter server).

    Args:
        pattern: ``"ps"`` or ``"ring"``.
        rank, world_size: default to ``RANK``/``WORLD_SIZE`` from the environment.
        peers: explicit addresses instead of the env:// rendezvous.
        loss, server_loss: loss injection at this worker's / the server's receiver.
        colocated_server: run the server beside worker 0 (``pattern="ps"``); otherwise it is
            started elsewhere (:func:`dlcp_torch.state.start_server` on an endpoint at the
            last peer address, as the testbed's agent does).
        secret: the job secret (hex text or bytes); default ``DLCP_SECRET``, else see the
            module docstring.
        offload: UDP GSO/GRO where the kernel takes them (off where a software switch reads
            the hosts' links, as in the testbed).
        timers: :class:`~dlcp.hostagent.transport.TransportConfig` timers to set instead of their
            defaults (``feedback_interval``, ...), as
            :func:`dlcp.hostagent.transport_config.link_timers` gives them for a slow link.
        wire_dtype: ``"float16"`` (``"bfloat16"``) sends gradients in that type, half the bytes,
            as PyTorch's ``fp16_compress_hook`` (``bf16_compress_hook``) does (see
            :class:`~dlcp_torch.state.DLCPState`).

    Example: ``session = dlcp_torch.init("ps", model=model)``
    """
    if wire_dtype not in WIRE_DTYPES:  # before any endpoint starts
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
    rank = _from_env("RANK", "rank") if rank is None else rank
    world = _from_env("WORLD_SIZE", "world_size") if world_size is None else world_size
    with_server = pattern == "ps"
    held: dict[int, Bound] = {}
    key = parse_secret(secret if secret is not None else os.environ.get("DLCP_SECRET"))
    if peers is None:
        all_peers, held, key = peers_from_env(rank, world, with_server and colocated_server, secret=key)
    else:
        all_peers = tuple(_parse_peer(r, p) for r, p in enumerate(peers))
    expected = world + (1 if with_server else 0)
    if len(all_peers) != expected:
        raise ValueError(f"{len(all_peers)} peer addresses for {world} workers"
                         f"{' and a server' if with_server else ''}: expected {expected}")
    policy = policy or Policy()
    base: dict[str, Any] = dict(peers=all_peers, policy=policy, mtu=mtu, message_deadline=message_deadline,
                connect_timeout=connect_timeout, rate=rate or RateConfig(), offload=offload, secret=key)
    settable = {f.name for f in fields(TransportConfig)} - set(base) - {"rank", "loss"}
    if set(timers or {}) - settable:
        raise ValueError(f"timers: {sorted(set(timers or {}) - settable)} are not TransportConfig fields init "
                         f"leaves to set")
    base.update(timers or {})
    server_rank = world if with_server else None
    server_ep: Endpoint | None = None
    server: tuple = ()
    if with_server and colocated_server and rank == 0:
        server_ep = Endpoint(TransportConfig(rank=world, loss=server_loss or LossInjection(), **base)).start(
            held.get(world))
        server = start_server(server_ep, list(range(world)), policy)
    ep = Endpoint(TransportConfig(rank=rank, loss=loss or LossInjection(), **base)).start(held.get(rank))
    ep.connect([world] if with_server else [(rank + 1) % world] if world > 1 else [])
    state = DLCPState(ep, pattern, workers=list(range(world)), server_rank=server_rank, model=model, policy=policy,
                      error_feedback=error_feedback, wire_dtype=wire_dtype)
    return DLCPSession(state, ep, server_ep, server)
