"""`dispatch lock`: write today's decisions to a lock file, or compare them with one.

    dispatch lock [--device D[,D...]]... [--op OP]... [--policy FILE]... [--set OP=B]...
                  [--assume-lib NAME[==VER]]... [-o FILE]
    dispatch lock --check FILE [same options]

Writing: exit 0 (the lock goes to -o FILE, or stdout). Checking: exit 0 when today's
decisions match the lock, 3 when anything differs (one WARNING line per difference);
the devices and ops default to those of the lock. Bad input,
a malformed lock included: exit 2 with file:line.
"""
from __future__ import annotations

import os
import re
import sys

from .errors import ExitCode


def add_parser(subparsers):
    from .options import add
    p = subparsers.add_parser(
        "lock", help="write the decisions to a lock file, or compare with one",
        description="Write today's decisions per device (with the libraries' versions and canary "
                    "state) to a lock file, or compare today's decisions with one.",
        epilog="examples:\n"
               "  dispatch lock -o rig.lock                   this machine's cards\n"
               "  dispatch lock --check rig.lock              exit 3 when a decision changed\n"
               "  dispatch lock --device sim:rtx-5090,sim:rtx-3080 --op kv_quant,kv_dequant\n"
               "  dispatch lock --device sim:h200 --libs sglang-0.5.23 -o h200.lock\n")
    add(p, "device", help="the devices to lock", unset="with --check, the lock's; else every "
        "local CUDA device, else cpu")
    add(p, "op", unset="with --check, the lock's; else every op")
    add(p, "policy", "set", "assume_lib", "libs", "strict")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", metavar="FILE",
                     help="where to write the lock: a regular file, replaced atomically, or - "
                          "(default: stdout)")
    out.add_argument("--check", metavar="FILE",
                     help="compare today's decisions with FILE only: exit 0 same, 3 drift")
    add(p, "probe", "assume_cuda")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every mixed-group warning in full, not one summary line")
    return p


def _specs(args, locked=None):
    from ..capabilities import ProbeError, local_devices
    from .errors import BadInput
    from .group import unique_ids
    from .resolver import as_spec
    from .group import device_specs
    specs = device_specs(args.device, "--device", via=args.probe, assume_cuda=args.assume_cuda)
    if specs:
        return specs
    if locked is None:
        return local_devices(via=args.probe)
    # Checking: the lock's own devices; a CUDA device that is gone is a difference, not an error.
    specs = []
    for d in locked.devices:
        try:
            # A repeated card is locked as ID@N (its position); unique_ids names it so again.
            base = re.sub(r"@\d+$", "", d.id.partition("#")[0])
            specs.append(as_spec(base, via=args.probe, assume_cuda=args.assume_cuda))
        except (BadInput, ProbeError):
            if not d.id.startswith("cuda:"):
                raise
    # Every locked CUDA device gone: today's are compared with the lock (each one missing
    # is a difference).
    return unique_ids(specs) if specs else local_devices(via=args.probe)


def run(args) -> int:
    from . import lock as L
    from .errors import BadInput
    from .explain import plan
    from ..backends import builtin
    from .inputs import op_list
    for flag, value in (("--check", args.check), ("-o/--output", args.output)):
        if value is not None and not value.strip():
            raise BadInput(f"{flag}: an empty file name (give a lock file path"
                           f"{', or - for standard output' if flag != '--check' else ''})")
    if args.output and args.output != "-":
        from ..safe_io import FileError, target_of
        try:
            target_of(args.output)      # refuse a directory, FIFO or device before deciding
        except FileError as exc:
            raise BadInput(f"-o {exc.path}: {exc.reason}") from None
        from ..safe_io import shown
        parent = os.path.dirname(os.path.abspath(os.path.expanduser(args.output)))
        if not os.path.isdir(parent):       # refused before deciding, so no notice precedes it
            raise BadInput(f"-o {shown(args.output)}: its folder {shown(parent)} does not exist "
                           f"(create it, or give a path in an existing folder)")
    locked = L.load(args.check) if args.check is not None else None
    ops = op_list(args.op, "--op", builtin()) or \
        (list(dict.fromkeys(op for d in locked.devices for op in d.ops)) if locked else None)
    specs = _specs(args, locked)
    p = plan(specs, ops, policy=args.policy or None, selections=args.set_ or None,
             assume_libs=args.assume_lib, strict=args.strict, selection_origin="--set",
             libs=args.libs, log_warnings=False)
    from .notices import log_plan
    # A mixed rig diverges by design: one summary line unless -v.
    log_plan(p, brief=not args.verbose, hint="-v shows each; mixed_group: uniform in a policy runs "
                                              "one kernel everywhere")
    from .explain import whose_lines
    # Whose libraries decided, on stderr: standard output may be the lock file itself.
    for line in whose_lines(p.whose):
        print(line, file=sys.stderr)
    if locked is not None:
        drifts = L.compare(p, locked, partial=bool(args.op or args.device))
        for d in drifts:
            L.log.warning("%s", d)
        n = sum(len(d.ops) for d in locked.devices)
        from ..safe_io import shown        # the name as given: escaped, bounded
        if drifts:
            print(f"{shown(args.check)}: {len(drifts)} difference(s) from the lock", file=sys.stderr)
            return ExitCode.UNSATISFIABLE
        print(f"{shown(args.check)}: today's decisions match the lock ({len(locked.devices)} device(s), "
              f"{n} decision(s))")
        return ExitCode.OK
    lk = L.freeze(p, inputs={"policy": args.policy, "set": args.set_, "assume_lib": args.assume_lib,
                                    "libs": [p.inventory.profile.name] if p.inventory.profile else []})
    if args.output and args.output != "-":
        lk.write(args.output)
        n = sum(len(d.ops) for d in lk.devices)
        from ..safe_io import shown
        print(f"wrote {shown(args.output)}: {len(lk.devices)} device(s), {n} decision(s)", file=sys.stderr)
    else:
        sys.stdout.write(lk.dumps())
    return ExitCode.OK
