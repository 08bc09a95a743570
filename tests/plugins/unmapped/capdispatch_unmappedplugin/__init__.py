"""A plugin backend of a served op (decode_mla) that capdispatch's SGLang knob map has no
entry for: the knob map names it and the entry to add, and the SGLang plugin still loads."""
from capdispatch.backends import TORCH, Backend


def register(registry) -> None:
    registry.add_backend(Backend("decode_mla", "plug_unmapped", "capdispatch.backends.decode_mla.reference:op_decode_mla",
                                 requires=(TORCH,), summary="the torch reference under another name"))
