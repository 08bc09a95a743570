#!/usr/bin/env bash
# Run capdispatch's GPU tests and benchmark suites on a CUDA machine, results into one folder.
#
#   bash benchmarks/gpu_run.sh OUT_DIR [options] [-- runner options]
#
# Options:
#   --suite SUITE    a suite of `python -m benchmarks` (repeatable; default: kernels;
#                    `none` runs the tests only)
#   --venv DIR       create a virtual environment there (or reuse it) and install into it;
#                    without it, the current Python ($PYTHON, else python3) is used
#   --wheels DIR     install from this folder of wheels only, no package index (air-gapped
#                    machines; benchmarks/README.md says what it must hold)
#   --extras LIST    capdispatch extras to install besides `test` (comma list: flashinfer,
#                    tilelang, nvml, sglang)
#   --also REQ       one more package to install (repeatable), e.g. --also sgl-flash-mla==1.0.0
#   --pip-args ARGS  more pip arguments (e.g. "--extra-index-url https://download.pytorch.org/whl/cu128")
#   --no-install     install nothing: the environment has what the suites need (PYTHONPATH,
#                    e.g. a `pip install --target` folder, is kept after the repository)
#   --no-tests       skip the GPU tests
#   --tests PATHS    the tests to run (default: tests/), marked `gpu`
#   --jobs N         test processes at once (needs pytest-xdist; default 4)
# Everything after `--` goes to the runner (python -m benchmarks --help): --device, --ops,
# --sizes, --tiles, --graphs/--no-graphs, --seed, --quick, --only, --timeout, --args.
#
# Writes into OUT_DIR: install.log, gpu_tests.txt and gpu_tests.xml (JUnit), and per suite
# its report <suite>_<card>_<UTC time>.json/.md with the benchmarks' own files beside it.
# Exit status: 0 all passed; 1 a test or benchmark failed; 2 bad arguments; 3 no CUDA device.
set -u
usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_run.sh: $1" >&2; exit "${2:-2}"; }

[ $# -ge 1 ] || { usage >&2; exit 2; }
case $1 in -h|--help) usage; exit 0 ;; -*) die "the first argument is the output folder, not $1 (usage: bash $0 OUT_DIR [options])" ;; esac
OUT_DIR=$1; shift
suites=(); also=(); venv=""; wheels=""; extras=""; pip_args=""; install=1; tests=1; test_paths="tests/"; jobs=4
while [ $# -gt 0 ]; do
  case $1 in
    --suite) [ $# -ge 2 ] || die "--suite needs a value"; suites+=("$2"); shift 2 ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a folder"; venv=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; wheels=$2; shift 2 ;;
    --extras) [ $# -ge 2 ] || die "--extras needs a list"; extras=$2; shift 2 ;;
    --also) [ $# -ge 2 ] || die "--also needs a requirement"; also+=("$2"); shift 2 ;;
    --pip-args) [ $# -ge 2 ] || die "--pip-args needs a value"; pip_args=$2; shift 2 ;;
    --no-install) install=0; shift ;;
    --no-tests) tests=0; shift ;;
    --tests) [ $# -ge 2 ] || die "--tests needs paths"; test_paths=$2; shift 2 ;;
    --jobs) [ $# -ge 2 ] || die "--jobs needs a number"; jobs=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (valid: --suite --venv --wheels --extras --also --pip-args --no-install --no-tests --tests --jobs, then -- runner options)" ;;
  esac
done
[ ${#suites[@]} -gt 0 ] || suites=(kernels)
[ -z "$wheels" ] || [ -d "$wheels" ] || die "--wheels $wheels: no such folder"
case $jobs in ''|*[!0-9]*) die "--jobs $jobs: not a whole number" ;; esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT_DIR" || die "cannot create the output folder $OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
if [ -n "$venv" ]; then
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" || die "cannot create a virtual environment in $venv"
  PY=$venv/bin/python
fi
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter $PY (set PYTHON or give --venv)"
cd "$ROOT"
export PYTHONUNBUFFERED=1
# The repository first, then what the user put on PYTHONPATH (a `pip install --target` folder).
PYPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if [ "$install" = 1 ]; then
  src=()
  [ -n "$wheels" ] && src=(--no-index --find-links "$wheels")
  want="test${extras:+,$extras}"
  echo "installing capdispatch[$want]${wheels:+ from $wheels} into $PY (log: $OUT_DIR/install.log)"
  # shellcheck disable=SC2086  # pip_args is a word list on purpose
  "$PY" -m pip install "${src[@]}" $pip_args ".[$want]" "${also[@]}" > "$OUT_DIR/install.log" 2>&1 \
    || die "pip could not install capdispatch[$want] ${also[*]}: see $OUT_DIR/install.log" 2
  # The serving suite and the SGLang GPU tests need SGLang and its light dependencies; SGLang
  # itself without its dependencies (its pins would replace the installed torch).
  case " ${suites[*]} " in *" serving "*)
    # shellcheck disable=SC2086
    { "$PY" -m pip install "${src[@]}" $pip_args -r tests/requirements.txt \
      && "$PY" -m pip install "${src[@]}" $pip_args --no-deps -r tests/requirements-nodeps.txt; } >> "$OUT_DIR/install.log" 2>&1 \
      || die "pip could not install SGLang and its dependencies for the serving suite: see $OUT_DIR/install.log" 2 ;;
  esac
  # The engine suite runs SGLang 0.5.17's own launcher: SGLang and everything it imports to
  # serve DeepSeek-V4, all without dependencies (benchmarks/requirements-engine-sglang-0.5.17.txt).
  case " ${suites[*]} " in *" engine "*)
    # shellcheck disable=SC2086
    "$PY" -m pip install "${src[@]}" $pip_args --no-deps -r benchmarks/requirements-engine-sglang-0.5.17.txt \
      >> "$OUT_DIR/install.log" 2>&1 \
      || die "pip could not install SGLang 0.5.17 and what it imports for the engine suite: see $OUT_DIR/install.log" 2 ;;
  esac
fi

"$PY" - <<'EOF' || exit 3
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_run.sh: torch is not installed in this environment (drop --no-install, or install a CUDA build of torch)")
if not torch.cuda.is_available():
    sys.exit(f"gpu_run.sh: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}); "
             "the GPU tests and suites need one")
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.device_count()} CUDA device(s); cuda:0 {p.name} (cc {p.major}.{p.minor}); "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

sargs=(); for s in "${suites[@]}"; do [ "$s" = none ] || sargs+=(--suite "$s"); done
# The suites and runner options are checked before anything runs (bad ones: exit 2).
if [ ${#sargs[@]} -gt 0 ]; then
  PYTHONPATH=$PYPATH "$PY" -m benchmarks "${sargs[@]}" --out "$OUT_DIR" --dry-run "$@" > /dev/null || exit $?
fi

rc=0
if [ "$tests" = 1 ]; then
  args=(-q -p no:cacheprovider -m gpu -rfEs --junitxml "$OUT_DIR/gpu_tests.xml")
  "$PY" -c "import xdist" 2>/dev/null && [ "$jobs" -gt 1 ] && args+=(-n "$jobs")
  echo "GPU tests: pytest -m gpu $test_paths (output: $OUT_DIR/gpu_tests.txt)"
  # shellcheck disable=SC2086  # test_paths is a path list
  PYTHONPATH=$PYPATH "$PY" -m pytest "${args[@]}" $test_paths > "$OUT_DIR/gpu_tests.txt" 2>&1
  t=$?; tail -3 "$OUT_DIR/gpu_tests.txt"
  [ $t -eq 0 ] || { echo "GPU tests: exit $t"; rc=1; }
fi

if [ ${#sargs[@]} -gt 0 ]; then
  PYTHONPATH=$PYPATH "$PY" -m benchmarks "${sargs[@]}" --out "$OUT_DIR" "$@"
  b=$?
  [ $b -eq 0 ] || { [ $b -ge 2 ] && exit $b; rc=1; }
fi
exit $rc
