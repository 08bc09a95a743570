"""The benchmark runner (`python -m benchmarks`): its table of benchmarks, the shared options
in each benchmark's own flags, the report it writes, its errors; and benchmarks/README.md's
table, which names every file of benchmarks/."""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _bench_module(name):
    """A module of benchmarks/, imported as the runner imports it (its folder on the path)."""
    import importlib
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)


def _suites():
    return _bench_module("suites")


def runner(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_table_starts_scripts_that_exist_with_ops_that_are_registered():
    from capdispatch import extend
    S = _suites()
    names = [b.name for b in S.BENCHMARKS]
    assert len(names) == len(set(names))
    ops = set(extend.registry.builtin().ops)
    for b in S.BENCHMARKS:
        assert b.suite in S.SUITES, b.name
        first = b.command[0]
        if first == "-m":
            assert b.command[1] == "capdispatch", b.name
        else:
            assert os.path.isfile(os.path.join(ROOT, first)), f"{b.name}: {first} does not exist"
        assert b.ops is None or set(b.ops) <= ops, f"{b.name}: {b.ops} not all registered ({sorted(ops)})"
        assert not (b.per_op and "{op}" not in " ".join(b.command)), b.name
    assert all(S.of_suite(s) for s in S.SUITES), "a suite without benchmarks"
    with pytest.raises(ValueError, match="unknown shared options"):
        S.Bench("x", "host", ("benchmarks/x.py",), "x", takes=("nonsense",))


def test_every_runnable_script_is_reachable_through_the_runner_or_a_named_tool():
    S = _suites()
    started = S.scripts()
    for path in sorted(glob.glob(os.path.join(BENCH, "*.py"))):
        name = os.path.basename(path)
        src = open(path, encoding="utf-8").read()
        if '__name__ == "__main__"' in src and name != "__main__.py":
            assert name in started or name in S.TOOLS, (
                f"benchmarks/{name} runs as a script but no line of suites.BENCHMARKS starts it "
                "(add one, or name it in suites.TOOLS if it is a tool run by hand)")


def test_the_readme_table_names_every_file_of_benchmarks():
    text = open(os.path.join(BENCH, "README.md"), encoding="utf-8").read()
    first_cells = [row.split("|")[1] for row in text.splitlines() if row.startswith("| `")]
    named = {n for cell in first_cells for n in re.findall(r"`([\w.]+\.(?:py|sh))`", cell)}
    files = {os.path.basename(p) for ext in ("py", "sh") for p in glob.glob(os.path.join(BENCH, f"*.{ext}"))}
    assert files - named == set(), f"benchmarks/README.md's table lacks a row for {sorted(files - named)}"
    assert named - files == set(), f"benchmarks/README.md's table names files that are gone: {sorted(named - files)}"
    # and each benchmark of the table is named where its script's row says which suite runs it
    S = _suites()
    for b in S.BENCHMARKS:
        assert f"`{b.name}`" in text, f"benchmarks/README.md does not name the runner's benchmark {b.name!r}"


def test_shared_options_reach_each_benchmark_in_its_own_flags():
    r = runner("--suite", "kernels", "--dry-run", "--tiles", "both", "--ops", "moe,kv_quant",
               "--sizes", "1,8", "--seed", "5", "--out", "OUTDIR")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    moe = [x for x in lines if x.startswith("moe")]
    assert len(moe) == 2
    assert all("--graphs" in x and "--tokens 1 8" in x and "--seed 5" in x for x in moe)
    assert {re.search(r"--tiles (\S+)", x)[1] for x in moe} == {"card", "99kb"}
    assert not any("--graphs" in x for x in lines if x.startswith("kv_cache"))   # it has no graph mode
    assert "attention: skipped (measures sparse_prefill, decode_mla, none of --ops)" in lines


def test_the_calibrate_suite_runs_every_registered_op():
    from capdispatch import extend
    r = runner("--suite", "calibrate", "--dry-run", "--out", "OUTDIR")
    assert r.returncode == 0, r.stderr
    ops = [m[1] for m in re.finditer(r"^calibrate (\w+): .*--write-policy", r.stdout, re.M)]
    assert ops == list(extend.registry.builtin().ops)
    assert re.search(r"^recheck moe: .*--seed 1\b", r.stdout, re.M)


@pytest.mark.parametrize("args, code, words", [
    (("--suite", "kernels", "--device", "cpu"), 3, "need a CUDA device"),
    (("--suite", "host", "--ops", "kv_deq"), 2, "did you mean 'kv_dequant'"),
    (("--suite", "host", "--only", "attention"), 2, "none of these is in suite host"),
    (("--suite", "host", "--only", "atention"), 2, "did you mean 'attention'"),
    (("--suite", "kernels", "--sizes", "1,0"), 2, "'0' is not a positive integer"),
    (("--suite", "host", "--device", "gpu0"), 2, "valid: cuda:N or cpu"),
    (("--out", "x"), 2, "--suite: none given"),
])
def test_bad_input_is_one_line_and_an_exit_code(tmp_path, args, code, words):
    r = runner(*args[:-1], args[-1], "--out", str(tmp_path / "o")) if "--out" not in args else runner(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()


def test_help_of_the_runner_and_of_the_gpu_script():
    r = runner("--help")
    assert r.returncode == 0 and "--suite" in r.stdout and "calibrate" in r.stdout
    g = subprocess.run(["bash", os.path.join(BENCH, "gpu_run.sh"), "--help"], capture_output=True, text=True)
    assert g.returncode == 0 and "--wheels DIR" in g.stdout and "pytest" not in g.stderr
    bad = subprocess.run(["bash", os.path.join(BENCH, "gpu_run.sh"), "out", "--frobnicate"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("gpu_run.sh: unknown option --frobnicate")


def test_the_host_suite_writes_its_report(tmp_path):
    """The host suite's two quick benchmarks on the CPU: one report pair named by suite, card and
    time, with the environment, every benchmark's row and the files each wrote."""
    out = tmp_path / "out"
    r = runner("--suite", "host", "--only", "cli_cold,host_path", "--quick", "--device", "cpu",
               "--out", str(out), timeout=600)
    reports = sorted(p.name for p in out.iterdir() if p.is_file() and p.name.startswith("host_"))
    assert len(reports) == 2, (sorted(os.listdir(out)), r.stdout, r.stderr)
    stem = reports[0].rsplit(".", 1)[0]
    assert re.fullmatch(r"host_cpu-host_\d{8}T\d{6}", stem) and reports == [stem + ".json", stem + ".md"]
    data = json.loads((out / f"{stem}.json").read_text())
    env = data["environment"]
    import torch
    assert env["torch"] == torch.__version__ and env["card"] is None and re.match(r"\d{4}-\d\d-\d\dT", env["date"])
    assert {"driver", "cuda", "triton", "capdispatch", "python"} <= set(env)
    rows = {row["benchmark"]: row for row in data["benchmarks"]}
    assert set(rows) == {"cli_cold", "host_path"}
    hp = rows["host_path"]
    assert hp["status"] == "ok", hp
    (written,) = hp["files"]
    assert written.endswith("host_path.json") and os.path.isfile(written) and json.loads(open(written).read())
    cc = rows["cli_cold"]
    # cli_cold exits 1 when its median misses the 0.5 s target on a loaded machine: it measured.
    assert cc["exit"] in (0, 1) and any(re.search(r"cli_cold_\d{8}T\d{6}Z\.json$", f) for f in cc["files"])
    assert r.returncode == (0 if cc["exit"] == 0 else 1), r.stderr
    assert os.path.isfile(os.path.join(data["run_folder"], "host_path.log"))
    md = (out / f"{stem}.md").read_text()
    assert md.startswith("# Suite `host` on the host (no GPU)") and f"| torch | {torch.__version__} |" in md
    assert "| host_path | ok |" in md


def test_bench_overhead_takes_its_ops_from_the_registry():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_overhead.py"), "--op", "nosuch", "--out", "x"],
                       capture_output=True, text=True, env=env, timeout=120)
    from capdispatch import extend
    assert r.returncode == 2 and f"(valid: {', '.join(extend.registry.builtin().ops)})" in r.stderr


def test_a_benchmark_over_its_limit_is_stopped_and_reported(tmp_path):
    out = tmp_path / "out"
    r = runner("--suite", "host", "--only", "cli_cold", "--timeout", "1", "--device", "cpu", "--out", str(out))
    assert r.returncode == 1, r.stderr
    (js,) = out.glob("host_cpu-host_*.json")
    (row,) = json.loads(js.read_text())["benchmarks"]
    assert row["status"] == "timeout" and row["exit"] is None and row["seconds"] < 30
    assert "| cli_cold | timeout |" in js.with_suffix(".md").read_text()


def test_the_gpu_script_stops_in_one_line_without_a_cuda_device(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the script would run the suites")
    script = os.path.join(BENCH, "gpu_run.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", script, str(tmp_path / "out"), "--no-install", "--suite", "kernels"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 3 and r.stderr.strip().startswith("gpu_run.sh: torch ") and "sees no CUDA device" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    w = subprocess.run(["bash", script, str(tmp_path / "out"), "--wheels", str(tmp_path / "none")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert w.returncode == 2 and "--wheels" in w.stderr and "no such folder" in w.stderr


def test_the_engine_cases_share_one_checkpoint_and_name_their_folders(monkeypatch, tmp_path):
    m = _bench_module("run_engine_rehearsal")
    from capdispatch.adapters.sglang import versions
    monkeypatch.setattr(versions, "installed", lambda: "0.5.17")
    a = m._args(["--out", str(tmp_path), "--name", "engine-moe-triton", "--set", "moe=triton_w4a16"])
    assert a.name == "engine-moe-triton" and a.selections == "moe=triton_w4a16"
    assert a.sglang == m.DEFAULT_SGLANG + ("--fp8-gemm-backend", "triton")
    assert ("--moe-runner-backend", "marlin") == a.sglang[6:8]
    monkeypatch.setattr(versions, "installed", lambda: "0.5.23")
    assert m._args(["--out", str(tmp_path)]).sglang == m.DEFAULT_SGLANG
    assert m._args(["--out", str(tmp_path), "--", "--tp", "1"]).sglang == ("--tp", "1")
    with pytest.raises(SystemExit):
        m._args(["--out", str(tmp_path), "--name", "../x"])
    # The suite's cases: one checkpoint folder (OUT/checkpoint), three rehearsal folders.
    engine = [b for b in _suites().BENCHMARKS if b.suite == "engine"]
    names = [b.command[b.command.index("--name") + 1] if "--name" in b.command else "engine" for b in engine]
    assert names == ["engine", "engine-emu-rtx-3080", "engine-moe-triton"]
    assert not any("--checkpoint" in b.command for b in engine)
    # The later cases compare against the first case's plugin-off run, where it answered.
    assert [b.command[b.command.index("--off-from-case") + 1] for b in engine[1:]] == ["engine", "engine"]
    assert "--off-from-case" not in engine[0].command
    with pytest.raises(SystemExit):
        m._args(["--out", str(tmp_path), "--name", "engine", "--off-from-case", "engine"])
    assert m.kept_off(str(tmp_path), "engine") is None                      # no first case yet
    (tmp_path / "engine").mkdir()
    kept = tmp_path / "engine" / "engine-rehearsal.json"
    kept.write_text(json.dumps({"off": {"ok": False}}))
    assert m.kept_off(str(tmp_path), "engine") is None                      # its plugin-off run failed
    kept.write_text(json.dumps({"off": {"ok": True}}))
    assert m.kept_off(str(tmp_path), "engine") == str(kept)
