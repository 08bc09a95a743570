"""Every benchmark the runner (`python -m benchmarks`) knows, one line each, and its suites.

A `Bench` says how to start one benchmark and which of the runner's shared options it takes;
the runner (benchmarks/runner.py) turns those into the benchmark's own flags. Adding a
benchmark is one line in BENCHMARKS (and one row in benchmarks/README.md, which a test
checks). The command is an argument list after the interpreter, with placeholders the runner
fills: {out} (the output folder), {run} (this suite run's own folder for logs and
intermediate files), {card} (the card's name in file names), {op} (for per-op entries).
"""
from __future__ import annotations

import attrs

# The shared options a benchmark may take (runner.py maps each to the benchmark's own flag).
OPTIONS = ("out", "seed", "seed-next", "graphs", "tiles", "device", "device-index", "ops", "op", "tokens",
           "decode-tokens", "sizes")


@attrs.frozen
class Bench:
    name: str
    suite: str
    command: tuple            # argv after the Python interpreter, with {placeholders}
    what: str                 # one line, for --list
    cuda: bool = True         # needs a CUDA device
    needs: tuple = ()         # importable modules; without one the benchmark is skipped, saying which
    takes: tuple = ()         # shared options it takes (OPTIONS)
    ops: tuple | None = None  # the ops it times (None: every op of the registry, or none in particular)
    per_op: bool = False      # one run per selected op ({op} in the command)
    stdout: str | None = None  # where its standard output goes, a file name in {run} (JSON runs)
    quick: tuple = ()         # extra arguments under --quick (a short run)
    limit: int = 600          # seconds before it is stopped (--timeout overrides)
    env: tuple = ()           # (NAME, VALUE) pairs set for its process

    def __attrs_post_init__(self):
        bad = sorted(set(self.takes) - set(OPTIONS))
        if bad:
            raise ValueError(f"benchmark {self.name!r} takes unknown shared options {bad} (valid: {OPTIONS})")


SUITES = {
    "host": "host-side cost of capdispatch: cold `dispatch explain`, the per-call overhead of what "
            "`bind` returns, the wrapper's own Python per call (runs without a GPU)",
    "kernels": "every op's kernels at DeepSeek-V4 shapes against ceilings measured in the same run "
               "(CUDA)",
    "serving": "the served form: SGLang's call sites routed through capdispatch, `dispatch verify` "
               "time, host time of a serving call on the GPU (CUDA)",
    "memory": "`dispatch plan`'s memory estimate against a real allocation (CUDA); the indexer "
              "reference's working set (no GPU needed)",
    "calibrate": "`dispatch bench --write-policy` op by op in the served form, a second measurement "
                 "on fresh inputs checking the written policy and the default, the regret and "
                 "speed-prediction reports (CUDA)",
    "compile": "every Triton kernel compiled offline for each architecture: registers, spills, "
               "shared memory, SASS main loops (no GPU; needs Triton)",
    "tune": "launch-configuration sweeps of the Triton kernels (CUDA; long)",
    "engine": "SGLang's own launcher with the plugin on and off on a generated checkpoint: "
              "decisions, routes, tokens, memory and TPOT against the plan (CUDA, SGLang; long)",
}

_KERNEL = ("out", "seed", "graphs", "tiles")

BENCHMARKS = (
    # host
    Bench("cli_cold", "host", ("benchmarks/bench_cli_cold.py", "--out", "{out}"),
          "cold `dispatch explain` of the mixed rig on simulated devices, fresh process per run",
          cuda=False, quick=("--runs", "3"), limit=120),
    Bench("overhead", "host", ("benchmarks/bench_overhead.py", "--out", "{out}"),
          "host time per eager call of what `bind` returns against the bare kernel, every backend "
          "that runs here", cuda=False, takes=("seed", "device", "op"),
          quick=("--iters", "5", "--repeats", "2", "--skip-torch"), limit=300),
    Bench("host_path", "host", ("benchmarks/profile_host_path.py", "--json", "{run}/host_path.json"),
          "capdispatch's own Python per call of every Triton backend, launches replaced by a recorder "
          "(Triton interpreter, CPU)", cuda=False, needs=("triton",), takes=("seed",),
          quick=("--iters", "20", "--repeats", "2", "--case", "kv_dequant/triton_u8"), limit=300),
    # kernels
    Bench("attention", "kernels", ("benchmarks/bench_attention.py",),
          "sparse_prefill and decode_mla per backend, FlashMLA and SGLang's decode as peers",
          needs=("triton",), takes=_KERNEL + ("ops", "decode-tokens"),
          ops=("sparse_prefill", "decode_mla"), quick=("--quick",), limit=400),
    Bench("moe", "kernels", ("benchmarks/bench_moe.py",),
          "routed-expert MoE per backend at DeepSeek-V4 expert shapes", needs=("triton",),
          takes=_KERNEL + ("tokens",), ops=("moe",), quick=("--tokens", "1", "64"), limit=300),
    Bench("indexer", "kernels", ("benchmarks/bench_indexer.py",),
          "the sparse indexer per backend, decode and prefill shapes", needs=("triton",),
          takes=_KERNEL, ops=("indexer",), quick=("--quick",), limit=300),
    Bench("kv_cache", "kernels", ("benchmarks/bench_kv_cache.py",),
          "kv_quant / kv_dequant per backend against the copy bandwidth, SGLang's dequant as a peer",
          needs=("triton",), takes=("out", "seed", "tiles", "tokens"), ops=("kv_quant", "kv_dequant"),
          quick=("--tokens", "262144"), limit=200),
    # serving
    Bench("verify", "serving", ("benchmarks/bench_verify.py",),
          "`dispatch verify --all` with cold then warm JIT caches: wall time per backend and card",
          takes=("out", "device", "op"), limit=600),
    Bench("overhead_gpu", "serving", ("benchmarks/bench_overhead.py", "--skip-torch", "--out", "{out}"),
          "host time per eager serving call on the card against the bare launch",
          takes=("seed", "device", "op"), quick=("--iters", "20", "--repeats", "3"), limit=300),
    Bench("profile_serving", "serving", ("benchmarks/profile_serving_gpu.py", "--out", "{out}"),
          "torch.profiler over 1-token serving calls: kernels launched, torch operators' CPU time",
          needs=("triton",), takes=("device",), limit=200),
    Bench("sglang_moe_route", "serving", ("benchmarks/bench_sglang_moe_route.py",),
          "SGLang's FusedMoE routed to a capdispatch moe backend, checked then timed",
          needs=("sglang",), takes=("out", "seed", "tokens"), ops=("moe",), limit=300,
          env=(("CAPDISPATCH_SET", "moe=triton_w4a16"),)),
    Bench("sglang_decode_route", "serving", ("benchmarks/bench_sglang_decode_route.py",),
          "SGLang's decode call site routed to the flashmla adapter against SGLang's own call",
          needs=("sglang", "flash_mla"), takes=("out", "seed", "tokens"), ops=("decode_mla",), limit=300),
    # memory
    Bench("memory", "memory", ("benchmarks/measure_memory.py",),
          "the plan's KV pools, state rings and experts allocated as SGLang does, against its estimate",
          takes=("out", "device-index"), limit=120),
    Bench("indexer_memory", "memory", ("benchmarks/bench_indexer.py", "--cpu-memory"),
          "the torch indexer reference's working set from its step plan (no GPU)", cuda=False,
          takes=("out",), ops=("indexer",), limit=120),
    # calibrate
    Bench("calibrate", "calibrate",
          ("-m", "capdispatch", "bench", "--op", "{op}", "--write-policy", "{run}/calibrated.yaml",
           "--check", "default", "--format", "json"),
          "`dispatch bench --write-policy` for one op (each run keeps the other ops' lines)",
          takes=("device", "seed", "sizes"), per_op=True, stdout="calibrate_{op}.json", limit=540),
    Bench("recheck", "calibrate",
          ("-m", "capdispatch", "bench", "--op", "{op}", "--check", "{run}/calibrated.yaml",
           "--check", "default", "--format", "json"),
          "a second measurement on fresh inputs: the regret of the written policy and the default",
          takes=("device", "seed-next", "sizes"), per_op=True, stdout="recheck_{op}.json", limit=540),
    Bench("regret", "calibrate",
          ("benchmarks/regret_report.py", "--card", "{card}", "--out", "{out}", "--label", "calibration run",
           "{run}/calibrate_*.json", "--label", "re-check", "{run}/recheck_*.json"),
          "one report of both runs: per policy the worst picked / fastest, per size every backend",
          cuda=False, limit=60),
    Bench("speed_check", "calibrate", ("benchmarks/speed_check.py", "{run}", "--out", "{out}"),
          "`dispatch plan --speed`'s predictions from the first run against the second",
          cuda=False, limit=60),
    Bench("sm_share", "calibrate", ("benchmarks/bench_sm_share.py",),
          "every runnable backend on an RTX 3080's, 3090's and 4090's SM count of this card (CUDA green "
          "contexts), the partition checked by the bf16 rate: a projection for cards not run",
          needs=("triton",), takes=("out", "seed", "ops", "sizes"), ops=("moe", "decode_mla"),
          quick=("--cards", "rtx-3080", "--sizes", "1,64"), limit=3600),
    # compile (no GPU)
    Bench("compile_matrix", "compile", ("benchmarks/compile_matrix.py", "--out", "{out}/compile_matrix.md"),
          "every Triton kernel and variant compiled for sm_80 ... sm_120a: registers, spills, shared memory",
          cuda=False, needs=("triton",), quick=("--cover", "--targets", "sm_86"), limit=1800),
    Bench("sass_bounds", "compile", ("benchmarks/sass_bounds.py", "--out", "{out}"),
          "what bounds each Triton kernel, from offline sm_90a compiles", cuda=False, needs=("triton",),
          quick=("--only", "kv"), limit=900),
    Bench("sass_moe", "compile", ("benchmarks/sass_moe_triton.py",),
          "the Triton MoE GEMMs' main-loop instruction count and mix (offline)", cuda=False,
          needs=("triton",), limit=300),
    # tune
    Bench("moe_tiles", "tune", ("benchmarks/sweep_moe_triton.py",),
          "the Triton W4A16 MoE tile space, every candidate checked, replayed from a CUDA graph",
          needs=("triton",), takes=("out", "seed", "tokens"), ops=("moe",), limit=600),
    Bench("moe_routing", "tune", ("benchmarks/sweep_moe_routing.py",),
          "the Triton MoE routing kernel's scan chunk and warps per route count, tables checked first",
          needs=("triton",), takes=("out", "seed", "tokens"), ops=("moe",), quick=("--tokens", "1", "8"), limit=300),
    Bench("attention_candidates", "tune", ("benchmarks/bench_attention_candidates.py",),
          "the attention launch-table candidates against the shipped tables and FlashMLA, served form",
          needs=("triton",), takes=("out", "seed", "decode-tokens"), ops=("sparse_prefill", "decode_mla"),
          quick=("--decode-tokens", "1", "64", "--prefill-tokens", "4096"), limit=400),
    Bench("moe_breakdown", "tune", ("benchmarks/bench_moe_breakdown.py",),
          "the Triton W4A16 MoE per launch against the ceilings, its targets, SGLang's Triton "
          "int4 MoE as a peer when SGLang imports", needs=("triton",),
          takes=("out", "seed", "tiles", "tokens"), ops=("moe",), quick=("--tokens", "1", "64"), limit=400),
    Bench("attention_tiles", "tune", ("benchmarks/bench_attention.py", "--tune"),
          "Triton attention launch configurations timed per shape", needs=("triton",),
          takes=_KERNEL + ("ops", "decode-tokens"), ops=("sparse_prefill", "decode_mla"),
          quick=("--quick",), limit=600),
    # engine
    Bench("engine_rehearsal", "engine", ("benchmarks/run_engine_rehearsal.py", "--out", "{out}"),
          "`dispatch rehearse --engine sglang` on a 4-layer full-width checkpoint it writes",
          needs=("sglang", "sgl_kernel"), quick=("--layers", "1"), limit=3600),
    # The same checkpoint (OUT/checkpoint), two more cases: the card as an RTX 3080, and one op routed;
    # both compare against the first case's plugin-off run (SGLang alone is the same launch).
    Bench("engine_emu_rtx3080", "engine", ("benchmarks/run_engine_rehearsal.py", "--out", "{out}", "--name",
                                           "engine-emu-rtx-3080", "--device", "emu:rtx-3080@cuda:0",
                                           "--off-from-case", "engine"),
          "the engine rehearsal with cuda:0 decided as an RTX 3080: the portable routes in SGLang's forward",
          needs=("sglang", "sgl_kernel"), quick=("--layers", "1"), limit=3600),
    Bench("engine_moe_triton", "engine", ("benchmarks/run_engine_rehearsal.py", "--out", "{out}", "--name",
                                          "engine-moe-triton", "--set", "moe=triton_w4a16",
                                          "--off-from-case", "engine"),
          "the engine rehearsal with the MoE alone on capdispatch's Triton W4A16 kernel",
          needs=("sglang", "sgl_kernel"), quick=("--layers", "1"), limit=3600),
)


# Scripts run by hand, not benchmarks: what each is for (benchmarks/README.md's table too).
TOOLS = {
    "probe_imports.py": "every module an import chain lacks, in one run",
    "results_dir.py": "moves older runs of benchmarks/results/ into its archive/",
}


def by_name() -> dict:
    return {b.name: b for b in BENCHMARKS}


def of_suite(suite: str) -> list:
    return [b for b in BENCHMARKS if b.suite == suite]


def scripts() -> set:
    """The benchmarks/*.py files the table starts."""
    return {a.split("/", 1)[1] for b in BENCHMARKS for a in b.command[:1] if a.startswith("benchmarks/")}
