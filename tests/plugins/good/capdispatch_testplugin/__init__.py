"""A test plugin: four kv_dequant backends, each broken in the way a real kernel breaks
on a card (a compile error, one wrong element in a thousand, a hang, an abort).
Declared exactly like capdispatch's own backends; no kernel code is imported here."""
from capdispatch.backends import Backend, TORCH

_K = "capdispatch_testplugin.kernels"
BROKEN = {
    "plug_fp8e4nv": "its Triton kernel reads fp8e4nv, compiled for sm_86",
    "plug_wrong": "returns one wrong element in a thousand",
    "plug_hang": "never returns",
    "plug_abort": "calls os.abort()",
}


def register(registry) -> None:
    for name, summary in BROKEN.items():
        registry.add_backend(Backend("kv_dequant", name, f"{_K}:{name[5:]}", requires=(TORCH,),
                                     summary=summary))
