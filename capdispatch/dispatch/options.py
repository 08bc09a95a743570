"""The command line's options, each declared once: its flags, help, type or choices,
parse-time check and shell completion. Every command (`dispatch explain`, `dispatch bench`,
..., and adapters' commands such as `dispatch sglang plan`) adds the shared ones from here
with `add(parser, "device", "op", ...)`, so a flag means one thing, reads its value one way
and is refused with one wording wherever it appears. An option only one command takes stays
in that command's module, built with the types here.

Nothing here imports torch or probes a device: completers read declarations and the catalog
only when the shell asks.
"""
from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import sys
import textwrap
from typing import Callable, Optional
from importlib import metadata

import attrs

from ..models.sharding import MAX_RANKS
from ..safe_io import message_text
from ..version import __version__
from .inputs import DEVICE_FORMS, shown


def version() -> str:
    """capdispatch's version: the installed distribution's, else the package's own."""
    try:
        return metadata.version("capdispatch")
    except metadata.PackageNotFoundError:
        return __version__


class Parser(argparse.ArgumentParser):
    """argparse's parser with capdispatch's manners: a usage error is one line
    `COMMAND: error: ...` and exit 2; `--flag VALUE: expected ...` as a check words it
    (not `argument --flag: --flag VALUE: ...`); a one-line description is filled to the
    terminal's width and the epilogs' examples keep their lines. Subcommands' parsers
    are of the same class and name the same COMMAND in their errors."""

    def __init__(self, *a, command: Optional[str] = None, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        desc = kw.get("description")
        if desc and "\n" not in desc:
            kw["description"] = textwrap.fill(desc, 88)
        super().__init__(*a, **kw)
        self.command = command or self.prog

    def add_subparsers(self, **kw):
        kw.setdefault("parser_class", functools.partial(type(self), command=self.command))
        kw.setdefault("metavar", "COMMAND")       # not the internal dest ('policy_cmd') in errors
        return super().add_subparsers(**kw)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:      # named by the subcommand they were given to, not the top level
            self._chosen(ns).error("unrecognized arguments: " + " ".join(extras))
        return ns

    def _chosen(self, ns):
        """The deepest subcommand's parser that NS went through."""
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                name = getattr(ns, a.dest, None) if a.dest not in (None, argparse.SUPPRESS) else None
                sub = a.choices.get(name) if isinstance(name, str) else None
                if isinstance(sub, Parser):
                    return sub._chosen(ns)
        return self

    def error(self, message):
        text = _plain(message)
        if text.startswith("unrecognized arguments:"):
            text += self._did_you_mean(text.split(":", 1)[1].split())
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction) and text.startswith(
                    "the following arguments are required:") and a.metavar in text:
                text += f" ({', '.join(a.choices)}; `{self.prog} --help` says what each does)"
            if isinstance(a, argparse._SubParsersAction) and a.metavar and text.startswith(
                    f"{a.metavar}: invalid choice:"):
                text = _command_hint(text, a.choices)
        print(message_text(f"{self.command}: error: {text}"), file=sys.stderr)
        from .errors import ExitCode
        raise SystemExit(ExitCode.BAD_INPUT)

    def _did_you_mean(self, given) -> str:
        """'; did you mean --x?' for the first unknown flag close to one of this parser's,
        and where its options are listed."""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hint = ""
        for g in given:
            close = difflib.get_close_matches(g.split("=")[0], known, n=1, cutoff=0.6)
            if close:
                hint = f"; did you mean {close[0]}?"
                break
        return f"{hint} (`{self.prog} --help` lists the options)"


def _command_hint(text: str, choices) -> str:
    """"COMMAND: invalid choice: 'explian' (choose from ...)" with a did-you-mean after the
    name, when one is close."""
    m = re.match(r"([^:]+: invalid choice: '([^']*)')(.*)", text, re.S)
    if not m:
        return text
    close = difflib.get_close_matches(m.group(2), list(choices), n=1, cutoff=0.6)
    return m.group(1) + (f"; did you mean '{close[0]}'?" if close else "") + m.group(3)


def _plain(message: str) -> str:
    """argparse's 'argument --tp: --tp 0: expected ...' as '--tp 0: expected ...', and
    'argument --format: invalid choice: ...' as '--format: invalid choice: ...'."""
    m = re.match(r"argument ([^:]+): (.*)", message, re.S)
    if not m:
        return message
    flag = m.group(1).split("/")[-1]
    return m.group(2) if m.group(2).startswith(flag) else f"{flag}: {m.group(2)}"


# ------------------------------------------------------------------ parse-time checks

def refused(flag: str, value: str, valid: str) -> argparse.ArgumentTypeError:
    """The one wording of a refused option value: '--tp 0: expected an integer >= 1' (a
    long or unprintable value quoted and cut)."""
    if not (value.isprintable() and not any(c.isspace() for c in value) and 0 < len(value) <= 40):
        value = shown(value, 40)
    return argparse.ArgumentTypeError(f"{flag} {value}: expected {valid}")


# Query tokens per request per decode step: one real token plus drafts (SGLang's MTP and
# EAGLE draft a handful).
MAX_NEXT_N = 64


def whole(low: int = 1, high: Optional[int] = None) -> Callable:
    """A type for a whole number >= LOW (and <= HIGH). `add` gives it the flag first
    (flag_aware), so that its error names the flag as every other check does."""
    need = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(flag: str, text: str) -> int:
        if len(text) > 40:
            raise refused(flag, text[:20] + "...", need)
        try:
            value = int(text, 10)
        except ValueError:
            raise refused(flag, text, need) from None
        if value < low or (high is not None and value > high):
            raise refused(flag, text, need)
        return value
    parse.flag_aware = True
    return parse


def number(need: str, low: float, high: Optional[float] = None, *, above: bool = False,
           below: bool = False) -> Callable:
    """A type for a finite number from LOW (more than LOW with ABOVE) to HIGH (less than
    HIGH with BELOW), refused as NEED says it ('a time in ms from 0 to 60000'); flag-aware
    like `whole`."""
    def parse(flag: str, text: str) -> float:
        if len(text) > 40:
            raise refused(flag, text[:20] + "...", need)
        try:
            value = float(text)
        except ValueError:
            raise refused(flag, text, need) from None
        if not (math.isfinite(value) and (value > low if above else value >= low)
                and (high is None or (value < high if below else value <= high))):
            raise refused(flag, text, need)
        return value
    parse.flag_aware = True
    return parse


def flagged(flag: str, type_: Callable) -> Callable:
    """TYPE_ (a flag-aware type: `whole`, `number`) for an option a command declares itself,
    so that its error names FLAG."""
    return functools.partial(type_, flag)


# ------------------------------------------------------------------ the declarations

@attrs.frozen
class Option:
    """One option as every command takes it. HELP says what it is; UNSET what happens
    without it (shown as '(default: ...)'), which a command may word for itself where its
    default differs."""
    flags: tuple
    help: str
    unset: Optional[str] = None
    metavar: Optional[str] = None
    dest: Optional[str] = None
    repeat: bool = False             # repeatable (and commas), collected in a list
    switch: bool = False             # store_true
    type: Optional[Callable] = None
    choices: Optional[tuple] = None
    default: object = None
    complete: Optional[str] = None   # a completer of capdispatch.dispatch.completion
    # Help true only beside another flag: (flag, clause of the help, phrase of the unset text),
    # each kept where the command takes that flag and dropped where it does not.
    beside: tuple = ()

    @property
    def flag(self) -> str:
        return self.flags[-1]


OPTIONS = {o.flag.lstrip("-").replace("-", "_"): o for o in (
    Option(("--format",), "text for people (default) or JSON for programs",
           choices=("text", "json"), default="text"),
    Option(("--device",), f"{DEVICE_FORMS}; repeat the flag or use commas",
           unset="every local CUDA device, else cpu",
           metavar="DEV[,DEV...]", repeat=True, complete="devices"),
    Option(("--op",), "only these ops; repeat the flag or use commas; `dispatch ops` lists them",
           unset="every op", metavar="OP[,OP...]", repeat=True, complete="ops"),
    Option(("--policy",), "a policy file, layered above the built-in default and "
           "$CAPDISPATCH_POLICY; repeat for more (later wins)", metavar="FILE", repeat=True),
    Option(("--set",), "an explicit choice, above every policy (commas for several)",
           metavar="OP=BACKEND", dest="set_", repeat=True, complete="selections"),
    Option(("--assume-lib",), "treat a library as installed on the target (at VERSION), e.g. "
           "triton or flashinfer-python==0.7.2; an unknown name is refused",
           metavar="NAME[==VERSION]", repeat=True, complete="libraries"),
    Option(("--libs",), "the target's whole library inventory from a profile (e.g. "
           "sglang-0.5.23: the versions SGLang 0.5.23 installs) instead of this machine's; "
           "`local`: this machine's",
           beside=(("--assume-lib", "; --assume-lib adds to it", " and no --assume-lib is given"),),
           unset="the default profile when every device is simulated and no --assume-lib is "
                 "given, else this machine's", metavar="PROFILE", complete="profiles"),
    Option(("--strict",), "an explicit choice that cannot run is an error (exit 3), not a "
           "downgrade", switch=True),
    Option(("--probe",), "how to read a cuda:N device (auto: NVML unless CUDA is already "
           "initialised; nvml / torch: only that way, exit 2 if it cannot)",
           choices=("auto", "torch", "nvml"), default="auto"),
    Option(("--assume-cuda",), "CUDA toolkit version to assume for simulated devices, e.g. 12.8",
           metavar="VER"),
    Option(("--lock",), "compare the decisions with this lock file", unset="$CAPDISPATCH_LOCK",
           metavar="FILE"),
    Option(("--brief",), "print only {what}", switch=True),
    # A model and its layout: each rank's shapes are checked against the kernels' shape ranges.
    Option(("--model",), "a built-in model (`dispatch model` lists them) or a Hugging Face "
           "config.json, or the folder holding it", metavar="NAME|PATH", complete="models"),
    Option(("--tp",), "tensor-parallel ranks, as SGLang's --tp (at most 4096)", unset="1", metavar="N",
           type=whole(1, MAX_RANKS), default=1),
    Option(("--ep",), "expert-parallel ranks, as SGLang's --ep; must divide --tp", unset="1",
           metavar="N", type=whole(1, MAX_RANKS), default=1),
    Option(("--dp-attention",), "attention data parallel over all --tp ranks (SGLang's "
           "--attn-dp-size equal to --tp, formerly --enable-dp-attention --dp-size N): every "
           "rank keeps all heads", switch=True),
    Option(("--next-n",), "query tokens per request per decode step",
           unset="1 + the model's MTP layers: one real token plus one draft per MTP layer",
           metavar="N", type=whole(1, MAX_NEXT_N)),
)}

LAYOUT = ("model", "tp", "ep", "dp_attention", "next_n")


def check_layout(args, keys=LAYOUT[1:]) -> None:
    """Refuse layout options (KEYS, as parsed into ARGS) given without --model: a layout
    is of a model. An option at its declared default counts as not given."""
    from .errors import BadInput
    if getattr(args, "model", None) is not None:
        return
    if any(getattr(args, OPTIONS[k].dest or k) not in (None, False if OPTIONS[k].switch else OPTIONS[k].default)
           for k in keys):
        flags = "/".join(OPTIONS[k].flag for k in keys)
        raise BadInput(f"{flags} describe a model's layout: give --model NAME|PATH with them "
                       "(`dispatch model` lists the built-ins)")


def add(parser, *keys: str, unset: Optional[str] = None, help: Optional[str] = None,
        default=attrs.NOTHING, required: bool = False, repeat: Optional[bool] = None):
    """Add the shared options KEYS (keys of OPTIONS: 'device', 'op', 'assume_lib', ...) to
    PARSER (a parser or an argument group); returns the last action. With one key, the
    command may say what the option's absence means to it (UNSET), give another DEFAULT,
    make it REQUIRED, take one value instead of a list (REPEAT=False), or add to its HELP
    what it means in this command (HELP leads the shared text, or fills its {what})."""
    changed = unset is not None or help is not None or default is not attrs.NOTHING or required \
        or repeat is not None
    if changed and len(keys) != 1:
        raise TypeError("options.add: per-command changes apply to one option at a time")
    action = None
    for key in keys:
        o = OPTIONS[key]
        if "{what}" in o.help:
            text = o.help.format(what=help or "the summary")
        else:
            text = f"{help}: {o.help}" if help else o.help
        gone = o.unset if unset is None else unset
        if gone and not required:
            text += f" (default: {gone})"
        kw = {"help": text}
        many = o.repeat if repeat is None else repeat
        if o.switch:
            kw["action"] = "store_true"
        else:
            kw["metavar"] = o.metavar if many or not o.metavar else o.metavar.split("[")[0]
            if o.choices:
                kw["choices"] = o.choices
            if o.type is not None:
                kw["type"] = functools.partial(o.type, o.flag) if getattr(o.type, "flag_aware", False) \
                    else o.type
            if many:
                kw["action"] = "append"
            kw["default"] = ([] if many else o.default) if default is attrs.NOTHING else default
        if o.dest:
            kw["dest"] = o.dest
        if required:
            kw["required"] = True
        action = parser.add_argument(*o.flags, **kw)
        action.option = key          # which shared option it is (tests check every command's)
        action.plain_help = text
        if o.complete:
            from . import completion
            getattr(completion, o.complete)(action)
    _beside(parser)
    return action


def _beside(parser) -> None:
    """Give each shared option the clauses of its help that name a flag the command takes
    (whichever was added first): `--libs` says `--assume-lib adds to it` only beside it."""
    have = parser._option_string_actions
    for a in parser._actions:
        o = OPTIONS.get(getattr(a, "option", None) or "")
        if o is not None and o.beside:
            base, sep, unset = a.plain_help.partition(" (default: ")
            for flag, clause, phrase in o.beside:
                if flag in have:
                    base += clause
                else:
                    unset = unset.replace(phrase, "")
            a.help = base + sep + unset
