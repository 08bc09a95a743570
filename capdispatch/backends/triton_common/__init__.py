"""What the op folders' Triton kernels share: number codecs (codec.py), the V4 paged
KV-row loader (v4_rows.py), and the host-side device check (env.py).

Nothing here is imported by ``import capdispatch``: the kernel modules import it when
they are bound, and it imports triton. Kernel modules take the @triton.jit helpers
through ``env.jit_module`` (see there), never by a plain import.
"""
