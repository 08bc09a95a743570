"""One exit-code table for every command (capdispatch.errors.ExitCode, docs/cli.md#exit-codes):
no module defines an exit code of its own, every command's status comes from the table, `1`
means only an internal error, and the docs list the table once, as the code has it."""
import ast
import os
import re

import capdispatch as cd
from capdispatch.errors import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "capdispatch")

# Process exits that are no command's status: a planted fault that kills a rehearsal rank (its
# parent reports "died (exit 17)"), and the watcher's exit after SIGKILL to its own group.
NOT_A_STATUS = {("capdispatch/rehearse/rank.py", "os._exit(17)"),
                ("capdispatch/processes.py", "os._exit(1)")}


def _modules():
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, ROOT), ast.parse(open(path, encoding="utf-8").read(), path)


def _is_command(rel: str) -> bool:
    """Modules whose functions return a process's exit status."""
    name = os.path.basename(rel)
    return (name.endswith("_cmd.py") or name in ("cli.py", "command.py", "child.py", "rank.py")
            or rel == "capdispatch/dispatch/errors.py")


def _int(node) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _a_number(value) -> bool:
    """A returned number, or either branch of `A if C else B` one."""
    if isinstance(value, ast.IfExp):
        return _a_number(value.body) or _a_number(value.orelse)
    return _int(value)


def test_no_module_defines_an_exit_code_of_its_own():
    own = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                own += [f"{rel}:{node.lineno} {n}" for n in names if re.match(r"_?EXIT(_|$)", n)]
            if isinstance(node, ast.ClassDef) and rel != "capdispatch/errors.py" and any(
                    "Enum" in ast.unparse(b) for b in node.bases) and "exit" in node.name.lower():
                own.append(f"{rel}:{node.lineno} class {node.name}")
    assert own == []


def test_every_exit_status_comes_from_the_table():
    literal = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _int(node.args[0]):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else (
                    f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else "")
                if name in ("SystemExit", "sys.exit", "os._exit", "exit"):
                    call = f"{name}({node.args[0].value})"
                    if (rel, call) not in NOT_A_STATUS:
                        literal.append(f"{rel}:{node.lineno} {call}")
            if _is_command(rel) and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and isinstance(node.returns, ast.Name) and node.returns.id == "int":
                for r in ast.walk(node):
                    if isinstance(r, ast.Return) and r.value is not None and _a_number(r.value):
                        literal.append(f"{rel}:{r.lineno} {node.name} returns a number")
    assert literal == []


def test_the_table():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "INTERNAL": 1, "BAD_INPUT": 2, "UNSATISFIABLE": 3, "CHECK_FAILED": 4, "INTERRUPTED": 130}
    assert cd.ExitCode is ExitCode
    # A status is a number to the shell and to JSON alike.
    assert f"{ExitCode.CHECK_FAILED}" == "4" and ExitCode.OK == 0


def test_the_docs_list_the_table_once_as_the_code_has_it():
    docs = {}
    for d, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in files:
            if f.endswith(".md"):
                docs[os.path.relpath(os.path.join(d, f), ROOT)] = open(os.path.join(d, f), encoding="utf-8").read()
    tables = {p for p, text in docs.items() if re.search(r"^\| code \| name \| meaning \|$", text, re.M)}
    assert tables == {"docs/cli.md"}
    section = docs["docs/cli.md"].split("## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| \*\*(\d+)\*\* \| `(\w+)` \|", section, re.M))
    assert rows == {str(int(c)): c.name for c in ExitCode}


def test_one_means_only_an_internal_error(tmp_path, capsys):
    """A regret above the threshold is a failed check (4); a bug is 1."""
    from capdispatch.dispatch import errors

    def boom():
        raise RuntimeError("boom")
    assert errors.run_guarded("dispatch", boom) == ExitCode.INTERNAL == 1
    assert "internal error" in capsys.readouterr().err
    assert errors.exit_code(cd.BadInput("x")) == 2 and errors.exit_code(cd.Unsatisfiable("x")) == 3
