"""One set of options for every command, one error handler for every command, one
wording of a failed check.

Every flag the shared set declares (capdispatch/dispatch/options.py) is added from it by
every command that takes it, `dispatch sglang plan` included; every command, given one bad
input, answers with one line and exit 2 (or 3 for an unsatisfiable choice), never a
traceback; the wording of a failed requirement check lives in one place."""
import argparse
import os
import re

import pytest

from capdispatch.adapters.sglang import cli as sglang_cli
from capdispatch.dispatch import cli, options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = {o.flag: key for key, o in options.OPTIONS.items()}
# Same flag, another option: where the ranks run (cpu, cuda:N, emu:NAME@DEV), not devices to decide for.
OWN = {("dispatch rehearse", "--device")}


def _commands(parser, path):
    """(path, parser) of every command that runs: the leaves of the subcommand tree."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for a in subs:
        for name, sp in a.choices.items():
            if path == "dispatch" and name in cli.EXTENSIONS:
                continue       # an extension's commands: from its own parser, below
            yield from _commands(sp, f"{path} {name}")


def _all_commands():
    yield from _commands(cli._parser(), "dispatch")
    yield from _commands(sglang_cli._parser(), "dispatch sglang")


COMMANDS = dict(_all_commands())


def test_every_shared_flag_is_added_from_the_one_declaration():
    hand_made, seen = [], {}
    for path, parser in COMMANDS.items():
        for a in parser._actions:
            for flag in a.option_strings:
                if flag in SHARED and (path, flag) not in OWN:
                    if getattr(a, "option", None) != SHARED[flag]:
                        hand_made.append(f"{path} {flag}")
                    seen.setdefault(flag, set()).add(path)
    assert hand_made == []
    # The set is shared: every option in it is taken by two commands or more.
    assert {f for f, paths in seen.items() if len(paths) < 2} == set()
    assert set(seen) == set(SHARED)


def test_a_shared_option_reads_its_value_one_way_everywhere():
    """Same type, choices and completer in every command; the help is the shared text."""
    for path, parser in COMMANDS.items():
        for a in parser._actions:
            key = getattr(a, "option", None)
            if key is None:
                continue
            o = options.OPTIONS[key]
            assert a.choices == (list(o.choices) if o.choices and not isinstance(a.choices, tuple)
                                 else o.choices), (path, key)
            assert (a.type is None) == (o.type is None), (path, key)
            assert o.help.split("{what}")[0] in a.help, (path, key)
            assert hasattr(a, "completer") == bool(o.complete), (path, key)


@pytest.mark.parametrize("path", sorted(p for p, parser in COMMANDS.items()
                                        if any(getattr(a, "option", None) == "tp" for a in parser._actions)))
def test_a_whole_number_is_refused_when_parsed_with_one_wording(path, capsys):
    argv = path.split()[1:] + ["--tp", "0"]
    main = sglang_cli.main if argv[0] == "sglang" else cli.main
    rc = main(argv[1:] if argv[0] == "sglang" else argv)
    err = capsys.readouterr().err
    prog = "dispatch sglang" if argv[0] == "sglang" else "dispatch"
    assert rc == 2 and err.splitlines()[-1] == f"{prog}: error: --tp 0: expected an integer from 1 to 4096", err


# One bad input per command: exit 2 (3: unsatisfiable), one line, no traceback.
BAD = {
    "dispatch devices": (["--device", "sim:rtx-9999"], 2, "--device: unknown simulated device"),
    "dispatch explain": (["--device", "sim:rtx-3080", "--set", "kv_dequant=triton_fp8", "--strict"], 3,
                         "dispatch: unsatisfiable: strict: sim:rtx-3080"),
    "dispatch ops": (["--format", "xml"], 2, "--format: invalid choice: 'xml'"),
    "dispatch catalog": (["--format", "yaml"], 2, "--format: invalid choice: 'yaml'"),
    "dispatch env": (["--format", "xml"], 2, "--format: invalid choice: 'xml'"),
    "dispatch model": (["no-such-model"], 2, "model 'no-such-model' is neither a built-in"),
    "dispatch checkpoint": (["--model", "no-such-model", "--layers", "2", "--out", "no-such-dir"], 2,
                            "model 'no-such-model' is neither a built-in"),
    "dispatch plan": (["--model", "deepseek-v4-flash", "--device", "sim:rtx-9999"], 2,
                      "--device: unknown simulated device"),
    "dispatch lock": (["--device", "sim:h200", "--op", "kv_qaunt"], 2, "did you mean 'kv_quant'"),
    "dispatch verify": (["--device", "cpu", "--op", "kv_qaunt"], 2, "did you mean 'kv_quant'"),
    "dispatch bench": (["--device", "cpu", "--op", "kv_qaunt"], 2, "did you mean 'kv_quant'"),
    "dispatch rehearse": (["--device", "cpu", "--model", "no-such-model"], 2, "'no-such-model'"),
    "dispatch policy validate": (["no-such-policy.yaml"], 2, "no-such-policy.yaml: cannot read"),
    "dispatch policy show": (["--policy", "no-such-policy.yaml"], 2, "no-such-policy.yaml: cannot read"),
    "dispatch sglang plan": (["--device", "sim:rtx-3080", "--set", "kv_dequant=triton_fp9"], 2,
                             "dispatch sglang: error: "),
}


def test_every_command_has_a_bad_input_case():
    assert set(BAD) == set(COMMANDS)


@pytest.mark.parametrize("path", sorted(BAD))
def test_every_command_answers_bad_input_with_one_line_and_its_exit_code(path, run_cli):
    args, code, needle = BAD[path]
    rc, out, err = run_cli(*path.split()[1:], *args, env={"CAPDISPATCH_DEBUG": ""})
    assert rc == code, (path, err)
    assert "Traceback" not in err and needle in err, (path, err)
    last = err.strip().splitlines()[-1]
    prog = "dispatch sglang" if path.startswith("dispatch sglang") else "dispatch"
    assert re.match(rf"{prog}: (error|unsatisfiable): ", last), last


def test_the_wording_of_a_failed_check_lives_in_one_place():
    """'need X, found Y' (and the retired 'needs {ch.need}, has ...') is written only by
    backends.base.need_found; a requirement's own sentence (Check.message) is its own."""
    pattern = re.compile(r"""need \{[^}]+\}, found \{|needs \{\w+\.need\}, has \{\w+\.found\}""")
    writers = []
    for base, _, files in os.walk(os.path.join(ROOT, "capdispatch")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if pattern.search(line):
                        writers.append(f"{os.path.relpath(path, ROOT)}:{n}")
    assert len(writers) == 1 and writers[0].startswith("capdispatch/backends/base.py:"), writers


def test_an_error_a_warning_and_a_trace_word_a_failed_check_alike(capsys):
    import capdispatch as cd
    res = cd.resolve("kv_dequant", "sim:rtx-3080", selections={"kv_dequant": "triton_fp8"})
    first = res.candidates[0]
    failed = [ch for ch in first.checks if not ch.ok]
    assert failed and first.why_not() == "; ".join(ch.reason for ch in failed)
    assert first.why_not(exact=True) == "; ".join(f"{ch.code}: need {ch.need}, found {ch.found}" for ch in failed)
    assert first.why_not() in res.warnings[0]
    assert cli.main(["explain", "--device", "sim:rtx-3080", "--op", "kv_dequant"]) == 0
    trace = capsys.readouterr().out
    assert all(ch.wording in trace.replace("\n          ", " ") for ch in failed)


def test_the_sglang_command_runs_under_the_one_handler(monkeypatch, capsys):
    """A bug inside `dispatch sglang plan` is one line naming it (exit 1), as in every
    other command, and a usage error returns 2 instead of raising SystemExit."""
    from capdispatch.adapters.sglang import plan

    def broken(**_):
        raise RuntimeError("boom")
    monkeypatch.delenv("CAPDISPATCH_DEBUG", raising=False)
    monkeypatch.setattr(plan, "build", broken)
    assert sglang_cli.main(["plan", "--device", "sim:rtx-3080"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dispatch sglang: internal error: RuntimeError: boom") and "Traceback" not in err
    assert sglang_cli.main(["plan", "--frobnicate"]) == 2


def test_commands_import_one_way():
    """cli.py imports the command modules; none of them (nor options.py or command.py)
    imports cli.py back, by name or through importlib."""
    here = os.path.join(ROOT, "capdispatch", "dispatch")
    back = re.compile(r"from \.cli import|from \. import cli\b|import_module\([^)]*cli|dispatch\.cli\b")
    modules = [f for f in os.listdir(here) if f.endswith("_cmd.py")] + ["options.py", "command.py"]
    assert len(modules) >= 10
    bad = [f for f in modules if back.search(open(os.path.join(here, f), encoding="utf-8").read())]
    assert bad == []
