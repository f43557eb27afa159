"""A real install, as a user gets it: `python -m build` makes the wheel and the sdist from a copy of the checkout, the
wheel goes into a fresh venv (no editable install, nothing from this checkout on the path) and its entry points run.
About a minute (torch is installed into the venv too); `.ci/run` runs it: `pytest -m packaging tests/packaging`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # a local CPU build (an unpinned torch would pull CUDA's packages)


def run(*cmd: object, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=540)
    said = f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}: exit {done.returncode}\n{said}"
    return done.stdout


def test_the_wheel_installs_into_a_fresh_venv_and_its_entry_points_run(tmp_path: Path) -> None:
    version = installed_version("trainwarden")  # this checkout's, installed editable from pyproject.toml
    source = tmp_path / "source"  # a copy of what git tracks: nothing built or installed here leaks in
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    run(sys.executable, "-m", "build", "--outdir", tmp_path / "dist", source, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob(f"trainwarden-{version}-py3-none-any.whl")
    (sdist,) = (tmp_path / "dist").glob(f"trainwarden-{version}.tar.gz")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    assert {"supervisor/cli.py", "supervisor/agent.py", "worker/warden.py", "worker/integrations/hf.py"} <= packaged
    assert not any(name.startswith(("tests/", "examples/", "bench/")) for name in packaged)
    with tarfile.open(sdist) as packed:
        assert f"trainwarden-{version}/pyproject.toml" in packed.getnames()

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", TORCH, wheel, cwd=tmp_path)
    elsewhere = tmp_path  # not the checkout: the installed packages are what imports
    assert run(venv / "bin" / "trainwarden", "--version", cwd=elsewhere).strip() == f"trainwarden {version}"
    assert "run" in run(venv / "bin" / "trainwarden", "--help", cwd=elsewhere)
    assert "--connect" in run(python, "-m", "supervisor.agent", "--help", cwd=elsewhere)
    where = run(python, "-c", "import worker; from worker import Warden; print(worker.__file__)", cwd=elsewhere)
    assert where.startswith(str(venv)), where
