"""The rehearsal's devices: where a rank decides from, and where it runs.

`cpu` and `cuda:N` decide from and run on that device. `emu:NAME@DEV` decides from the
catalog card NAME's facts (as `sim:NAME`) and runs on the real device DEV (cpu or cuda:N):
the decisions are the card's, the kernels run where DEV is, under the card's limits on a
CUDA device (emulation.py). A kernel the card chose that cannot run on DEV is replaced by
the card's next runnable preference (else DEV's own choice) for that op, and the report
marks the substitution."""
from __future__ import annotations

import attrs

from .errors import RehearseError

FORMS = "cpu, cuda:N or emu:NAME@DEV (NAME from `dispatch catalog`, DEV cpu or cuda:N)"


@attrs.frozen
class RankDevice:
    text: str          # as given
    decide: str        # what the decisions are made for: cpu, cuda:N or sim:NAME
    run: str           # where the kernels run: cpu or cuda:N

    @property
    def emulated(self) -> bool:
        return self.decide != self.run


def _real(text: str, source: str, whole: str) -> str:
    if text == "cpu":
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise RehearseError(f"{source}: bad device {whole!r}: a rank runs on cpu or cuda:N, got {text!r} "
                        f"(expected {FORMS})")


def parse(text: str, source: str = "--device") -> RankDevice:
    """One rank's device from TEXT; SOURCE names where it came from, for the error."""
    t = text.strip()
    if t.startswith("emu:"):
        name, at, dev = t[4:].partition("@")
        if not name or not at:
            raise RehearseError(f"{source}: bad device {t!r}: expected emu:NAME@DEV, e.g. emu:rtx-3080@cpu")
        from ..capabilities import catalog
        if name not in catalog.names():
            from ..policies import did_you_mean
            raise RehearseError(f"{source}: bad device {t!r}: no card {name!r} in the catalog"
                                f"{did_you_mean(name, catalog.names())} (`dispatch catalog` lists them)")
        return RankDevice(t, f"sim:{name}", _real(dev, source, t))
    if t.startswith("sim:"):
        raise RehearseError(f"{source}: {t!r} has no device to run on: use emu:{t[4:]}@cpu or "
                            f"emu:{t[4:]}@cuda:N (expected {FORMS})")
    return RankDevice(t, t, _real(t, source, t))


def parse_list(values, source: str = "--device") -> tuple:
    out = []
    for v in values:
        out.extend(parse(p, source) for p in v.split(",") if p.strip())
    if not out:
        raise RehearseError(f"{source}: no device given (expected {FORMS}, one per rank)")
    return tuple(out)
