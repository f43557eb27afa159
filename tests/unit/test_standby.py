"""What a standby imports before it is needed: the script's own top-level imports of installed modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from worker.standby import _prewarm_list, script_imports

SCRIPT = """
from __future__ import annotations
import os, json as j
import torch.distributed as dist
from torch.nn import functional
from . import sibling
from .pkg import thing
try:
    import numpy
except ImportError:
    numpy = None
if True:
    import local_helpers
else:
    from email import message
def main():
    import inside_a_function
class Model:
    import inside_a_class
"""


def test_top_level_imports_are_read_from_the_text_without_running_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "raise SystemExit('never run')\n")
    assert script_imports(script) == ["os", "json", "torch.distributed", "torch.nn", "numpy", "local_helpers", "email"]


def test_auto_prewarms_torch_and_installed_modules_but_not_the_projects_own(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "local_helpers.py").write_text("raise SystemExit('imported')\n")
    names = _prewarm_list("auto", script)
    assert names[:2] == ["torch", "torch._dynamo"]  # DDP imports torch._dynamo when it is first built: 1 s of CPU
    assert {"os", "json", "torch.distributed", "torch.nn", "email"} <= set(names)
    assert "local_helpers" not in names  # lives beside the script: its import may act on the attempt's environment


def test_a_script_that_cannot_be_parsed_prewarms_torch_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("def broken(:\n")
    assert _prewarm_list("auto", script) == ["torch", "torch._dynamo"]
    assert _prewarm_list("auto", tmp_path / "missing.py") == ["torch", "torch._dynamo"]


def test_a_configured_list_is_taken_as_it_is(tmp_path: Path) -> None:
    assert _prewarm_list("torch, transformers,,numpy", tmp_path / "x.py") == ["torch", "transformers", "numpy"]


WARM = """
import sys
from worker.standby import warm_loader
warm_loader()
print("torch" in sys.modules)
import torch
warm_loader()
print("torch.utils.serialization" in sys.modules)
"""


def test_a_standby_warms_the_weights_only_loader_and_never_imports_torch_for_it() -> None:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WARM], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
