"""A library that raises or hangs at import is that library's failed check, in
bounded time; the rest of the decision goes on."""
import sys
import textwrap
import threading
import time

import pytest

import capdispatch as cd
from capdispatch.backends import Backend, Library, Op, Registry
from capdispatch.capabilities.libraries import import_check


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """Modules that hang (until released), raise or exit at import."""
    release = threading.Event()
    monkeypatch.setattr(sys.modules["builtins"], "_capdispatch_test_release", release, raising=False)
    (tmp_path / "cdtest_hangs.py").write_text(textwrap.dedent("""
        import builtins
        builtins._capdispatch_test_release.wait(60)
    """))
    (tmp_path / "cdtest_raises.py").write_text("raise RuntimeError('no driver   found\\n here')\n")
    (tmp_path / "cdtest_exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "cdtest_fine.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield release
    release.set()
    for m in ("cdtest_hangs", "cdtest_raises", "cdtest_exits", "cdtest_fine"):
        sys.modules.pop(m, None)


def test_a_hanging_import_times_out_and_is_not_waited_for_twice(fake_modules):
    t0 = time.monotonic()
    first = import_check("cdtest_hangs", timeout=0.5)
    assert not first.ok and "timed out after 0.5 s" in first.error
    second = import_check("cdtest_hangs", timeout=0.5)
    assert not second.ok and "timed out" in second.error
    assert time.monotonic() - t0 < 5
    fake_modules.set()              # the import finishes: later checks see it
    for _ in range(100):
        if import_check("cdtest_hangs", timeout=0.5).ok:
            break
    assert import_check("cdtest_hangs", timeout=0.5).ok


@pytest.mark.parametrize("module,needle", [("cdtest_raises", "RuntimeError: no driver found here"),
                                           ("cdtest_exits", "SystemExit: 3"),
                                           ("cdtest_absent_xyz", "ModuleNotFoundError")])
def test_an_import_that_fails_is_a_recorded_fact(fake_modules, module, needle):
    r = import_check(module, timeout=30)
    assert not r.ok and needle in r.error


def test_bad_timeout_variable_is_refused(fake_modules):
    with pytest.raises(cd.CapdispatchError, match="CAPDISPATCH_IMPORT_TIMEOUT='soon'"):
        import_check("cdtest_fine", env={"CAPDISPATCH_IMPORT_TIMEOUT": "soon"})
    assert import_check("cdtest_fine", env={"CAPDISPATCH_IMPORT_TIMEOUT": "5"}).ok


def test_explain_on_a_real_device_survives_a_hanging_library(fake_modules):
    """The resolver's import check on cpu (a real device): the hanging backend fails
    its check within the limit, the next one wins (an op no policy names tries its
    backends by name: hangs, raises, simple)."""
    from capdispatch.backends import builtin
    reg = Registry()            # the built-in ops (the default policy names them) plus one
    for op in builtin().ops.values():
        reg.add_op(op)
        for b in builtin().backends(op.name):
            reg.add_backend(b)
    reg.add_op(Op("demo", "demo op", "demo(x)", reference="simple"))
    reg.add_backend(Backend("demo", "hangs", "cdtest_hangs:f",
                            requires=(Library("attrs", module="cdtest_hangs"),)))
    reg.add_backend(Backend("demo", "raises", "cdtest_raises:f",
                            requires=(Library("attrs", module="cdtest_raises"),)))
    reg.add_backend(Backend("demo", "simple", "cdtest_fine:f",
                            requires=(Library("attrs", module="cdtest_fine"),)))
    t0 = time.monotonic()
    res = cd.resolve("demo", "cpu", registry=reg, env={"CAPDISPATCH_IMPORT_TIMEOUT": "0.5"})
    assert time.monotonic() - t0 < 10
    assert res.backend == "simple"
    hangs, raises = res.candidates[0], res.candidates[1]
    assert not hangs.ok and "import cdtest_hangs failed: timed out after 0.5 s" in hangs.checks[0].message
    assert not raises.ok and "RuntimeError" in raises.checks[0].message


def test_the_text_trace_says_why_an_import_failed(fake_modules):
    from capdispatch.backends import builtin
    from capdispatch.dispatch.explain import plan, render_text
    reg = Registry()
    for op in builtin().ops.values():
        reg.add_op(op)
        for b in builtin().backends(op.name):
            reg.add_backend(b)
    reg.add_op(Op("demo", "demo op", "demo(x)", reference="simple"))
    reg.add_backend(Backend("demo", "raises", "cdtest_raises:f",
                            requires=(Library("attrs", module="cdtest_raises"),)))
    reg.add_backend(Backend("demo", "simple", "cdtest_fine:f",
                            requires=(Library("attrs", module="cdtest_fine"),)))
    text = " ".join(render_text(plan(["cpu"], ["demo"], registry=reg, log_warnings=False)).split())
    assert "import failed (RuntimeError: no driver found here)" in text
