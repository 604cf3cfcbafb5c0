"""JupyterLab and Jupyter Notebook 7 in headless Chromium: run the quickstart and check that
distnb's widgets render.

Needs Debian's ``chromium`` and the ``playwright`` package (Playwright's own browser download is
not used); ``.ci/run`` installs both. Screenshots go to the test's temporary folder, or, with
``DISTNB_SCREENSHOTS=1``, to ``docs/screenshots/`` (shown in README), so a plain test run never
changes the checkout.
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
import uuid
from pathlib import Path

import pytest
from conftest import cmdline, kill_pids, marked_processes, wait_gone

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
DOC_SHOTS = ROOT / "docs" / "screenshots"
# Set in the server's environment only: the server, its kernel and the pool that kernel starts
# inherit it, so teardown can find exactly the processes a server fixture started.
MARK = "DISTNB_BROWSER_TEST"

# CI sets DISTNB_REQUIRE_BROWSER=1: there a missing browser is a failed install step, not a skip.
REQUIRED = os.environ.get("DISTNB_REQUIRE_BROWSER") == "1"

pytestmark = [
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def debugger_notebook(path: Path) -> None:
    """A breakpoint on rank 1 of 2 before a collective, for the debugger's round trip in Lab."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in (
        "%load_ext distnb\n%dist_launch -n 2 --backend gloo",
        "%%on_ranks\ndbg_x = rank + 40\nif rank == 1:\n    breakpoint()\ndbg_y = dbg_x + 1\n"
        "t = torch.tensor([float(dbg_y)])\ndist.all_reduce(t)\nprint('sum', t.item())",
        "%dist_shutdown",
    )]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def jupyter_server(app: str, tmp_path_factory: pytest.TempPathFactory):
    """Start ``jupyter lab`` or ``jupyter notebook`` (Notebook 7: the same jupyter_server flags) on
    127.0.0.1 with private config/runtime/settings dirs and no token; yield its URL; stop it and
    everything it started."""
    home = tmp_path_factory.mktemp(app)
    served = tmp_path_factory.mktemp("served")
    # Serve a copy: the frontend's autosave must never write outputs into the repository's notebook.
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", served / "quickstart.ipynb")
    debugger_notebook(served / "debugger.ipynb")
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
        # The quickstart ends with %dist_shutdown, so nothing of the pool may be left by now.
        survivors = wait_gone(marked_processes(MARK, mark), 15.0)
        if survivors:
            details = [f"{p}: {cmdline(p)}" for p in survivors]
            kill_pids(survivors)  # ours (they carry this fixture's mark); don't leave them behind
            raise AssertionError(f"processes started by jupyter {app} outlived it:\n  " + "\n  ".join(details))


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("jupyterlab")
    yield from jupyter_server("lab", tmp_path_factory)


@pytest.fixture
def notebook7(tmp_path_factory: pytest.TempPathFactory):
    notebook = pytest.importorskip("notebook")
    if int(notebook.__version__.split(".")[0]) < 7:
        pytest.skip(f"needs Jupyter Notebook 7, found {notebook.__version__}")
    yield from jupyter_server("notebook", tmp_path_factory)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: docs/screenshots/ when DISTNB_SCREENSHOTS=1, else a scratch folder."""
    if os.environ.get("DISTNB_SCREENSHOTS") == "1":
        DOC_SHOTS.mkdir(parents=True, exist_ok=True)
        return DOC_SHOTS
    return tmp_path


def run_all(page, url: str) -> None:
    """Open the notebook at ``url``, wait for an idle kernel, and Run All Cells."""
    page.goto(url)
    # The kernel must be up (its name no longer "No Kernel") and idle before Run All: both
    # frontends share Lab's toolbar kernel name and execution indicator (it reads "connecting" first).
    page.wait_for_selector(".jp-Notebook", timeout=60_000)
    page.wait_for_function(
        """() => { const k = document.querySelector('.jp-Toolbar-kernelName');
                   const s = document.querySelector('.jp-Notebook-ExecutionIndicator');
                   return k && !k.textContent.includes('No Kernel') && s && s.getAttribute('data-status') === 'idle'; }""",
        timeout=60_000,
    )
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_text("Run All Cells", exact=True).click()


def run_quickstart(sync_api, url: str, check, live_shot: Path | None = None) -> None:
    """Open ``url`` (the quickstart in Lab or Notebook 7), wait for an idle kernel, Run All Cells,
    check distnb's live and finished views (a screenshot of the live one to ``live_shot``), then call
    ``check(page)`` for the frontend's own checks and screenshots."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            run_all(page, url)
            # A cell that runs past its first ticks (the hang, 4 s) gets the live widget view:
            # per-rank tabs and the diagnosis, drawn by the frontend's widget manager.
            tabs = page.locator(".jp-OutputArea .lm-TabBar-tab, .jp-OutputArea .p-TabBar-tab")
            # The hang cell's live view (it runs 4 s): both ranks' tabs at one moment, read in one
            # evaluation (in the closed "per rank"). A live view lasts only while its cell runs; on a
            # loaded machine a shorter cell's view can be handed back between two separate looks.
            page.wait_for_function(
                """(cell) => { const names = [...cell.querySelectorAll('.jp-OutputArea .lm-TabBar-tab, .jp-OutputArea .p-TabBar-tab')]
                                              .map(t => t.textContent);
                               return names.some(n => n.includes('rank 0')) && names.some(n => n.includes('rank 1')); }""",
                arg=page.locator(".jp-Cell").nth(9).element_handle(),
                timeout=300_000,
            )
            if live_shot is not None:
                page.locator(".jp-Cell").nth(9).screenshot(path=str(live_shot))
            page.wait_for_function(
                "() => document.querySelector('.jp-Notebook').innerText.includes('pool stopped')", timeout=300_000
            )
            text = page.locator(".jp-Notebook").inner_text()
            # Every finished cell handed its widgets back, leaving its static view: grouped output,
            # diagnosis, memory plot, and a <details> per rank.
            assert tabs.count() == 0, "a finished cell still shows widgets"
            assert "[ranks 0,1] hello from the pool" in text
            assert "rank-conditional collective" in text
            assert page.locator(".jp-OutputArea img[src^='data:image/png']").count() >= 1
            hello = page.locator(".jp-Cell").nth(5)  # the cell printing from every rank
            assert "rank 1 of 2 on cpu" in hello.inner_text()  # the grouped output
            hello.locator("summary", has_text="per rank").click()
            rank1 = hello.locator("details details", has_text="rank 1")
            rank1.locator("summary").click()
            page.wait_for_timeout(300)
            assert "rank 1 of 2 on cpu" in rank1.inner_text() and "hello from the pool" in rank1.inner_text()
            check(page)
        finally:
            browser.close()


def test_quickstart_widgets_render_in_jupyterlab(lab: str, shots: Path) -> None:
    sync_api = playwright_api()

    def snap(page) -> None:
        page.locator(".jp-Cell").nth(5).screenshot(path=str(shots / "cell_view.png"))
        page.locator(".jp-Cell").nth(9).screenshot(path=str(shots / "hang_diagnosis.png"))
        page.screenshot(path=str(shots / "quickstart.png"), full_page=False)

    run_quickstart(sync_api, f"{lab}/lab/tree/quickstart.ipynb", snap, live_shot=shots / "live_view.png")
    for name in ("cell_view.png", "hang_diagnosis.png", "quickstart.png", "live_view.png"):
        assert (shots / name).stat().st_size > 10_000


def test_quickstart_widgets_render_in_notebook7(notebook7: str, shots: Path) -> None:
    sync_api = playwright_api()

    def snap(page) -> None:
        # Notebook 7's own single-document shell, not Lab's: its logo and its toolbar's kernel logo.
        assert page.locator("#jp-NotebookLogo").count() == 1 and page.locator("#jp-MainLogo").count() == 0
        assert page.locator(".jp-NotebookKernelLogo").count() == 1
        # Scroll to the first %%on_ranks cell: it and the hello cell (rank 1 selected above) fill the view.
        page.locator(".jp-Cell").nth(3).evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(300)
        page.screenshot(path=str(shots / "notebook7.png"), full_page=False)

    run_quickstart(sync_api, f"{notebook7}/notebooks/quickstart.ipynb", snap)
    assert (shots / "notebook7.png").stat().st_size > 10_000


def test_a_debugger_command_typed_into_jupyterlabs_input_box(lab: str, shots: Path) -> None:
    """Run All stops at rank 1's breakpoint: Lab shows its input box with the rank's prompt; a pdb
    command typed there is answered, labelled by rank; c lets the cell (and the notebook) finish."""
    sync_api = playwright_api()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            run_all(page, f"{lab}/lab/tree/debugger.ipynb")
            box = page.locator(".jp-Stdin-input")
            box.wait_for(timeout=120_000)
            assert "[rank 1] (Pdb)" in page.locator(".jp-Stdin-prompt").inner_text()
            notebook = page.locator(".jp-Notebook")
            assert "rank 1 is paused in the debugger at cell 1 line 4 (dbg_y = dbg_x + 1)" in notebook.inner_text()
            box.fill("p dbg_x * 2")
            box.press("Enter")
            page.wait_for_function("() => document.querySelector('.jp-Notebook').innerText.includes('[rank 1] 82')", timeout=30_000)
            # Lab keeps the answered box (with its line) and adds a new one for the next prompt.
            page.wait_for_function("() => document.querySelectorAll('.jp-Stdin-input').length === 2", timeout=30_000)
            page.locator(".jp-Stdin-input").last.fill("c")
            page.locator(".jp-Stdin-input").last.press("Enter")
            page.wait_for_function("() => document.querySelector('.jp-Notebook').innerText.includes('pool stopped')", timeout=120_000)
            page.locator(".jp-Cell").nth(1).screenshot(path=str(shots / "debugger.png"))
        finally:
            browser.close()
    assert (shots / "debugger.png").stat().st_size > 5_000
