"""JupyterLab (or Jupyter Notebook 7) served on 127.0.0.1 and driven by Playwright in Debian's
headless Chromium: the pieces the browser tests share (test_browser.py, test_debug_panel.py).

Playwright's own browser download is not used; ``.ci/run`` installs Debian's ``chromium`` and the
``playwright`` package. A server runs with a fresh ``DISTNB_BROWSER_TEST`` mark in its environment,
so its teardown finds (and fails the test on) exactly the processes it, its kernels and their pools
left behind. Screenshots go to the test's temporary folder, or, with ``DISTNB_SCREENSHOTS=1``, to
``docs/screenshots/`` (shown in README), so a plain test run never changes the checkout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from distnb.launching.network import port_for_another

from conftest import cmdline, kill_pids, marked_processes, wait_gone

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
DOC_SHOTS = ROOT / "docs" / "screenshots"
# Set in the server's environment only: the server, its kernel and the pool that kernel starts
# inherit it, so teardown can find exactly the processes a server fixture started.
MARK = "DISTNB_BROWSER_TEST"

# CI sets DISTNB_REQUIRE_BROWSER=1: there a missing browser is a failed install step, not a skip.
REQUIRED = os.environ.get("DISTNB_REQUIRE_BROWSER") == "1"

# For a module's pytestmark: end-to-end, bounded, skipped where no browser is installed.
BROWSER_MARKS = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not REQUIRED and not os.path.exists(CHROMIUM), reason="needs Debian's chromium (apt-get install chromium)"),
]


def playwright_api():
    if REQUIRED:
        import playwright.sync_api as api  # an ImportError here fails the test: CI installs it

        assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing; .ci/run installs Debian's chromium"
        return api
    return pytest.importorskip("playwright.sync_api")


def launch_chromium(p):
    """Debian's Chromium, headless, through a ``sync_playwright()`` handle ``p``."""
    return p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def free_port() -> int:
    """A port for the server this test starts (below the range outgoing connections take)."""
    return port_for_another("127.0.0.1")


def shots_dir(tmp_path: Path) -> Path:
    """Where screenshots go: docs/screenshots/ when DISTNB_SCREENSHOTS=1, else a scratch folder."""
    if os.environ.get("DISTNB_SCREENSHOTS") == "1":
        DOC_SHOTS.mkdir(parents=True, exist_ok=True)
        return DOC_SHOTS
    return tmp_path


def jupyter_server(app: str, tmp_path_factory: pytest.TempPathFactory, prepare: Callable[[Path], None],
                   settings: dict[str, dict[str, object]] | None = None) -> Iterator[str]:
    """Start ``jupyter lab`` or ``jupyter notebook`` (Notebook 7: the same jupyter_server flags) on
    127.0.0.1 with private config/runtime/settings dirs and no token, serving a scratch folder that
    ``prepare(folder)`` fills with notebooks (copies: the frontend's autosave must never write
    outputs into the repository); yield its URL; stop it and everything it started. ``settings``:
    user settings by plugin, e.g. ``{"@jupyterlab/apputils-extension:notification": {...}}``."""
    home = tmp_path_factory.mktemp(app)
    served = tmp_path_factory.mktemp("served")
    prepare(served)
    # No "get notified about Jupyter news?" toast over what the screenshots show, in any test.
    quiet = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}
    for plugin, values in {**quiet, **(settings or {})}.items():
        package, name = plugin.split(":")
        path = home / "settings" / package / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    mark = uuid.uuid4().hex
    env = {
        **os.environ,
        MARK: mark,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }
    cmd = [
        sys.executable, "-m", "jupyter", app, "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
        "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={served}",
        "--ServerApp.disable_check_xsrf=True",
    ]
    if app == "lab":
        cmd += ["--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log_path = home / f"{app}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter {app} did not start:\n{log_path.read_text()[-3000:]}") from None
                time.sleep(0.3)
        yield url
    finally:
        # Stop the server by its process session, which we created; on SIGTERM it shuts down its kernels.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)
        log.close()
        # The kernel runs in a session of its own and the pool in others: find them by the mark.
        # Every notebook served ends with %dist_shutdown or has its kernel shut down with the server,
        # so nothing of a pool may be left by now.
        survivors = wait_gone(marked_processes(MARK, mark), 15.0)
        if survivors:
            details = [f"{p}: {cmdline(p)}" for p in survivors]
            kill_pids(survivors)  # ours (they carry this fixture's mark); don't leave them behind
            raise AssertionError(f"processes started by jupyter {app} outlived it:\n  " + "\n  ".join(details))


def open_notebook(page, url: str) -> None:
    """Open the notebook at ``url`` and wait until its kernel is up and idle."""
    page.goto(url)
    # The kernel must be up (its name no longer "No Kernel") and idle: both frontends share Lab's
    # toolbar kernel name and execution indicator (it reads "connecting" first).
    page.wait_for_selector(".jp-Notebook", timeout=60_000)
    page.wait_for_function(
        """() => { const k = document.querySelector('.jp-Toolbar-kernelName');
                   const s = document.querySelector('.jp-Notebook-ExecutionIndicator');
                   return k && !k.textContent.includes('No Kernel') && s && s.getAttribute('data-status') === 'idle'; }""",
        timeout=60_000,
    )


def run_all(page, url: str) -> None:
    """Open the notebook at ``url``, wait for an idle kernel, and Run All Cells."""
    open_notebook(page, url)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_text("Run All Cells", exact=True).click()
