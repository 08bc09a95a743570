"""Every help line true of its command, and the docs' synopses true of the parsers.

Each command's parser is walked: every option it takes is in its synopsis (docs/cli.md, and
docs/sglang.md for `dispatch sglang plan`), and every flag a synopsis, an option's help or an
example of an epilog names is one that command takes (SGLang's own flags excepted)."""
import logging
import re

import pytest
from test_cli_options import COMMANDS, ROOT

from capdispatch.dispatch import cli, inputs

FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
# Flags of SGLang's own command line that help text names to say what ours mean.
SGLANG_FLAGS = {"--attn-dp-size", "--enable-dp-attention", "--dp-size", "--tp-size", "--model-path"}
SYNOPSES = {"docs/cli.md": "dispatch devices ", "docs/sglang.md": "dispatch sglang plan ["}


def _synopses() -> dict:
    """Command path -> the text of its synopsis, from the code block that holds each doc's
    first synopsis line."""
    out = {}
    for doc, first in SYNOPSES.items():
        text = open(f"{ROOT}/{doc}", encoding="utf-8").read()
        block = next(b for b in text.split("```")[1::2] if first in b)
        current = None
        for line in block.splitlines():
            if line.startswith("dispatch "):
                words = line.split()
                current = next((" ".join(words[:k]) for k in (3, 2) if " ".join(words[:k]) in COMMANDS),
                               None)
                if current is not None and not line.rstrip().endswith("sglang.md; `dispatch sglang --help`)"):
                    out[current] = out.get(current, "") + line[len(current):]
            elif current is not None and current in out:
                out[current] += " " + line
    return out


def _options(parser):
    return [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings]


def test_every_command_has_a_synopsis():
    assert set(_synopses()) == set(COMMANDS)


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_the_synopsis_names_every_option_of_the_command_and_no_other(path):
    text = _synopses()[path].split(" -- ")[0]       # after `--`: SGLang's arguments
    named = set(FLAG.findall(text))
    missing = [a.option_strings[-1] for a in _options(COMMANDS[path]) if not set(a.option_strings) & named]
    assert missing == [], f"{path}: the synopsis lacks {missing}"
    taken = {f for a in _options(COMMANDS[path]) for f in a.option_strings}
    assert named - taken == set(), f"{path}: the synopsis names flags the command does not take"


@pytest.mark.parametrize("path", sorted(COMMANDS))
def test_every_flag_an_option_help_names_is_one_the_command_takes(path):
    parser = COMMANDS[path]
    taken = {f for a in parser._actions for f in a.option_strings}
    wrong = [(a.option_strings[-1], f) for a in parser._actions
             for f in FLAG.findall(a.help or "") if f.startswith("--") and f not in taken | SGLANG_FLAGS]
    assert wrong == []


def test_every_example_of_an_epilog_runs_flags_its_command_takes():
    texts = [(path, p.epilog or "") for path, p in COMMANDS.items()] + [("dispatch", cli._parser().epilog)]
    wrong = []
    for where, epilog in texts:
        for line in epilog.splitlines():
            words = line.split()
            if not words or words[0] != "dispatch":
                continue
            path = next((" ".join(words[:k]) for k in (3, 2) if " ".join(words[:k]) in COMMANDS), None)
            assert path is not None, (where, line)
            example = line.strip()[len(path):].split("   ")[0].split(" -- ")[0]  # then a comment; SGLang's
            taken = {f for a in COMMANDS[path]._actions for f in a.option_strings}
            wrong += [(where, path, f) for f in FLAG.findall(example) if f not in taken]
    assert wrong == []


def test_libs_says_assume_lib_adds_to_it_only_where_the_command_takes_it():
    for path, parser in COMMANDS.items():
        libs = next((a for a in parser._actions if "--libs" in a.option_strings), None)
        if libs is None:
            continue
        takes = "--assume-lib" in parser._option_string_actions
        assert ("--assume-lib adds to it" in libs.help) == takes, path
    assert not any("--assume-lib" in a.help for a in COMMANDS["dispatch plan"]._actions if a.help)
    assert not any("--assume-lib" in a.help for a in COMMANDS["dispatch rehearse"]._actions if a.help)


@pytest.mark.parametrize("argv,prog,choices", [
    (["policy"], "dispatch", "validate, show"),
])
def test_a_missing_subcommand_is_named_as_a_command_with_its_choices(argv, prog, choices, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"{prog}: error: the following arguments are required: COMMAND ({choices}; "
                   f"`dispatch policy --help` says what each does)")
    assert "policy_cmd" not in err


def test_the_sglang_command_without_a_subcommand_says_which(capsys):
    from capdispatch.adapters.sglang import cli as sglang_cli
    assert sglang_cli.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dispatch sglang: error: the following arguments are required: COMMAND (plan;")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv,says", [
    (["explian"], "dispatch: error: COMMAND: invalid choice: 'explian'; did you mean 'explain'? (choose from"),
    (["policy", "vaildate"], "COMMAND: invalid choice: 'vaildate'; did you mean 'validate'? (choose from"),
    (["sglang", "plann"], "dispatch sglang: error: COMMAND: invalid choice: 'plann'; did you mean 'plan'?"),
    (["zzz"], "dispatch: error: COMMAND: invalid choice: 'zzz' (choose from 'devices',"),
])
def test_a_mistyped_command_is_one_line_with_a_did_you_mean(argv, says, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


# --- an unknown CAPDISPATCH_ variable --------------------------------------------------------

def test_an_unknown_variable_is_one_warning_with_a_did_you_mean_once(monkeypatch, caplog):
    monkeypatch.setattr(inputs, "_warned", set())
    env = {"CAPDISPATCH_STRCT": "1", "CAPDISPATCH_POLICIES": "x.yaml", "CAPDISPATCH_FOO": "",
           "CAPDISPATCH_SET": "", "PATH": "/bin"}
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        inputs.warn_unknown_variables(env)
        inputs.warn_unknown_variables(env)
    (rec,) = [r for r in caplog.records if "reads none of" in r.getMessage()]
    assert rec.getMessage() == (
        "capdispatch reads none of CAPDISPATCH_FOO, CAPDISPATCH_POLICIES (did you mean CAPDISPATCH_POLICY?), "
        "CAPDISPATCH_STRCT (did you mean CAPDISPATCH_STRICT?); `dispatch env` lists the variables it reads")


def test_the_variables_are_flagged_where_they_are_read(monkeypatch, caplog):
    """By every command (before it runs) and by the API's decisions, not only by `dispatch env`."""
    import capdispatch as cd
    monkeypatch.setattr(inputs, "_warned", set())
    monkeypatch.setenv("CAPDISPATCH_STRCT", "1")
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        cd.context()
    assert any("CAPDISPATCH_STRCT (did you mean CAPDISPATCH_STRICT?)" in r.getMessage() for r in caplog.records)


def test_every_command_flags_an_unknown_variable_on_one_line(run_cli):
    rc, out, err = run_cli("model", env={"CAPDISPATCH_STRCT": "1"})
    assert rc == 0
    lines = [ln for ln in err.splitlines() if "CAPDISPATCH_STRCT" in ln]
    assert lines == ["WARNING capdispatch: capdispatch reads none of CAPDISPATCH_STRCT (did you mean "
                     "CAPDISPATCH_STRICT?); `dispatch env` lists the variables it reads"]
