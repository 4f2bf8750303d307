#!/usr/bin/env bash
# The GPU machine's check, run unattended from the repo root (offline):
#   build in place, the `gpu` tests, the whole CPU suite, then the benchmarks on the GPU:
#   bench_vmm, bench_alloc, bench_manager (JSON in $OUT), the pytest-benchmark suite
#   ($OUT/bench_<date>_<commit>.json), and bench_handover / bench_sharing / bench_layout /
#   bench_attention / bench_serve / bench_share / bench_tp (host cores) when they exist; the
#   demo's PNG lands in $OUT too. About 20 minutes on the H200 with every step (bench_serve's
#   compiled model and bench_share's three setups at two rates take most of it): split it over
#   calls with GPU_CHECK_STEPS.
# Every step logs to $OUT/<step>.log; a failing step does not stop the next; a summary ends it and
# the exit status is the number of failed steps (0 = all passed).
#
#   OUT=/some/dir bash scripts/gpu_check.sh          # OUT defaults to ./gpu_out; it receives
#                                                     # summary.log and gpu_check.tgz (every log/JSON)
#
# To add a step: write a function step_<name> below and append <name> to STEPS (order matters:
# `build` first; GPU_CHECK_STEPS="a b" runs a subset, e.g. GPU_CHECK_STEPS="build bench_manager").
set -o pipefail
set -u

cd "$(dirname "$0")/.."
RESULTS="${OUT:-./gpu_out}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
# Logs and JSON go to a work folder that survives between calls on the same machine; after each
# step it is packed into $RESULTS/gpu_check.tgz (one file, so a run cut short still returns them).
OUT="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/kvcached_gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

step_env() {
    "$PYTHON" - <<'EOF'
import platform, subprocess
print("python", platform.python_version())
for name in ("torch", "cuda.bindings", "Cython", "numpy", "hypothesis", "pytest"):
    try:
        module = __import__(name, fromlist=["__version__"])
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "missing:", exc)
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as exc:
    print("torch:", exc)
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                          "--format=csv"], capture_output=True, text=True).stdout)
except OSError as exc:
    print("nvidia-smi:", exc)
EOF
}

step_build() {
    # /usr/bin g++: an /opt/gcc build of a C++ extension crashed in libstdc++ (docs/design.md, Build).
    CC=/usr/bin/gcc CXX=/usr/bin/g++ "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . &&
        "$PYTHON" -c "from kvcached import core; print('probe:', core.cuda_unavailable_reason())"
}

step_gpu_tests() {
    "$PYTHON" -m pytest -m gpu tests -q -p no:cacheprovider -ra
}

step_bench_vmm() {
    "$PYTHON" benchmarks/bench_vmm.py --device cuda --json "$OUT/bench_vmm.json"
}

step_cpu_tests() {
    "$PYTHON" -m pytest tests -q -x -p no:cacheprovider
}

step_bench_alloc() {
    "$PYTHON" benchmarks/bench_alloc.py --device cuda --json "$OUT/bench_alloc.json"
}

step_bench_manager() {
    "$PYTHON" benchmarks/bench_manager.py --device cuda --json "$OUT/bench_manager.json"
}

step_pytest_bench() {
    # the pytest-benchmark suite on the GPU; the lead copies the JSON to benchmarks/results/
    local commit
    commit="${KVCACHED_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)}"
    local raw="${TMPDIR:-/tmp}/kvcached_bench_raw.json"
    "$PYTHON" -m pytest benchmarks -q -p no:cacheprovider -p no:randomly --benchmark-only \
        --bench-device cuda --benchmark-json "$raw" || return 1
    # pytest-benchmark keeps every timing ("data", ~80 MB here): keep the statistics only
    "$PYTHON" - "$raw" "$OUT/bench_$(date -u +%Y%m%d)_${commit}.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for bench in doc.get("benchmarks", []):
    bench.get("stats", {}).pop("data", None)
json.dump(doc, open(sys.argv[2], "w"), indent=1)
print("wrote", sys.argv[2])
EOF
}

step_demo() {
    "$PYTHON" -m kvcached.demo --quick --out "$OUT/demo.png"
}

step_bench_layout() {
    "$PYTHON" benchmarks/bench_layout.py --device cuda --out "$OUT/bench_layout.json"
}

step_bench_serve() {
    "$PYTHON" benchmarks/bench_serve.py --device cuda --skip e2e,handover --modes graphs,compiled \
        --batches 64,256 --prompt 512 --steps 5 --rounds 1 --json "$OUT/bench_serve.json" &&
        "$PYTHON" benchmarks/bench_serve.py --device cuda --skip decode,handover --modes graphs,compiled \
            --requests 256 --prompt 512 --new 256 --json "$OUT/bench_serve_e2e.json"
}

step_bench_share() {
    # three 8B-shaped instances under one budget, at an offered load below (6/s) and above (8/s)
    # what they produce together on an H200; then a share change over 2 MiB pages
    "$PYTHON" benchmarks/bench_share.py --seconds 30 --period 15 --rate 6 --budget 6G \
        --json "$OUT/bench_share_rate6.json" --png "$OUT/bench_share_rate6.png" &&
        "$PYTHON" benchmarks/bench_share.py --seconds 30 --period 15 --rate 8 --budget 6G \
            --json "$OUT/bench_share_rate8.json" --png "$OUT/bench_share_rate8.png" &&
        "$PYTHON" benchmarks/bench_share_change.py --device cuda --rounds 20 --json "$OUT/bench_share_change.json"
}

step_bench_tp() {
    # the shared-memory rounds on this machine's host cores (host backend), beside gloo
    "$PYTHON" benchmarks/bench_tp.py --device cpu --json "$OUT/bench_tp_host.json"
}

step_bench_attention() {
    "$PYTHON" benchmarks/bench_attention.py --json "$OUT/bench_attention.json"
}

step_bench_handover() {
    "$PYTHON" benchmarks/bench_handover.py --device cuda
}

step_bench_sharing() {
    "$PYTHON" benchmarks/bench_sharing.py --device cuda
}

STEPS=(env build demo gpu_tests cpu_tests bench_vmm bench_alloc bench_manager pytest_bench)
# others' benchmarks, when they exist
for optional in bench_handover bench_sharing bench_layout bench_attention bench_serve bench_share bench_tp; do
    [[ -f "benchmarks/$optional.py" ]] && STEPS+=("$optional")
done
# GPU_CHECK_STEPS="gpu_tests bench_vmm" runs a subset (e.g. when already built).
if [[ -n "${GPU_CHECK_STEPS:-}" ]]; then
    read -ra STEPS <<<"$GPU_CHECK_STEPS"
fi

declare -A RESULT SECONDS_TAKEN
failed=0
for step in "${STEPS[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S)) -> $OUT/$step.log"
    start=$(date +%s)
    if "step_$step" 2>&1 | tee "$OUT/$step.log"; then
        RESULT[$step]=ok
    else
        RESULT[$step]="FAILED (rc ${PIPESTATUS[0]})"
        failed=$((failed + 1))
    fi
    SECONDS_TAKEN[$step]=$(($(date +%s) - start))
    tar czf "$RESULTS/gpu_check.tgz" -C "$OUT" .
done

{
    echo
    echo "=== summary (logs in $OUT)"
    for step in "${STEPS[@]}"; do
        printf '  %-12s %-18s %4ss  %s\n' "$step" "${RESULT[$step]}" "${SECONDS_TAKEN[$step]}" \
            "$(tail -n 1 "$OUT/$step.log" 2>/dev/null | cut -c1-100)"
    done
} | tee "$OUT/summary.log" "$RESULTS/summary.log"
tar czf "$RESULTS/gpu_check.tgz" -C "$OUT" .
exit "$failed"
