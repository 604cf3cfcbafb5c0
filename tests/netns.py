"""A private test network of Linux network namespaces: one "host" per namespace, each with its own
address, UTS hostname and interface name, joined by veth pairs to a bridge that only this module
creates. Nothing here routes anywhere else: the namespaces have no default route and the bridge
has no address, so the only reachable addresses are those of the hosts made here.

Everything started in a host (``Cluster.popen``) runs through ``ip netns exec``; teardown stops
every process left in each namespace by PID (``ip netns pids``), then deletes the namespaces and
the bridge, whether the test passed or not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["Cluster", "Host", "netns_unavailable"]

SSHD = "/usr/sbin/sshd"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def netns_unavailable() -> str | None:
    """Why this machine can't build the test network, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (Debian: apt-get install iproute2)"
    probe = f"dnbprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # its UTS hostname, e.g. "hosta"
    netns: str  # the namespace's name
    addr: str  # its address on the bridge
    iface: str  # its interface's name inside the namespace
    veth: str  # the bridge side of its veth pair, in the root namespace: `ip link set VETH down` cuts it off


class Cluster:
    """``Cluster(["hosta", "hostb"])``: the hosts, up; ``close()`` removes every trace."""

    def __init__(self, names: Sequence[str], workdir: Path) -> None:
        self.tag = secrets.token_hex(2)  # names are per run: a crashed run's leftovers never clash
        self.workdir = workdir
        self.bridge = f"dnb{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        # A /24 that no interface of this machine uses; only our namespaces get addresses in it.
        used = _ip("-o", "-4", "addr").stdout
        self.subnet = next(f"10.213.{n}" for n in range(10, 250) if f" 10.213.{n}." not in used)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self._add_host(name, i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, index: int) -> None:
        host = Host(name, f"dnb{self.tag}-{name}", f"{self.subnet}.{index + 2}", f"net-{name}"[:15], f"dnb{self.tag}v{index}")
        self.hosts[name] = host
        _ip("netns", "add", host.netns)
        inner = f"dnb{self.tag}p{index}"
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", host.netns)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("-n", host.netns, "link", "set", inner, "name", host.iface)
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.iface)
        _ip("-n", host.netns, "link", "set", host.iface, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run in host ``name``: its network namespace, and a UTS namespace with its hostname."""
        host = self.hosts[name]
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c", script, name, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.command(name, argv), **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def pids(self, name: str) -> list[int]:
        """Every process in host ``name``'s network namespace."""
        out = _ip("netns", "pids", self.hosts[name].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def shape(self, name: str, rate: str | None) -> None:
        """Limit host ``name``'s link to ``rate`` (e.g. "4mbit") both ways with tbf, or lift the
        limit (None). tbf, not netem: kernels without sch_netem (CONFIG_NET_SCH_NETEM) have tbf."""
        host = self.hosts[name]
        for prefix, dev in ((["ip", "netns", "exec", host.netns], host.iface), ([], host.veth)):
            args = ["replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "16kbit", "latency", "2s"] if rate else ["del", "dev", dev, "root"]
            subprocess.run([*prefix, "tc", "qdisc", *args], check=rate is not None, capture_output=True, timeout=20)

    def set_link(self, name: str, up: bool) -> None:
        _ip("link", "set", self.hosts[name].veth, "up" if up else "down")

    def start_sshd(self, name: str, client_public_key: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Debian's sshd in host ``name`` on its address, admitting root with ``client_public_key``
        only; ``env`` is set in every session (a test marks what it starts with it)."""
        host = self.hosts[name]
        folder = self.workdir / f"sshd-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        hostkey = folder / "host_ed25519"
        if not hostkey.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)], check=True, timeout=20)
        (folder / "authorized_keys").write_text(client_public_key)
        (folder / "authorized_keys").chmod(0o600)
        config = folder / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host.addr}", "Port 22", f"HostKey {hostkey}", f"PidFile {folder / 'sshd.pid'}",
            f"AuthorizedKeysFile {folder / 'authorized_keys'}", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()), "",
        ]))
        Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation folder
        log = open(folder / "sshd.log", "wb")
        proc = self.popen(name, [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while b"Server listening" not in (folder / "sshd.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd in {name} did not start: {(folder / 'sshd.log').read_text()}")
            time.sleep(0.05)
        return proc

    def stop_processes(self, name: str, grace: float = 3.0) -> list[int]:
        """SIGTERM, then SIGKILL, every process in host ``name``; returns those that were there."""
        found = self.pids(name)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids(name)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while self.pids(name) and time.monotonic() < deadline:
                time.sleep(0.05)
        return found

    def close(self) -> None:
        for name in self.hosts:
            self.stop_processes(name)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts.values():
            # Deleting one end deletes the pair now; a deleted namespace's own devices go only
            # when the kernel gets round to freeing it.
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces and devices of this cluster still there (after ``close``: none)."""
        mine = f"dnb{self.tag}"
        found = [f"netns {n.split()[0]}" for n in _ip("netns", "list").stdout.splitlines() if n.startswith(mine)]
        return found + [f"link {line.split(':')[1].strip()}" for line in _ip("-o", "link").stdout.splitlines() if f" {mine}" in line]
