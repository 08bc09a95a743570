"""The README's install promise, in a fresh virtual environment made as the README says:
`pip install -e .` from a checkout alone (attrs, PyYAML, packaging, platformdirs, rich; no torch)
plans simulated devices with every planning command."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"

pytestmark = pytest.mark.slow


def _dependencies() -> list:
    """The main install's dependencies, as pyproject.toml declares them."""
    try:
        import tomllib
    except ImportError:       # Python 3.10: no TOML reader in the standard library
        pytest.skip("reading pyproject.toml needs Python >= 3.11 (tomllib)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]["dependencies"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    where = tmp_path_factory.mktemp("plain-install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    py = str(where / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CAPDISPATCH_"))}
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for args in (_dependencies(), ["--no-deps", "-e", ROOT]):
        p = subprocess.run(pip + args, capture_output=True, text=True, env=env, timeout=300)
        if p.returncode != 0:
            pytest.skip(f"pip cannot install here (no package index?): {p.stderr.strip()[-300:]}")
    return where, env


def _dispatch(venv, *args):
    where, env = venv
    env = dict(env, CAPDISPATCH_CACHE_DIR=str(where / "cache"))
    p = subprocess.run([str(where / "bin" / "dispatch"), *args], capture_output=True, text=True,
                       env=env, timeout=120, cwd=str(where))
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def test_the_plain_install_has_no_torch(venv):
    where, env = venv
    p = subprocess.run([str(where / "bin" / "python"), "-c", "import torch"], capture_output=True,
                       env=env, timeout=60)
    assert p.returncode != 0


def test_a_plain_install_plans_simulated_devices_and_says_with_what(venv):
    rc, out, err = _dispatch(venv, "explain", "--device", RIG, "--brief")
    assert rc == 0, err
    flat = " ".join(line.strip() for line in out.splitlines())
    assert "libraries: the sglang-0.5.23 profile's (the default for simulated devices)" in flat
    assert "note: simulated devices, planned with the sglang-0.5.23 profile's libraries" in flat
    row = next(line for line in out.splitlines() if line.strip().startswith("kv_quant"))
    assert row.split()[1:] == ["≠", "triton_fp8", "triton_u8*", "triton_u8*"]
    rc, out, err = _dispatch(venv, "explain", "--device", RIG, "--format", "json")
    assert rc == 0, err
    inv = json.loads(out)["inventory"]
    assert inv["default"] is True and inv["profile"] == "sglang-0.5.23" and "--libs local" in inv["note"]
    rc, out, err = _dispatch(venv, "sglang", "plan", "--device", RIG, "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["inventory"]["default"] is True
    rc, out, err = _dispatch(venv, "lock", "--device", RIG)
    assert rc == 0, err
    assert "libs: [sglang-0.5.23]" in out or "- sglang-0.5.23" in out
    for cmd in (["devices", "--device", RIG], ["catalog"], ["env"], ["ops"],
                ["policy", "show"]):
        rc, out, err = _dispatch(venv, *cmd)
        assert rc == 0, (cmd, err)


def test_a_plain_install_with_this_machines_libraries_says_which_flag_helps(venv):
    rc, out, err = _dispatch(venv, "explain", "--device", RIG, "--libs", "local")
    assert rc == 3 and out == ""
    assert "torch is not installed" in err
    assert "--libs PROFILE" in err and "--assume-lib" in err


def test_bench_without_torch_is_a_clear_error(venv):
    rc, out, err = _dispatch(venv, "bench", "--device", "cpu")
    assert rc == 2, err
    assert err.count("\n") == 1 and "torch" in err and "capdispatch[torch]" in err


def test_the_sdist_carries_what_its_tests_need_and_the_license(venv, tmp_path):
    import shutil
    import tarfile
    where, env = venv
    py = str(where / "bin" / "python")
    p = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "setuptools>=77"],
                       capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        pytest.skip(f"pip cannot install setuptools here: {p.stderr.strip()[-300:]}")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache", "build", "dist"))
    out = tmp_path / "dist"
    p = subprocess.run([py, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
                       capture_output=True, text=True, env=env, cwd=str(src), timeout=300)
    assert p.returncode == 0, p.stderr
    with tarfile.open(out / p.stdout.strip().splitlines()[-1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        info = tar.extractfile(next(n for n in tar.getnames() if n.endswith("/PKG-INFO")
                                    and n.count("/") == 1)).read().decode()
    for need in ("LICENSE", "tests/conftest.py", "tests/property/conftest.py", "tests/op_cases.py",
                 "tests/requirements.txt", "tests/requirements-nodeps.txt", "tests/policies/error.yaml",
                 "tests/plugins", "docs/cli.md", "docs/ops/kv_cache.md", "capdispatch/policies/default.yaml"):
        assert need in names or any(n.startswith(need + "/") for n in names), need
    assert "License-Expression: Apache-2.0" in info and "License-File: LICENSE" in info
