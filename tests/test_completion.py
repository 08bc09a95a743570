"""Shell completion (argcomplete) of --model, `dispatch model NAME` and rehearse's emu:
devices, run as the shell runs it: a fresh process answering COMP_LINE."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("line,want", [
    ("dispatch explain --model deepseek-v4-f", {"deepseek-v4-flash"}),
    ("dispatch plan --model deepseek-v4-", {"deepseek-v4-flash", "deepseek-v4-pro"}),
    ("dispatch model deepseek-v4-p", {"deepseek-v4-pro"}),
    ("dispatch rehearse --device emu:rtx-308", {"emu:rtx-3080@cpu", "emu:rtx-3080@cuda:0"}),
    ("dispatch rehearse --device cpu,emu:rtx-5090@c", {"cpu,emu:rtx-5090@cpu", "cpu,emu:rtx-5090@cuda:0"}),
    ("dispatch rehearse --model deepseek-v4-f", {"deepseek-v4-flash"}),
])
def test_completion_of_models_and_emulated_devices(tmp_path, line, want):
    out = tmp_path / "completions"
    env = dict(os.environ, _ARGCOMPLETE="1", _ARGCOMPLETE_IFS="\n",
               _ARGCOMPLETE_STDOUT_FILENAME=str(out), COMP_LINE=line, COMP_POINT=str(len(line)))
    subprocess.run([sys.executable, "-m", "capdispatch"], cwd=ROOT, timeout=60, check=True, env=env)
    assert {c.strip() for c in out.read_text().split("\n") if c.strip()} == want
