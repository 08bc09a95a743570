"""Fault injection: plugins that hang at import, exit the process, print into the
command's output or declare what cannot be evaluated (tests/plugins/hostile). Each is
skipped by name within the time bound; the others, and the built-ins, load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from importlib import metadata


from capdispatch.backends import plugins, registry

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOSTILE = os.path.join(HERE, "plugins", "hostile")


def _eps():
    path = os.path.join(HOSTILE, "capdispatch_hostileplugin-0.1.dist-info", "entry_points.txt")
    out = []
    for line in open(path):
        if "=" in line:
            name, value = (x.strip() for x in line.split("=", 1))
            out.append(metadata.EntryPoint(name, value, plugins.GROUP))
    return out


def test_hostile_plugins_are_contained_in_process(monkeypatch, capsys):
    monkeypatch.syspath_prepend(HOSTILE)
    reg = registry.build(plugins=False)
    t0 = time.monotonic()
    infos = {i.name: i for i in plugins.load(reg, _eps(), timeout=1.0)}
    assert time.monotonic() - t0 < 1.0 + 8                 # one hang costs the bound, once
    why = {n: i.message for n, i in infos.items() if not i.ok}
    assert "import did not finish within 1 s" in why["sleeps"]
    assert why["exits"] == "import failed: SystemExit: code 0"          # and this process lives on
    assert "min_cc 'sm_90' is not a compute capability" in why["bad_target"]
    assert "cannot be evaluated on" in why["forged_target"]
    assert "_Sly" in why["sly_requirement"] and "is not one of" in why["sly_requirement"]
    assert infos["fine"].ok and infos["chatty"].ok
    assert infos["chatty"].output == "hello from a plugin on stdout\nand on stderr\n"
    out, err = capsys.readouterr()
    assert "hello" not in out and "hello" not in err                   # captured, not printed
    assert reg.has_backend("kv_dequant", "plug_fine") and not reg.has_backend("kv_dequant", "plug_sly")


def test_hostile_plugins_do_not_break_commands(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HOSTILE]), CAPDISPATCH_IMPORT_TIMEOUT="1",
               CAPDISPATCH_CACHE_DIR=str(tmp_path))
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_LOCK"):
        env.pop(k, None)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "capdispatch", "explain", "--device", "sim:h200", "--op",
                        "kv_dequant", "--format", "json"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert time.monotonic() - t0 < 30
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)                                # nothing a plugin printed in it
    assert obj["ops"]["kv_dequant"]["per_device"]["sim:h200"]["backend"]
    for name in ("sleeps", "exits", "bad_target", "forged_target", "sly_requirement"):
        assert f"plugin '{name}'" in p.stderr and "skipped" in p.stderr, name
    assert "hello" not in p.stdout


def test_the_registry_is_built_once_under_concurrent_first_calls(monkeypatch):
    calls = []
    real = registry.build

    def slow_build(**kw):
        calls.append(threading.get_ident())
        time.sleep(0.2)
        return real(plugins=False)
    monkeypatch.setattr(registry, "_builtin", None)
    monkeypatch.setattr(registry, "build", slow_build)
    got = []
    threads = [threading.Thread(target=lambda: got.append(registry.builtin())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(got) == 8 and all(g is got[0] for g in got)


HARDEXIT = os.path.join(HERE, "plugins", "hardexit")


def _hard_env(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HARDEXIT]), CAPDISPATCH_IMPORT_TIMEOUT="5",
               CAPDISPATCH_CACHE_DIR=str(tmp_path))
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_LOCK"):
        env.pop(k, None)
    return env


def test_a_plugin_calling_os_exit_or_abort_is_skipped_and_the_command_answers(tmp_path):
    """os._exit(0) at import (through os or a name imported from it) and os.abort() in
    register() end a process past every exception handler: on a plugin's loader thread
    they raise instead, the plugin is skipped by name and the command answers."""
    env = _hard_env(tmp_path)
    p = subprocess.run([sys.executable, "-m", "capdispatch", "explain", "--device", "sim:h200", "--op",
                        "kv_dequant", "--format", "json"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip(), (p.returncode, p.stderr)
    assert json.loads(p.stdout)["ops"]["kv_dequant"]["per_device"]["sim:h200"]["backend"]
    for name in ("exits_at_import", "exits_from_import"):
        assert f"plugin '{name}'" in p.stderr and "called os._exit(0), which would end the process" in p.stderr
    assert "plugin 'aborts_in_register'" in p.stderr and "register() raised called os.abort()" in p.stderr
    p = subprocess.run([sys.executable, "-m", "capdispatch", "ops", "--format", "json"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    got = {i["name"]: i for i in json.loads(p.stdout)["plugins"]}
    assert not got["exits_at_import"]["ok"] and got["exits_at_import"]["message"] == \
        "import failed: called os._exit(0), which would end the process"
    assert got["after_them"]["ok"] and got["after_them"]["backends"] == ["kv_dequant/plug_after_exit"]


def test_the_exit_guard_is_only_for_loader_threads_of_this_process(tmp_path):
    """A child a plugin forks exits as it asks; once plugins are loaded os._exit is the
    real one again."""
    script = (
        "import os\n"
        "from importlib import metadata\n"
        "import capdispatch_hardexit as h\n"
        "from capdispatch.backends import plugins, registry\n"
        "real = os._exit\n"
        "ep = metadata.EntryPoint('forks', 'capdispatch_hardexit:forks', plugins.GROUP)\n"
        "[info] = plugins.load(registry.build(plugins=False), [ep], timeout=5)\n"
        "assert info.ok, info\n"
        "assert h.child_status == 7, h.child_status\n"
        "assert os._exit is real\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", script], env=_hard_env(tmp_path), capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr
