"""JupyterLab in headless Chromium: run the quickstart and check that distnb's widgets render.

Needs Debian's ``chromium`` and the ``playwright`` package (Playwright's own browser download is
not used); ``.ci/run`` installs both. Screenshots go to ``docs/screenshots/`` (shown in README).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "docs" / "screenshots"

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("jupyterlab")
    home = tmp_path_factory.mktemp("jupyter")
    served = tmp_path_factory.mktemp("served")
    # Serve a copy: JupyterLab's autosave must never write outputs into the repository's notebook.
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", served / "quickstart.ipynb")
    port = free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
        "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={served}",
        "--ServerApp.disable_check_xsrf=True", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = open(home / "lab.log", "wb")
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
                    raise RuntimeError(f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield url
    finally:
        # Stop the server (and the kernels it started) by its process session, which we created.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


def test_quickstart_widgets_render_in_jupyterlab(lab: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"{lab}/lab/tree/quickstart.ipynb")
            # The kernel must be up (its name no longer "No Kernel") and idle before Run All.
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            page.wait_for_function(
                """() => { const k = document.querySelector('.jp-Toolbar-kernelName');
                           const s = document.querySelector('.jp-Notebook-ExecutionIndicator');
                           return k && !k.textContent.includes('No Kernel') && s && s.getAttribute('data-status') === 'idle'; }""",
                timeout=60_000,
            )
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            page.wait_for_function(
                "() => document.querySelector('.jp-Notebook').innerText.includes('pool stopped')", timeout=300_000
            )
            text = page.locator(".jp-Notebook").inner_text()
            # The live cell view: per-rank tabs, grouped output, diagnosis, memory plot.
            tabs = page.locator(".jp-OutputArea .lm-TabBar-tab, .jp-OutputArea .p-TabBar-tab")
            assert tabs.filter(has_text="rank 0").count() >= 1 and tabs.filter(has_text="rank 1").count() >= 1
            assert "[ranks 0,1] hello from the pool" in text
            assert "rank-conditional collective" in text
            assert page.locator(".jp-OutputArea img[src^='data:image/png']").count() >= 1
            hello = page.locator(".jp-Cell").nth(5)  # the cell printing from every rank
            hello.get_by_text("per rank").click()
            hello.get_by_text("rank 1", exact=True).click()
            page.wait_for_timeout(300)
            assert "rank 1 of 2 on cpu" in hello.inner_text()
            hello.screenshot(path=str(SHOTS / "cell_view.png"))
            page.locator(".jp-Cell").nth(9).screenshot(path=str(SHOTS / "hang_diagnosis.png"))
            page.screenshot(path=str(SHOTS / "quickstart.png"), full_page=False)
        finally:
            browser.close()
    for name in ("cell_view.png", "hang_diagnosis.png", "quickstart.png"):
        assert (SHOTS / name).stat().st_size > 10_000
