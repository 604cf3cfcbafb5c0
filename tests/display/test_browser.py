"""JupyterLab and Jupyter Notebook 7 in headless Chromium: run the quickstart and check that
distnb's widgets render.

Needs Debian's ``chromium`` and the ``playwright`` package (Playwright's own browser download is
not used); ``.ci/run`` installs both. Screenshots go to the test's temporary folder, or, with
``DISTNB_SCREENSHOTS=1``, to ``docs/screenshots/`` (shown in README), so a plain test run never
changes the checkout.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from lab_harness import BROWSER_MARKS, ROOT, jupyter_server, launch_chromium, playwright_api, run_all, shots_dir

pytestmark = BROWSER_MARKS


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


def serve_quickstart(served: Path) -> None:
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", served / "quickstart.ipynb")
    debugger_notebook(served / "debugger.ipynb")


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("jupyterlab")
    yield from jupyter_server("lab", tmp_path_factory, serve_quickstart)


@pytest.fixture
def notebook7(tmp_path_factory: pytest.TempPathFactory):
    notebook = pytest.importorskip("notebook")
    if int(notebook.__version__.split(".")[0]) < 7:
        pytest.skip(f"needs Jupyter Notebook 7, found {notebook.__version__}")
    yield from jupyter_server("notebook", tmp_path_factory, serve_quickstart)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: docs/screenshots/ when DISTNB_SCREENSHOTS=1, else a scratch folder."""
    return shots_dir(tmp_path)


def run_quickstart(sync_api, url: str, check, live_shot: Path | None = None) -> None:
    """Open ``url`` (the quickstart in Lab or Notebook 7), wait for an idle kernel, Run All Cells,
    check distnb's live and finished views (a screenshot of the live one to ``live_shot``), then call
    ``check(page)`` for the frontend's own checks and screenshots."""
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
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
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            run_all(page, f"{lab}/lab/tree/debugger.ipynb")
            box = page.locator(".jp-Stdin-input")
            box.wait_for(timeout=120_000)
            assert "[rank 1] (Pdb)" in page.locator(".jp-Stdin-prompt").inner_text()
            notebook = page.locator(".jp-Notebook")
            assert re.search(r"rank 1 is paused in the debugger at In\[\d+\] line 4 \(dbg_y = dbg_x \+ 1\)", notebook.inner_text())
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
