"""What an op declares on its Op (case builder, size ladder, canary) is what calibration and
`dispatch bench` read, and an op that lacks one is refused by name with the field to add
(a fixture plugin, tests/plugins/bareop, declares an op with neither)."""
import os

import pytest

from capdispatch.backends import Backend, Op, Registry, SizeArg, TORCH, build, builtin
from capdispatch.calibrate import inputs

HERE = os.path.dirname(os.path.abspath(__file__))
BARE = os.path.join(HERE, "plugins", "bareop")


@pytest.mark.parametrize("op", list(builtin().ops))
def test_every_builtin_op_declares_its_case_sizes_and_canary(op):
    spec = builtin().ops[op]
    assert inputs.undeclared(spec) == ""
    assert callable(spec.load_case()) and callable(spec.load_canary())
    assert list(spec.sizes) == sorted(set(spec.sizes)) and spec.sizes[0] >= 1


def _op(**kw):
    return Op("bare", "a bare op", "bare(x) -> Tensor", reference="torch", **kw)


@pytest.mark.parametrize("kw, needle", [
    (dict(size=SizeArg("rows", 0, "x"), sizes=(1, 2)), 'declares no calibration case: add case="module:function"'),
    (dict(size=SizeArg("rows", 0, "x"), case="m:f"), "declares no size ladder: add sizes=(...)"),
    (dict(case="m:f", sizes=(1,)), "declares no size argument: add size=SizeArg"),
])
def test_what_an_op_lacks_is_named_with_the_field(kw, needle):
    why = inputs.undeclared(_op(**kw))
    assert "op 'bare'" in why and needle in why


def test_sizes_given_on_the_command_line_stand_in_for_a_ladder():
    assert inputs.undeclared(_op(size=SizeArg("rows", 0, "x"), case="m:f"), sizes_given=True) == ""


def test_the_case_builder_of_an_op_without_one_is_an_error_not_a_keyerror():
    reg = Registry()
    reg.add_op(_op(size=SizeArg("rows", 0, "x")))
    reg.add_backend(Backend("bare", "torch", "torch:clone", requires=(TORCH,)))
    with pytest.raises(inputs.UndeclaredError, match="op 'bare' declares no calibration case"):
        inputs.builder_of("bare", reg)


def test_bench_refuses_an_op_without_a_case_by_name(run_cli):
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), BARE])}
    rc, out, err = run_cli("bench", "--device", "cpu", "--op", "bare_rows", "--sizes", "1", env=env)
    assert rc == 2, err
    assert err.strip().splitlines()[-1].startswith("dispatch: error: --op bare_rows: op 'bare_rows' declares no "
                                                   "calibration case: add case=")
    assert "Traceback" not in err


def test_the_bare_fixture_plugin_loads(monkeypatch):
    monkeypatch.syspath_prepend(BARE)
    reg = build()
    assert "bare_rows" in reg.ops and [p.name for p in reg.plugins if p.ok] == ["bareop"]


def test_the_largest_size_follows_the_ladder_or_a_fixed_bound_without_one():
    """--sizes may reach 16 times an op's ladder's largest; for an op without a ladder, 4096."""
    from capdispatch.calibrate import ladder
    reg = Registry()
    reg.add_op(_op(size=SizeArg("rows", 0, "x"), case="m:f"))
    assert ladder.max_size("bare", reg) == 4096
    assert ladder.max_size("kv_dequant") == 16 * max(builtin().ops["kv_dequant"].sizes)
