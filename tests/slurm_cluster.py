"""A Slurm cluster on the hosts of a test network (netns.py): munged (one, its socket shared by the
hosts' namespaces: unix sockets live in the filesystem), slurmctld on the first host, a slurmd per
host under its own node name. Everything is configured in a folder of the test's and started by the
Cluster, so its teardown stops it by PID with the rest of each host's processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from netns import Cluster

__all__ = ["Slurm", "slurm_unavailable"]

#: ``ip netns exec`` mounts a fresh /sys for the namespace, which hides the cgroup hierarchies that
#: slurmd insists on initialising (even with proctrack/linuxproc): mount this machine's v1
#: controllers again in the daemon's own mount namespace (they are the same hierarchies).
CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "pids")
_WITH_CGROUPS = ("mount -t tmpfs cgroup_root /sys/fs/cgroup && for c in " + " ".join(CGROUPS) +
                 "; do mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1; done"
                 " && mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
                 " && exec \"$@\"")

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/mungekey")


def slurm_unavailable() -> str | None:
    missing = [d for d in DAEMONS if not os.path.exists(d)] + [c for c in ("salloc", "srun", "sinfo") if shutil.which(c) is None]
    return f"Slurm is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm munge)" if missing else None


class Slurm:
    def __init__(self, net: Cluster, folder: Path) -> None:
        self.net = net
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        names = list(net.hosts)
        self.socket = folder / "munge.socket"
        key = folder / "munge.key"
        subprocess.run(["/usr/sbin/mungekey", "--create", "--keyfile", str(key)], check=True, timeout=20, capture_output=True)
        self.munged = net.popen(names[0], [
            "/usr/sbin/munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
            f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}",
        ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        first = net.hosts[names[0]]
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs=2 State=UNKNOWN" for h in net.hosts.values())
        self.conf = folder / "slurm.conf"
        self.conf.write_text(f"""ClusterName=distnbtest
SlurmctldHost={first.name}({first.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=30
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
        (folder / "state").mkdir(exist_ok=True)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._wait_for(self.socket.exists, "munged's socket", folder / "munged.log")
        net.popen(names[0], ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for name in names:
            (folder / f"spool-{name}").mkdir(exist_ok=True)
            net.popen(name, ["sh", "-c", _WITH_CGROUPS, "sh", "/usr/sbin/slurmd", "-D", "-N", name, "-f", str(self.conf)], env=self.env,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_for(self._idle, "every node idle in sinfo", folder / "slurmctld.log", timeout=40)

    def sinfo(self) -> str:
        out = subprocess.run(self.net.command(next(iter(self.net.hosts)), ["sinfo", "-h", "-N", "-o", "%N %t"]),
                             env=self.env, capture_output=True, text=True, timeout=20)
        return out.stdout + out.stderr

    def _idle(self) -> bool:
        states = [line.split()[-1] for line in self.sinfo().splitlines() if line.strip()]
        return len(states) == len(self.net.hosts) and all(s == "idle" for s in states)

    def _wait_for(self, predicate, what: str, log: Path, timeout: float = 15) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                text = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
                raise RuntimeError(f"Slurm: no {what} within {timeout} s; sinfo: {self.sinfo() if log.name != 'munged.log' else ''}\n"
                                   f"{log}:\n{text}")
            time.sleep(0.2)
