"""The preference order of every op comes from the built-in policy (default.yaml) alone.

default.yaml is read here with PyYAML directly, not through capdispatch's loader, so
that a resolver that took its order from anywhere else (registration, a list in an op
package) disagrees with it. A backend default.yaml does not name (a plugin's) follows
its list, sorted by name.
"""
import importlib
import random
from importlib import resources

import pytest
import yaml
from packaging.specifiers import SpecifierSet

import capdispatch as cd
from capdispatch.backends import Backend, Op, TORCH
from capdispatch.backends.registry import BUILTIN_OP_PACKAGES, Registry, build
from capdispatch.dispatch.resolver import context, resolve_in
from capdispatch.policies import default_order, load_default

# Simulated devices on either side of every device entry and feature family, and the host.
DEVICES = {"sim:h200": "9.0", "sim:b200": "10.0", "sim:rtx-5090": "12.0", "sim:rtx-4090": "8.9",
           "sim:rtx-3080": "8.6", "sim:a100": "8.0", "cpu": None}


def _default_yaml() -> dict:
    text = resources.files("capdispatch.policies").joinpath("default.yaml").read_text("utf-8")
    return yaml.safe_load(text)


def _expected(doc: dict, op: str, cc) -> list:
    """default.yaml's order for OP on a device of compute capability CC: the last device
    entry that matches and names OP, else `ops`; then the rest of `ops`."""
    first = list(doc["ops"][op])
    for entry in reversed(doc.get("devices", [])):
        assert set(entry["match"]) == {"cc"}, f"this test reads cc matches only: {entry['match']}"
        if cc is not None and op in entry["ops"] and cc in SpecifierSet(entry["match"]["cc"]):
            first = list(entry["ops"][op])
            break
    return first + [n for n in doc["ops"][op] if n not in first]


def _recorded():
    """The built-in registrations, as (ops, backends) in the order the op packages make them."""
    class Recorder:
        def __init__(self):
            self.ops, self.backends = [], []

        def add_op(self, op):
            self.ops.append(op)

        def add_backend(self, backend):
            self.backends.append(backend)

        def add_all(self, ops=(), backends=()):
            self.ops.extend(ops)
            self.backends.extend(backends)
    rec = Recorder()
    for pkg in BUILTIN_OP_PACKAGES:
        importlib.import_module(pkg).register(rec)
    return rec.ops, rec.backends


def _registry(ops, backends) -> Registry:
    reg = Registry()
    for op in ops:
        reg.add_op(op)
    for b in backends:
        reg.add_backend(b)
    return reg


def _candidates(reg, op, device, **kw) -> list:
    ctx = context(registry=reg, env={}, **kw)
    return [c.backend for c in resolve_in(ctx, op, cd.probe(device)).candidates]


def test_default_yaml_names_every_builtin_backend_once():
    doc, reg = _default_yaml(), build(plugins=False)
    assert set(doc["ops"]) == set(reg.ops)
    for op in reg.ops:
        listed = doc["ops"][op]
        assert len(listed) == len(set(listed)), (op, listed)
        assert set(listed) == {b.name for b in reg.backends(op)}, op


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_resolver_order_is_default_yaml(device):
    doc, reg = _default_yaml(), build(plugins=False)
    for op in reg.ops:
        assert _candidates(reg, op, device) == _expected(doc, op, DEVICES[device]), (op, device)
    # The device entry is what makes a difference on an SM86 card (a check of the helper).
    assert _expected(doc, "indexer", "8.6") != _expected(doc, "indexer", "9.0")


def test_registration_order_changes_nothing():
    ops, backends = _recorded()
    base = _registry(ops, backends)
    rng = random.Random(15)
    shuffled = list(backends)
    rng.shuffle(shuffled)
    specs = [cd.probe(d) for d in DEVICES]
    base_ctx = context(registry=base, env={})
    for order in (list(reversed(backends)), shuffled):
        other = _registry(list(reversed(ops)), order)
        other_ctx = context(registry=other, env={})
        for op in base.ops:
            assert [b.name for b in other.backends(op)] == [b.name for b in base.backends(op)]
            assert default_order(load_default(other), other, op) == default_order(load_default(base), base, op)
            for spec in specs:
                a, b = resolve_in(base_ctx, op, spec), resolve_in(other_ctx, op, spec)
                assert a.to_dict() == b.to_dict(), (op, spec.id)


class _EntryPoint:
    """The part of importlib.metadata.EntryPoint that plugins.load reads."""

    def __init__(self, name, fn):
        self.name, self.value, self.dist, self._fn = name, f"tests.fake:{name}", None, fn

    def load(self):
        return self._fn


def _plugin(*names, op="kv_dequant"):
    def register(registry):
        for n in names:
            registry.add_backend(Backend(op, n, f"fake_kernels:{n}", requires=(TORCH,),
                                         summary="a plugin backend"))
    return register


@pytest.mark.parametrize("eps", [
    [("one", ("zz_plugin", "aa_plugin"))],
    [("one", ("aa_plugin", "zz_plugin"))],
    [("a", ("zz_plugin",)), ("b", ("aa_plugin",))],
    [("a", ("aa_plugin",)), ("b", ("zz_plugin",))],
])
def test_unnamed_backends_follow_default_yaml_by_name(eps):
    doc = _default_yaml()
    reg = build(entry_points=[_EntryPoint(n, _plugin(*names)) for n, names in eps])
    assert all(p.ok for p in reg.plugins), reg.plugins
    want = list(doc["ops"]["kv_dequant"]) + ["aa_plugin", "zz_plugin"]
    for device in ("sim:h200", "sim:rtx-3080", "cpu"):
        assert _candidates(reg, "kv_dequant", device) == want
    assert list(default_order(load_default(reg), reg, "kv_dequant")) == want
    # A policy that names a plugin backend puts it first; the rest keep the default order.
    pol = cd.policy_from_dict({"ops": {"kv_dequant": ["zz_plugin"]}}, registry=reg)
    got = _candidates(reg, "kv_dequant", "cpu", policy=pol)
    assert got == ["zz_plugin"] + [n for n in want if n != "zz_plugin"]
    # Other ops are untouched.
    assert _candidates(reg, "kv_quant", "cpu") == list(doc["ops"]["kv_quant"])


def test_an_op_default_yaml_does_not_name_tries_its_backends_by_name():
    def register(registry):
        registry.add_op(Op("plug_op", "a plugin's op", "plug_op(x) -> Tensor", reference="torch"))
        for n in ("torch", "beta", "alpha"):
            registry.add_backend(Backend("plug_op", n, f"fake_kernels:{n}", requires=(TORCH,), summary=n))
    reg = build(entry_points=[_EntryPoint("p", register)])
    assert all(p.ok for p in reg.plugins), reg.plugins
    res = resolve_in(context(registry=reg, env={}), "plug_op", cd.probe("cpu"))
    assert [c.backend for c in res.candidates] == ["alpha", "beta", "torch"]
    assert res.source == "registered backends, by name" and not res.user


def test_a_plugin_may_declare_its_backends_at_once():
    """registry.add_all(ops=..., backends=...) from a plugin's register(): staged and
    checked like add_backend, then in the registry; a bad declaration among them is
    refused with the plugin named, and nothing of that plugin lands."""
    import types

    from capdispatch.backends import Backend, TORCH
    from capdispatch.backends import plugins
    from capdispatch.backends.registry import build

    def ep(name, fn):
        return types.SimpleNamespace(name=name, value=f"{name}:register", dist=None, load=lambda: fn)

    good = (Backend("kv_dequant", "zz_one", "zz:one", requires=(TORCH,)),
            Backend("kv_dequant", "zz_two", "zz:two", requires=(TORCH,)))
    bad = (Backend("kv_dequant", "yy_ok", "yy:ok", requires=(TORCH,)),
           Backend("flash_attention", "yy_bad", "yy:bad", requires=(TORCH,)))
    reg = build(plugins=False)            # a registry of its own: the process's stays as it is
    infos = plugins.load(reg, entry_points=[ep("zz", lambda r: r.add_all(backends=good)),
                                            ep("yy", lambda r: r.add_all(backends=bad))])
    by = {i.name: i for i in infos}
    assert by["zz"].ok and set(by["zz"].backends) == {"kv_dequant/zz_one", "kv_dequant/zz_two"}
    assert not by["yy"].ok and "unknown op 'flash_attention'" in by["yy"].message
    names = [b.name for b in reg.backends("kv_dequant")]
    assert "zz_one" in names and "zz_two" in names and "yy_ok" not in names
