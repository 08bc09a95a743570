"""benchmarks/results/ keeps the newest run of each series at the top and older ones in
archive/, and every path the docs give into it exists."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(BENCH, "results")

sys.path.insert(0, BENCH)
try:
    import results_dir as RD
finally:
    sys.path.remove(BENCH)

# A path into the results folder: `benchmarks/results/...` from the repository root, or
# `results/...` from benchmarks/ (how benchmarks/README.md and its scripts name them).
RESULTS_PATH = re.compile(r"(?<![\w/.$-])((?:benchmarks/)?results/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
RELATIVE = re.compile(r"(?<![\w/.$-])(\.\./[\w./-]*[\w/])")
RUN_NAME = re.compile(r"(?<![\w.-])([a-z][\w-]*_\d{8}T\d{6}Z?\.(?:md|json))")


def _text_files():
    """The docs, the README, benchmarks' scripts and READMEs (the run reports and logs
    under results/ are program output, not links), and the package's comments."""
    out = [os.path.join(ROOT, "README.md")]
    for top, exts in (("docs", (".md",)), ("benchmarks", (".md", ".py", ".sh")), ("capdispatch", (".py", ".md"))):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__",)]
            in_results = os.path.commonpath([d, RESULTS]) == RESULTS
            out += [os.path.join(d, f) for f in sorted(files) if f.endswith(exts)
                    and (not in_results or f == "README.md")]
    return out


def _mentions(path):
    """(line number, mentioned path, resolved path) for each path into the results folder."""
    here = os.path.dirname(path)
    base = BENCH if os.path.commonpath([path, BENCH]) == BENCH else ROOT
    for no, line in enumerate(open(path, encoding="utf-8"), 1):
        for m in RESULTS_PATH.findall(line):
            root = ROOT if m.startswith("benchmarks/") else base
            yield no, m, os.path.normpath(os.path.join(root, m))
        targets = LINK.findall(line) if path.endswith(".md") else []
        if os.path.commonpath([path, RESULTS]) == RESULTS:
            targets += RELATIVE.findall(line)
        for t in targets:
            t = t.split("#")[0]
            if t and not re.match(r"^[a-z]+:", t) and not t.startswith(("/", "results/", "benchmarks/results/")):
                full = os.path.normpath(os.path.join(here, t))
                if os.path.commonpath([full, RESULTS]) == RESULTS:
                    yield no, t, full


def test_every_path_into_the_results_folder_exists():
    missing = []
    for f in _text_files():
        for no, m, full in _mentions(f):
            if not os.path.exists(full):
                missing.append(f"{os.path.relpath(f, ROOT)}:{no}: {m} (no {os.path.relpath(full, ROOT)})")
    assert not missing, "paths into benchmarks/results/ that do not exist:\n" + "\n".join(missing)


def test_every_run_file_named_exists_at_the_top_or_in_the_archive():
    """A run named without its folder (a comment wrapped over lines) is one of the kept runs."""
    kept = set(os.listdir(RESULTS)) | set(os.listdir(os.path.join(RESULTS, RD.ARCHIVE)))
    missing = [f"{os.path.relpath(f, ROOT)}:{no}: {name}"
               for f in _text_files() for no, line in enumerate(open(f, encoding="utf-8"), 1)
               for name in RUN_NAME.findall(line) if name not in kept]
    assert not missing, "result files named that are neither at the top nor in archive/:\n" + "\n".join(missing)


def test_the_top_level_holds_one_run_per_series_and_one_session_per_rig():
    assert RD.top_level_duplicates(RESULTS) == []


def test_the_mention_scanner_sees_what_it_checks(tmp_path):
    """The scanner resolves each form the docs use; a moved file is reported missing."""
    doc = tmp_path / "README.md"
    doc.write_text("see `results/a_x_20260101T000000.md`, [b](../b.md) and benchmarks/results/c/.\n")
    got = [m for _, m, _ in _mentions(str(doc))]
    assert "results/a_x_20260101T000000.md" in got and "benchmarks/results/c/" in got
    assert any(m.startswith("../") for f in _text_files() for _, m, _ in _mentions(f)), \
        "no session README's relative link was seen"


# --- the writers' helper, on a temporary results folder ------------------------------------

def _touch(folder, *names):
    for n in names:
        p = folder / n
        if n.endswith("/"):
            p.mkdir(parents=True)
        else:
            p.write_text(n)


def test_names_parse_into_series_and_rigs():
    assert RD.parse_run("moe_tiles_nvidia_h200_20261129T210528.md") == ("moe_tiles_nvidia_h200", "20261129T210528")
    assert RD.parse_run("cli_cold_20261201T200005Z.json") == ("cli_cold", "20261201T200005")
    assert RD.parse_run("overhead_cpu-host_20261201T201708.json") == ("overhead_cpu-host", "20261201T201708")
    assert RD.parse_run("compile_matrix.md") is None
    assert RD.parse_session("h200-2026-11-29-attention-tune") == ("h200", "2026-11-29")
    assert RD.parse_session("h200x2-2026-11-29") == ("h200x2", "2026-11-29")
    assert RD.parse_session("archive") is None


def test_archive_previous_moves_the_series_earlier_runs_only(tmp_path):
    _touch(tmp_path, "moe_gpu_20260101T000000.json", "moe_gpu_20260101T000000.md",
           "moe_tiles_gpu_20260101T000000.md", "moe_other_20260101T000000.md", "cli_cold.json")
    moved = RD.archive_previous(str(tmp_path), "moe_gpu", results=str(tmp_path))
    assert sorted(os.path.basename(p) for p in moved) == ["moe_gpu_20260101T000000.json", "moe_gpu_20260101T000000.md"]
    assert sorted(os.listdir(tmp_path / "archive")) == ["moe_gpu_20260101T000000.json", "moe_gpu_20260101T000000.md"]
    assert (tmp_path / "moe_tiles_gpu_20260101T000000.md").exists() and (tmp_path / "moe_other_20260101T000000.md").exists()
    # An untimestamped earlier run of the series goes too.
    assert [os.path.basename(p) for p in RD.archive_previous(str(tmp_path), "cli_cold", results=str(tmp_path))] == ["cli_cold.json"]


def test_archive_previous_leaves_other_folders_alone(tmp_path):
    out = tmp_path / "OUT"
    _touch(tmp_path, "OUT/", "OUT/moe_gpu_20260101T000000.md")
    assert RD.archive_previous(str(out), "moe_gpu", results=str(tmp_path)) == []
    assert (out / "moe_gpu_20260101T000000.md").exists() and not (out / "archive").exists()


def test_archive_never_overwrites(tmp_path):
    _touch(tmp_path, "archive/", "archive/moe_gpu_20260101T000000.md", "moe_gpu_20260101T000000.md")
    with pytest.raises(FileExistsError, match="never overwritten"):
        RD.archive_previous(str(tmp_path), "moe_gpu", results=str(tmp_path))


def test_tidy_keeps_the_newest_run_and_session(tmp_path):
    _touch(tmp_path, "a_gpu_20260101T000000.md", "a_gpu_20260101T000000.json", "a_gpu_20260102T000000.md",
           "a_gpu_20260102T000000.json", "a_cpu_20260101T000000.md", "compile_matrix.md",
           "h200-2026-01-01/", "h200-2026-01-01-ops/", "h200-2026-01-02/", "h200x2-2026-01-01/")
    assert len(RD.top_level_duplicates(str(tmp_path))) == 2
    RD.tidy(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["a_cpu_20260101T000000.md", "a_gpu_20260102T000000.json",
                                             "a_gpu_20260102T000000.md", "archive", "compile_matrix.md",
                                             "h200-2026-01-02", "h200x2-2026-01-01"]
    assert sorted(os.listdir(tmp_path / "archive")) == ["a_gpu_20260101T000000.json", "a_gpu_20260101T000000.md",
                                                        "h200-2026-01-01", "h200-2026-01-01-ops"]
    assert RD.top_level_duplicates(str(tmp_path)) == []


def test_a_writer_archives_its_previous_run_in_the_results_folder_only(tmp_path, monkeypatch, capsys):
    """bench_kv_cache's writer, run twice into a stand-in results folder and once elsewhere."""
    sys.path.insert(0, BENCH)
    try:
        import bench_kv_cache as KV
    finally:
        sys.path.remove(BENCH)
    results, elsewhere = tmp_path / "results", tmp_path / "OUT"
    monkeypatch.setattr(RD, "RESULTS", str(results))
    meta = dict(device="NVIDIA H200", torch="2.11", triton="3.6", cuda="13.0", compute_capability="9.0", seed=1,
                page_size=256, copy_gbps=4247.0, sglang=None)
    for day in ("01", "02"):
        KV._write(str(results), dict(meta, date=f"2026-01-{day}T00:00:00+00:00"), [])
        KV._write(str(elsewhere), dict(meta, date=f"2026-01-{day}T00:00:00+00:00"), [])
    assert sorted(os.listdir(results)) == ["archive", "kv_cache_nvidia_h200_20260102T000000.json",
                                           "kv_cache_nvidia_h200_20260102T000000.md"]
    assert sorted(os.listdir(results / "archive")) == ["kv_cache_nvidia_h200_20260101T000000.json",
                                                       "kv_cache_nvidia_h200_20260101T000000.md"]
    assert len(os.listdir(elsewhere)) == 4


WRITERS = ("bench_attention.py", "bench_attention_candidates.py", "regret_report.py", "bench_sglang_decode_route.py", "bench_cli_cold.py", "bench_indexer.py", "bench_kv_cache.py",
           "bench_moe.py", "bench_overhead.py", "bench_sglang_moe_route.py", "bench_verify.py", "sweep_moe_triton.py",
           "report.py")


@pytest.mark.parametrize("script", WRITERS)
def test_every_writer_archives_before_it_writes(script):
    src = open(os.path.join(BENCH, script), encoding="utf-8").read()
    assert "archive_previous(" in src, f"{script} writes into benchmarks/results/ without archiving the previous run"
