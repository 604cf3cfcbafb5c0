"""Where py-spy is found: beside the Python that runs distnb (a virtual environment whose bin/ is
not on PATH, as when Jupyter is started by its full path), else on PATH."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from distnb.services import native_stacks
from distnb.services.native_stacks import py_spy_path


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_py_spy_beside_this_python_is_found_without_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert py_spy_path() is None
    assert "py-spy is not installed" in native_stacks.py_spy_dumps({0: 1})[0]
    spy = _executable(venv / "py-spy")
    assert py_spy_path() == str(spy)


def test_py_spy_on_path_when_none_is_beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    elsewhere = tmp_path / "tools"
    elsewhere.mkdir()
    spy = _executable(elsewhere / "py-spy")
    monkeypatch.setenv("PATH", str(elsewhere))
    assert py_spy_path() == str(spy)
