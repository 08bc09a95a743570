"""What an op declares on its Op (case builder, size ladder, canary) is what calibration and
`dispatch bench` read, and an op that lacks one is refused by name with the field to add
(a fixture plugin, tests/plugins/bareop, declares an op with neither)."""
import os

import pytest

from capdispatch import errors as cd_errors
from capdispatch.backends import Backend, Op, Out, Registry, SizeArg, TORCH, build, builtin
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


# The schemas the built-in ops had when each op folder wrote its own (ops.py): derived from
# the Op's one declaration now, they must not drift (serialized graphs and caches name them).
_ARGS_DECODE = ("Tensor q, Tensor pool, Tensor indices, int page_size, float sm_scale, Tensor? topk_length=None, "
                "Tensor? attn_sink=None, Tensor? extra_pool=None, Tensor? extra_indices=None, "
                "int? extra_page_size=None, Tensor? extra_topk_length=None")
_ARGS_INDEXER = ("Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, "
                 "Tensor? schedule_metadata=None, int? max_context_len=None, bool clean_logits=False")
_ARGS_PREFILL = ("Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, Tensor? attn_sink=None, "
                 "Tensor? topk_length=None, *, bool use_legacy=True")
_ARGS_MOE = ("Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, int num_experts, int hidden, "
             "int intermediate, int scale_max, float? swiglu_limit, str layout, str[] aux_keys, Tensor[] aux, "
             "Tensor topk_weights, Tensor topk_ids")
SCHEMAS = {
    "kv_quant": ("(Tensor k, Tensor(a!) pool, Tensor loc, int page_size, *, bool checks=True) -> ()", None),
    "kv_dequant": ("(Tensor pool, Tensor token_ids, int page_size, *, bool checks=True) -> Tensor",
                   "(Tensor pool, Tensor token_ids, int page_size, *, Tensor(a!) out, bool checks=True) -> ()"),
    "decode_mla": (f"({_ARGS_DECODE}, *, bool checks=True) -> (Tensor, Tensor)",
                   f"({_ARGS_DECODE}, *, Tensor(a!) out, bool checks=True) -> Tensor"),
    "indexer": (f"({_ARGS_INDEXER}, *, bool checks=True) -> Tensor",
                f"({_ARGS_INDEXER}, *, Tensor(a!) out, bool checks=True) -> ()"),
    "sparse_prefill": (f"({_ARGS_PREFILL}, bool checks=True) -> (Tensor, Tensor, Tensor)",
                       f"({_ARGS_PREFILL}, Tensor(a!) out, bool checks=True) -> (Tensor, Tensor)"),
    "moe": (f"({_ARGS_MOE}, *, bool checks=True) -> Tensor",
            f"({_ARGS_MOE}, *, Tensor(a!) out, bool checks=True) -> ()"),
}


@pytest.mark.parametrize("op", list(builtin().ops))
def test_the_custom_op_schemas_come_from_the_declaration(op):
    # Every op of the registry: its schemas derive from its declaration (records as their
    # parts, `out` keyword-only and mutated, checks last); SCHEMAS pins the built-ins' text.
    spec = builtin().ops[op]
    call = spec.call()
    parts = {t: _load(path).PARTS for t, path in (spec.records or {}).items()}
    functional = call.schema(parts, with_out=False)
    assert functional.endswith(f"bool checks=True) -> {_returns(call.returns)}"), functional
    with_out = call.schema(parts, with_out=True) if call.out is not None else None
    if with_out is not None:
        assert "*" in with_out and "Tensor(a!) out, bool checks=True) -> " in with_out, with_out
    for t in parts:
        assert t not in functional and parts[t] in functional
    assert len(spec.outputs) == len(call.returns)
    if op in SCHEMAS:
        assert (functional, with_out) == SCHEMAS[op]


def test_the_pinned_schemas_are_the_registry_ops():
    assert set(SCHEMAS) <= set(builtin().ops)


def _load(path):
    import importlib
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _returns(returns) -> str:
    return returns[0] if len(returns) == 1 else "(" + ", ".join(returns) + ")"


@pytest.mark.parametrize("kw, needle", [
    (dict(signature="bad(Tensor x) -> Tensor", outputs=()), "returns 1 result(s), outputs= describes 0"),
    (dict(signature="bad(Tensr x) -> Tensor", outputs=(Out(("x.0",)),)), "has type 'Tensr' (valid: Tensor,"),
    (dict(signature="bad(x) -> Tensor", outputs=(Out(("x.0",)),)), "parameter 'x' is not 'TYPE NAME[=DEFAULT]'"),
    (dict(signature="bad(Tensor x, Tensor? out=None) -> Tensor", outputs=(Out(("x.0",)),)),
     "the output buffer is written 'Tensor(a!)? out=None'"),
    (dict(signature="bad(Tensor x) -> int", outputs=(Out(("x.0",)),)), "results are Tensor"),
])
def test_a_malformed_declaration_is_refused_by_name(kw, needle):
    with pytest.raises(ValueError, match=r"^op 'bad': ") as e:
        Op("bad", "a bad op", reference="torch", **kw)
    assert needle in str(e.value)


def test_a_shape_entry_must_name_an_argument_or_a_number():
    with pytest.raises(ValueError, match="neither an int, 'arg', 'arg.k'"):
        Out(("x.0", "x+1"))


def test_an_untyped_signature_only_describes_the_call():
    """Without outputs= the signature is not parsed, and no custom op can be made from it."""
    from capdispatch.backends.torch_ops import custom_op
    op = _op()
    with pytest.raises(ValueError, match="op 'bare' declares no outputs="):
        custom_op(op, "torch", lambda x, *, checks=True: x)


def test_a_derived_op_runs_traces_and_refuses_a_missing_size():
    """A throwaway op declared here: its eager call runs the kernel, its fake follows Out
    (an int argument's value, a product of dims), and a None size argument is named."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from capdispatch.backends.torch_ops import custom_op
    spec = Op("decl_probe", "probe", "decl_probe(Tensor x, int? n=None, *, Tensor(a!)? out=None) -> (Tensor, Tensor)",
              reference="torch", outputs=(Out(("x.0*x.1", "n"), "float32"), Out(("x.0",), "x")))

    def kernel(x, n=None, *, out=None, checks=True):
        a = torch.ones(x.shape[0] * x.shape[1], n) if out is None else out.fill_(1)
        return a, x[:, 0].clone()

    fn = custom_op(spec, "torch", kernel)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    a, b = fn(x, 4)
    assert a.shape == (6, 4) and torch.equal(b, x[:, 0])
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fa, fb = fn.functional(fx, 4)
        assert (tuple(fa.shape), fa.dtype, tuple(fb.shape), fb.dtype) == ((6, 4), torch.float32, (2,), torch.bfloat16)
        with pytest.raises(cd_errors.ArgumentTypeError, match="n is required"):
            fn.functional(fx)
    buf = torch.zeros(6, 4)
    got, first = fn(x, 4, out=buf)
    assert got is buf and bool((buf == 1).all())


def test_a_parameter_named_like_the_bound_functions_own_names_is_refused():
    from capdispatch.backends.torch_ops import custom_op
    spec = Op("decl_clash", "clash", "decl_clash(Tensor x, Tensor impl) -> Tensor", reference="torch",
              outputs=(Out(("x.0",), "x"),))
    with pytest.raises(ValueError, match="op 'decl_clash': parameter name.s. impl are taken"):
        custom_op(spec, "torch", lambda x, impl, *, checks=True: x)


@pytest.mark.parametrize("op", list(builtin().ops))
def test_every_op_declares_how_it_is_compared(op):
    # The rehearsal and the canaries judge a backend by Op.compare: an op without one is
    # refused by name where it is checked (cases.compared).
    spec = builtin().ops[op]
    assert spec.compare, f"op {op!r} declares no compare=\"module:function\""
    assert callable(spec.load_compare())


def test_an_op_without_a_comparison_is_refused_by_name():
    from capdispatch.backends.cases import compared
    from capdispatch.backends.registry import RegistryError
    with pytest.raises(RegistryError, match=r"op 'bare' declares no comparison: add compare="):
        compared(Op("bare", "x", "bare(Tensor x) -> Tensor", reference="torch", outputs=(Out(("x.0",)),)),
                 lambda x: x, (None,), ref=lambda x: x)
