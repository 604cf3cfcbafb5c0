"""The multi-host tests' network as a fixture: two hosts made of network namespaces on a private
bridge (tests/netns.py), Debian's sshd on ``hostb`` admitting a key made for the module; and
``slurm``, a Slurm cluster on those hosts (tests/slurm_cluster.py). Loaded by tests/conftest.py;
each module that asks gets its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from slurm_cluster import Slurm, slurm_unavailable

from conftest import RUN_MARK
from netns import Cluster, netns_unavailable

__all__ = ["net", "slurm", "unavailable"]


def unavailable() -> str | None:
    """Why this machine can't build the hosts (None: it can)."""
    why = netns_unavailable()
    if why is None and shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
        why = "no sshd (Debian: apt-get install openssh-server)"
    return why


@pytest.fixture(scope="module")
def net(leak_check, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = unavailable()
    if why:
        if os.environ.get("DISTNB_REQUIRE_NETNS") == "1":
            pytest.fail(f"DISTNB_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("netns")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id")], check=True, timeout=20)
    cluster = Cluster(["hosta", "hostb"], tmp)
    try:
        # Sessions are marked like every process of this test run, so the leak check sees them too.
        # hostb's own folder of attachable jobs: its ssh sessions list it, as on a machine of its own.
        cluster.jobs_b = tmp / "jobs-hostb"  # type: ignore[attr-defined]
        cluster.start_sshd("hostb", (tmp / "id.pub").read_text(), {RUN_MARK: os.environ[RUN_MARK], "DISTNB_JOBS_DIR": str(cluster.jobs_b)})  # type: ignore[attr-defined]
        cluster.ssh = (f"ssh -i {tmp / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "  # type: ignore[attr-defined]
                       "-o LogLevel=ERROR -o ConnectTimeout=5")
        yield cluster
    finally:
        cluster.close()
    assert not cluster.leftovers(), f"the test network outlived its teardown: {cluster.leftovers()}"


@pytest.fixture(scope="module")
def slurm(net: Cluster) -> Slurm:
    """A Slurm cluster on the module's hosts (started only for the tests that ask for it)."""
    why = slurm_unavailable()
    if why:
        if os.environ.get("DISTNB_REQUIRE_NETNS") == "1":
            pytest.fail(f"DISTNB_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    # Its daemons run in the hosts, so the cluster's teardown stops them with everything else.
    return Slurm(net, net.workdir / "slurm")
