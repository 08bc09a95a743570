"""`dispatch catalog`: the GPUs and bare architectures `sim:NAME` can simulate."""
from __future__ import annotations

import json

from .errors import ExitCode


def add_parser(sub):
    from .options import add
    p = sub.add_parser("catalog", help="the GPU catalog: the names sim:NAME takes, with their facts",
                       description="The GPUs and bare architectures that sim:NAME simulates, with "
                                   "compute capability, SMs, opt-in shared memory per block and "
                                   "memory; every value has a public source (--sources).",
                       epilog="examples:\n  dispatch catalog\n  dispatch catalog --sources\n"
                              "  dispatch catalog --format json\n"
                              "  dispatch explain --device sim:rtx-pro-6000   (a name from the list)\n")
    p.add_argument("--sources", action="store_true", help="also print where each value comes from")
    add(p, "format")
    return p


def entries() -> list:
    from ..capabilities import catalog
    out = []
    for key in catalog.names():
        e = catalog.lookup(key)
        out.append({"key": key, "kind": "gpu" if e["section"] == "gpus" else "arch",
                    "name": e.get("name") or key, "aliases": [str(a) for a in e.get("aliases") or ()],
                    "cc": str(e["cc"]), "sm_count": e.get("sm_count"),
                    "smem_optin_per_block": e.get("smem_optin_per_block"), "memory": e.get("memory"),
                    "sources": dict(e.get("sources") or {})})
    return out


def _text(rows, sources: bool) -> str:
    from .render import wrap

    def smem(n):
        return f"{n // 1024} KiB" if n else "-"

    def mem(n):
        return f"{n / 2**30:.1f} GiB" if n else "-"
    from .explain import short_name
    kw = max(len(r["key"]) for r in rows)
    nw = max(len(short_name(r["name"])) for r in rows)
    lines = [f"{'NAME':<{kw}}  {'GPU':<{nw}}  {'CC':<5} {'SMs':>4}  {'SMEM':>7}  {'MEMORY':>9}"]
    for kind, title in (("gpu", None), ("arch", "bare architectures (no SM count or memory):")):
        if title:
            lines += ["", title]
        for r in (r for r in rows if r["kind"] == kind):
            lines.append(f"{r['key']:<{kw}}  {short_name(r['name']):<{nw}}  {r['cc']:<5} "
                         f"{r['sm_count'] or '-':>4}  {smem(r['smem_optin_per_block']):>7}  "
                         f"{mem(r['memory']):>9}".rstrip())
            if r["aliases"]:
                lines += wrap(f"aliases: {', '.join(r['aliases'])}", "    ", hang="    ")
            if sources:
                for field, src in r["sources"].items():
                    lines += wrap(f"{field}: {src}", "    ", hang="    ")
    lines += ["", "simulate one with --device sim:NAME; every value has a public source: --sources"]
    return "\n".join(lines)


def run(args) -> int:
    rows = entries()
    if args.format == "json":
        if not args.sources:
            rows = [{k: v for k, v in r.items() if k != "sources"} for r in rows]
        print(json.dumps({"schema": 1, "devices": rows}, indent=2))
    else:
        print(_text(rows, args.sources))
    return ExitCode.OK
