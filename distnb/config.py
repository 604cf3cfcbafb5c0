"""Launch configuration: what a pool is, validated once, shared by the controller and node agents."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, replace

__all__ = ["BACKENDS", "DEBUG_ENV", "VERSION", "LaunchConfig", "Rendezvous", "default_nproc", "is_loopback", "split_host_port"]

#: distnb's version (``distnb.__version__``): every machine of a pool must run the same one, and a
#: node agent of another is refused by name.
VERSION = "0.1.0"

BACKENDS = ("auto", "nccl", "gloo")
DEBUG_ENV = {
    "detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    "nccl": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,COLL"},
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# torchrun owns these; letting --env override them would silently break the rank contract.
_RESERVED_ENV = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
}


def split_host_port(text: str, what: str, default_port: int | None = None) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``; ``"host"`` when there is a default port)."""
    host, sep, port = text.rpartition(":") if text.count(":") == 1 or text.startswith("[") else ("", "", "")
    if not sep:
        host, port = text, ""
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{what} {text!r} names no host; write HOST:PORT, e.g. node1:29400.")
    if not port and default_port is not None:
        return host, default_port
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r} needs a port from 0 to 65535; write HOST:PORT, e.g. {host}:29400.")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _slurm_nodes() -> int | None:
    value = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    return int(value) if value and value.isdigit() else None


def default_nproc() -> int:
    """Visible GPUs, else 2 (decided without initialising CUDA in the notebook process)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
        if ids:
            return len(ids)
        return 2
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
        return count or 2
    except Exception:
        return 2


@dataclass(frozen=True)
class LaunchConfig:
    """Everything needed to (re)start a pool. Validated on construction.

    Attributes:
        nproc: ranks on this machine (``None``: visible GPUs, else 2).
        backend: ``"auto"`` (NCCL when CUDA is present, else gloo), ``"nccl"`` or ``"gloo"``.
        env: extra environment variables for every rank (e.g. ``{"NCCL_DEBUG": "INFO"}``).
        pg_timeout: the process group's collective timeout, in seconds.
        start_timeout: how long to wait for every rank to be ready, in seconds.
        hang_after: seconds a rank may sit in a collective that others are not in before the
            cell reports a hang.
        heartbeat_timeout: ranks exit when the controller has been silent this long.
        bind: address the controller listens on, ``HOST`` or ``HOST:PORT`` (a fixed port, e.g. one
            a firewall lets through); other nodes must be able to reach it.
        nnodes: machines in the pool, this one included; ``nproc`` ranks run on each.
        rdzv_endpoint: ``HOST:PORT`` of torchrun's c10d rendezvous (default: this machine, a free port).
        hosts: other machines on which to start node agents over ssh (``nnodes`` = this one + hosts).
        slurm: start one node agent per other node of the current Slurm allocation with srun.
        curve: encrypt the control plane with CURVE, and admit only clients holding the pool's key.
        key_file: where to write the key other nodes read (default ``~/.distnb/keys/<pool>.key``).
        node_python: the Python that runs ``-m distnb.node`` on other machines (default: this one's path).
        local_nodes: run every other node's agent on this machine too: a multi-node layout (RANK
            differs from LOCAL_RANK, GROUP_RANK per node, a rendezvous across torchruns) rehearsed
            on one box. The simulated nodes share this machine's devices, so the backend is gloo.
        share_gpus: put several ranks on each GPU (``nproc`` may exceed the GPUs; ranks take
            ``LOCAL_RANK % GPUs``): NCCL with each rank posing as its own host and talking over
            loopback sockets. To rehearse an NCCL hang with 4 ranks on one GPU; slow, one machine.
        spares: keep a spare process per rank that has imported torch already, so that a restart
            starts fresh ranks under the running torchrun in about a second (one idle Python with
            torch per rank; started once the pool is ready).
        debug: debug switches: ``"detail"`` (TORCH_DISTRIBUTED_DEBUG=DETAIL: mismatched
            collectives raise an error naming the field instead of aborting the process) and
            ``"nccl"`` (NCCL_DEBUG=INFO with the init, network and collective subsystems).
    """

    nproc: int | None = None
    backend: str = "auto"
    env: dict[str, str] = field(default_factory=dict)
    pg_timeout: float = 1800.0
    start_timeout: float = 180.0
    hang_after: float = 3.0
    heartbeat_timeout: float = 15.0
    bind: str = "127.0.0.1"
    debug: tuple[str, ...] = ()
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    hosts: tuple[str, ...] = ()
    slurm: bool = False
    curve: bool = False
    key_file: str | None = None
    node_python: str | None = None
    local_nodes: bool = False
    share_gpus: bool = False
    spares: bool = True

    def __post_init__(self) -> None:
        if self.nproc is None:
            object.__setattr__(self, "nproc", default_nproc())
        if not isinstance(self.nproc, int) or isinstance(self.nproc, bool) or not 1 <= self.nproc <= 1024:
            raise ValueError(f"nproc must be a whole number of ranks from 1 to 1024, not {self.nproc!r}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}.")
        env = {}
        for key, value in dict(self.env).items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise ValueError(f"environment variable name {key!r} is not valid; use letters, digits and underscores.")
            if key in _RESERVED_ENV:
                raise ValueError(f"{key} is set by torchrun for every rank and can't be overridden with env.")
            env[key] = str(value)
        object.__setattr__(self, "env", env)
        debug = (self.debug,) if isinstance(self.debug, str) else tuple(self.debug)
        unknown = [d for d in debug if d not in DEBUG_ENV]
        if unknown:
            raise ValueError(f"unknown debug switch {unknown[0]!r}; choose from {', '.join(DEBUG_ENV)}.")
        object.__setattr__(self, "debug", tuple(dict.fromkeys(debug)))
        for name in ("pg_timeout", "start_timeout", "hang_after", "heartbeat_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}.")
            object.__setattr__(self, name, float(value))
        self._check_nodes()
        if self.share_gpus:
            if self.backend == "gloo":
                raise ValueError("share_gpus shares GPUs between NCCL ranks; gloo ranks need no GPU: drop share_gpus.")
            if self.nnodes > 1:
                raise ValueError("share_gpus runs NCCL over loopback, so on one machine only; drop nnodes/hosts/slurm, "
                                 "or drop share_gpus and give each rank its own GPU.")
            object.__setattr__(self, "backend", "nccl")

    @property
    def ping_interval(self) -> float:
        """How often the controller pings supervisors and node agents: five pings within
        ``heartbeat_timeout``, and no more often than needed (each wakes every supervisor), from
        once a second to once every 3 s."""
        return min(3.0, max(1.0, self.heartbeat_timeout / 5))

    def _check_nodes(self) -> None:
        hosts = (self.hosts,) if isinstance(self.hosts, str) else tuple(self.hosts)
        hosts = tuple(h.strip() for h in hosts if h.strip())
        object.__setattr__(self, "hosts", hosts)
        nnodes = self.nnodes
        if self.slurm and hosts:
            raise ValueError("use either hosts (ssh) or slurm (srun) to start the other nodes, not both.")
        if self.local_nodes:
            if hosts or self.slurm:
                raise ValueError("local_nodes runs the other nodes on this machine; drop hosts/slurm, or drop local_nodes.")
            if nnodes < 2:
                raise ValueError("local_nodes simulates several machines: give nnodes of 2 or more (--nnodes 2).")
            if self.backend == "nccl":
                raise ValueError("local_nodes puts several simulated nodes on this machine's GPUs, and NCCL refuses two "
                                 "ranks on one GPU; use backend gloo (the default with local_nodes).")
            object.__setattr__(self, "backend", "gloo")
        if self.slurm:
            if not os.environ.get("SLURM_JOB_ID"):
                raise ValueError("slurm needs a Slurm allocation: start Jupyter inside `salloc -N 2 ...` or an sbatch job.")
            if nnodes == 1:
                nnodes = _slurm_nodes() or 1
        if hosts and nnodes == 1:
            nnodes = len(hosts) + 1
        if not isinstance(nnodes, int) or isinstance(nnodes, bool) or not 1 <= nnodes <= 1024:
            raise ValueError(f"nnodes must be a whole number of machines from 1 to 1024, not {nnodes!r}.")
        if hosts and nnodes != len(hosts) + 1:
            raise ValueError(f"hosts names {len(hosts)} other machine(s) but nnodes is {nnodes}; "
                             f"give {nnodes - 1} host(s): this machine is a node too.")
        object.__setattr__(self, "nnodes", nnodes)
        host, port = split_host_port(self.bind, "bind address", default_port=0)
        object.__setattr__(self, "bind", f"{host}:{port}" if port else host)
        if self.rdzv_endpoint is not None:
            split_host_port(self.rdzv_endpoint, "rendezvous endpoint")
            if nnodes == 1:
                raise ValueError("rdzv_endpoint only matters with more than one node; add nnodes (--nnodes K).")
        remote = self.slurm or any(not is_loopback(h) for h in hosts)
        if remote and is_loopback(host):
            raise ValueError(f"the other nodes can't reach {host}: bind an address of this machine that they can reach "
                             "(--bind 0.0.0.0, or this machine's IP on the cluster network).")

    @property
    def bind_host(self) -> str:
        return split_host_port(self.bind, "bind address", default_port=0)[0]

    @property
    def bind_port(self) -> int:
        return split_host_port(self.bind, "bind address", default_port=0)[1]

    @property
    def world_size(self) -> int:
        return int(self.nproc or 0) * self.nnodes

    def with_changes(self, **changes: object) -> LaunchConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rendezvous:
    """How one node's torchrun joins the others (c10d rendezvous)."""

    endpoint: str  # HOST:PORT
    run_id: str  # unique per launch: an agent of an older launch can't join this one
    store_here: bool | None = None  # this node hosts the rendezvous store (None: torchrun decides)
    local_addr: str | None = None  # the address other nodes reach this one at (loopback pools)
    join_timeout: float = 180.0

    def args(self) -> list[str]:
        conf = [f"join_timeout={int(self.join_timeout)}"]
        if self.store_here is not None:
            conf.append(f"is_host={'true' if self.store_here else 'false'}")
        out = ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id, "--rdzv-conf", ",".join(conf)]
        if self.local_addr:
            out += ["--local-addr", self.local_addr]
        return out
