"""The README's test command is what CI runs."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bash_blocks():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks()
    assert len(blocks) >= 2
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert blocks[1].strip() in ci


def test_main_command_uses_the_installed_entry_point():
    main = _bash_blocks()[0]
    assert "dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080" in main
    assert "dispatch devices" in main
