"""Shell completion through argcomplete (the `completion` extra).

Enable it with `eval "$(register-python-argcomplete dispatch)"`. The completers
only read declarations and the catalog: no torch, no device probe. Comma lists
(`--device sim:rtx-5090,sim:rt<TAB>`) complete their last item.
"""
from __future__ import annotations


def _comma(values):
    def complete(prefix, **_):
        head, sep, last = prefix.rpartition(",")
        lead = head + sep
        return [lead + v for v in values() if v.startswith(last)]
    return complete


def _device_names():
    from ..capabilities import catalog
    return ["cpu", "cuda:0", "cuda:1"] + [f"sim:{n}" for n in catalog.names()]


def _emulated_names():
    """What `dispatch rehearse --device` takes: cpu, cuda:N and emu:NAME@DEV for every
    catalog card (decided as that card, run on cpu or cuda:0)."""
    from ..capabilities import catalog
    return ["cpu", "cuda:0", "cuda:1"] + [f"emu:{n}@{dev}" for n in catalog.names() for dev in ("cpu", "cuda:0")]


def _model_names():
    from ..models.loader import builtin_names
    return builtin_names()


def _op_names():
    from ..backends import builtin
    return list(builtin().ops)


def _selections():
    from ..backends import builtin
    reg = builtin()
    return [f"{op}={b.name}" for op in reg.ops for b in reg.backends(op)]


def _libraries():
    from ..backends import builtin
    from ..capabilities import lib_profiles
    from .resolver import library_names
    return sorted(library_names(builtin()) | lib_profiles.dists())


def _profiles():
    from ..capabilities import lib_profiles
    return lib_profiles.names() + [lib_profiles.LOCAL, lib_profiles.DEFAULT]


def _attach(values):
    def attach(action):
        action.completer = _comma(values)
        return action
    return attach


devices = _attach(_device_names)
rehearse_devices = _attach(_emulated_names)
models = _attach(_model_names)
ops = _attach(_op_names)
selections = _attach(_selections)
libraries = _attach(_libraries)
profiles = _attach(_profiles)


def autocomplete(parser) -> None:
    """Answer the shell's completion request and exit, when argcomplete is installed."""
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)
