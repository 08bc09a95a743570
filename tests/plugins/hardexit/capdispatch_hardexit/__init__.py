"""Plugins that end the process without Python's cleanup, at import or in register()."""


def register(registry):
    import os
    os.abort()


def fine(registry):
    from capdispatch.backends import TORCH, Backend
    registry.add_backend(Backend("kv_dequant", "plug_after_exit", "capdispatch_hardexit.nothing:kv_dequant",
                                 requires=(TORCH,), summary="loads after the plugins that exit"))


child_status = None


def forks(registry):
    """A child forked while loading exits as it asks (its status reaches the parent)."""
    import os
    global child_status
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    child_status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
