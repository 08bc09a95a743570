"""Broken plugins: each entry point fails in its own way; none may break the built-ins."""
from capdispatch.backends import Backend, Feature, TORCH


def bad_feature(registry):
    registry.add_backend(Backend("kv_dequant", "plug_badfeature", "capdispatch_brokenplugin:nothing",
                                 requires=(TORCH, Feature("warp_drive"))))


def duplicate(registry):
    registry.add_backend(Backend("kv_dequant", "torch", "capdispatch_brokenplugin:nothing", requires=(TORCH,)))


def unknown_op(registry):
    registry.add_backend(Backend("flash_attention", "plug_fa", "capdispatch_brokenplugin:nothing", requires=()))


def raises(registry):
    raise RuntimeError("this plugin's register() is broken")


def nothing(*args, **kwargs):
    return None
