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


def _doc_texts():
    from doc_files import docs
    for doc in docs():
        yield doc, open(os.path.join(ROOT, doc), encoding="utf-8").read()


def test_no_install_line_asks_the_package_index_for_capdispatch():
    """capdispatch is installed from a checkout (`pip install -e .`): the package index has
    none. Adding an extra to an installed capdispatch (`pip install 'capdispatch[torch]'`)
    needs no index for capdispatch itself."""
    bare = re.compile(r"pip install (?:-\S+ )*capdispatch(?![\w\[-])")
    said = [(doc, text[:m.start()].count("\n") + 1) for doc, text in _doc_texts() for m in bare.finditer(text)]
    assert said == []
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "not on the package index yet" in readme and "pip install -e ." in readme


def _dependency_names() -> set:
    try:
        import tomllib
    except ImportError:       # Python 3.10
        import pytest
        pytest.skip("reading pyproject.toml needs Python >= 3.11 (tomllib)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in deps}


def test_the_dependency_lists_are_pyproject_s():
    want = _dependency_names()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (listed,) = re.findall(r"that install alone\s+\(([^)]*)\)", readme)
    assert {n.strip().lower() for n in listed.split(",")} == want
    arch = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    (listed,) = re.findall(r"the core depends on\s+(.*?) only", arch, flags=re.S)
    assert {n.strip().lower() for n in re.split(r",|\band\b", listed) if n.strip()} == want
