"""Hostile plugins: each entry point misbehaves the way a careless or broken package can
(hangs at import, exits the process, prints into the command's output, declares a
requirement that cannot be evaluated); one is fine and must still load."""
import sys

from capdispatch.backends import TORCH, Backend, TritonTarget


def chatty(registry):
    print("hello from a plugin on stdout")
    print("and on stderr", file=sys.stderr)
    registry.add_backend(Backend("kv_dequant", "plug_chatty", "capdispatch_hostileplugin:nothing",
                                 requires=(TORCH,)))


def bad_target(registry):
    registry.add_backend(Backend("kv_dequant", "plug_badtarget", "capdispatch_hostileplugin:nothing",
                                 requires=(TritonTarget("sm_90"),)))


def forged_target(registry):
    # Past the declaration's own check: the registry's evaluation must still refuse it.
    t = object.__new__(TritonTarget)
    object.__setattr__(t, "min_cc", "banana")
    registry.add_backend(Backend("kv_dequant", "plug_forgedtarget", "capdispatch_hostileplugin:nothing",
                                 requires=(t,)))


class _Sly(TritonTarget):
    def evaluate(self, f):
        raise RuntimeError("evaluated")


def sly_requirement(registry):
    registry.add_backend(Backend("kv_dequant", "plug_sly", "capdispatch_hostileplugin:nothing",
                                 requires=(_Sly("8.0"),)))


def fine(registry):
    registry.add_backend(Backend("kv_dequant", "plug_fine", "capdispatch_hostileplugin:nothing",
                                 requires=(TORCH,)))


def nothing(*args, **kwargs):
    return None
