"""Which address and interface this machine uses to reach another one.

A multi-node pool must tell torchrun and the backends what the network looks like, because their
defaults come from this machine's *name*: torchrun's c10d rendezvous publishes the name of the
node that becomes its rank 0 (``socket.getfqdn()``) as ``MASTER_ADDR`` unless given
``--local-addr``, and gloo binds to the address the hostname resolves to unless
``GLOO_SOCKET_IFNAME`` names an interface (NCCL's bootstrap likewise, ``NCCL_SOCKET_IFNAME``). A
name that does not resolve on the other machines, or resolves to loopback (Debian's
``127.0.1.1 host`` line), makes the rendezvous time out waiting for ``MASTER_ADDR``, or the process
group hang. So every node passes the address it actually reaches the controller from, and the
interface that address is on.
"""

from __future__ import annotations

import fcntl
import ipaddress
import random
import socket
import struct
from pathlib import Path

__all__ = ["SOCKET_IFNAME_VARS", "interface_of", "interfaces", "is_local", "local_addresses", "missing_interface", "port_for_another", "resolve",
           "socket_env", "source_address"]

#: The variables that pin a backend's sockets to one interface.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to here (an address resolves to itself); [] if none."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def source_address(host: str) -> str | None:
    """The local address this machine's routing uses to reach ``host`` (connecting a UDP socket
    picks the route and sends nothing); None when ``host`` does not resolve or is unreachable."""
    for addr in resolve(host):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect((addr, 9))
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their addresses (IPv4's primary address, every IPv6 one)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            found[name] = []
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found[name].append(socket.inet_ntoa(packed[20:24]))
            except OSError:  # no IPv4 address
                pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[5] in found:
                    found[fields[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return found


def local_addresses() -> set[str]:
    """Every address of this machine's interfaces."""
    return {a for addrs in interfaces().values() for a in addrs}


def interface_of(addr: str) -> str | None:
    """The interface that holds ``addr``, or None."""
    try:
        wanted = ipaddress.ip_address(addr)
    except ValueError:
        return None
    for name, addrs in interfaces().items():
        if any(ipaddress.ip_address(a) == wanted for a in addrs):
            return name
    return None


def is_local(host: str) -> bool:
    """``host`` names this machine: it resolves to loopback or to an address of an interface here."""
    mine = local_addresses()
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in mine for a in resolve(host))


def socket_env(addr: str, env: dict[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for the interface holding ``addr``, each unless
    ``env`` already sets it (the user knows best); nothing for loopback or an unknown address."""
    iface = interface_of(addr)
    if iface is None or ipaddress.ip_address(addr).is_loopback:
        return {}
    return {var: iface for var in SOCKET_IFNAME_VARS if not env.get(var)}


def missing_interface(env: dict[str, str]) -> str | None:
    """What is wrong when ``env`` pins a backend to an interface this machine lacks (the same
    ``--env GLOO_SOCKET_IFNAME=eth0`` for machines whose interfaces are named differently)."""
    value = env.get("GLOO_SOCKET_IFNAME", "")
    if not value:
        return None
    # NCCL_SOCKET_IFNAME is left alone: NCCL matches it as a prefix (eth matches eth0) or a pattern.
    have = interfaces()
    if all(name in have for name in value.split(",") if name):
        return None
    listed = ", ".join(f"{n} ({' '.join(a) or 'no address'})" for n, a in have.items())
    return (f"GLOO_SOCKET_IFNAME={value} names an interface {socket.gethostname()} does not have; its interfaces: {listed}. "
            "Drop GLOO_SOCKET_IFNAME from --env: distnb sets it on each machine to the interface that reaches the "
            "notebook's machine, which may be named differently on every machine.")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_for_another(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, for another process to listen on later (torchrun's rendezvous
    store). A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the range
    it also hands every outgoing connection: on a busy machine (gloo and NCCL open many) one may
    take it before the other process binds it. So it is chosen below that range, at random among
    thousands, and tried; the kernel's choice is the fallback."""
    low, _ = _ephemeral_range()
    bind_host = host if host not in ("", "::") else "0.0.0.0"
    rng = random.SystemRandom()
    start = 15000 if low > 20000 else 1024
    for _ in range(64):
        port = rng.randrange(start, low)
        with socket.socket() as sock:
            try:
                sock.bind((bind_host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((bind_host, 0))
        return int(sock.getsockname()[1])
