# The venv of the vLLM part for one vLLM release, sourced by .ci/run_vllm and
# .ci/vllm_core_passing:  . .ci/vllm_env.sh VERSION
# Builds $WORK/venv (torch CPU, vllm --no-deps, the release's pinned requirements, kvcached with
# its test extras), unpacks vLLM's tests/ from its sdist into $WORK/run and writes an offline
# Hugging Face cache into $WORK/hf; leaves the venv active. No vLLM code is kept in this
# repository. KVCACHED_CI_VLLM_REUSE=1 keeps a venv that a previous call finished.
VLLM_VERSION=${1:?usage: . .ci/vllm_env.sh VLLM_VERSION (0.32.0 or 0.33.0)}
# One line per supported release; everything else that differs is its requirements file.
# torch: 0.32.0 pins 2.13.0; 0.33.0 pins 2.14.0, but its scheduling side runs on 2.13, and the
# CPU wheel of 2.13 keeps both venvs small (vLLM is installed --no-deps, so nothing enforces it).
case "$VLLM_VERSION" in
    0.32.0) TORCH_VERSION=2.13.0 XGRAMMAR_VERSION=0.2.8 ;;
    0.33.0) TORCH_VERSION=2.13.0 XGRAMMAR_VERSION=0.2.8 ;;
    *) echo "vLLM $VLLM_VERSION: the vLLM part supports 0.32.0 and 0.33.0 (add a line in .ci/vllm_env.sh" \
            "and .ci/vllm-$VLLM_VERSION-requirements.txt for another)" >&2
       return 2 2>/dev/null || exit 2 ;;
esac
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQUIREMENTS=$REPO/.ci/vllm-$VLLM_VERSION-requirements.txt
WORK=${KVCACHED_CI_VLLM_DIR:-$REPO/.ci-vllm}/$VLLM_VERSION
export VLLM_TARGET_DEVICE=cpu

phase() { printf '\n== vLLM %s: %s (%d s so far)\n' "$VLLM_VERSION" "$1" "$SECONDS"; }
# pip's output goes to a log: its resolver lists every vLLM requirement left out on purpose.
pip_quiet() {
    if ! python -m pip "$@" >>"$WORK/pip.log" 2>&1; then
        tail -n 60 "$WORK/pip.log"
        echo "pip $* failed (log: $WORK/pip.log)" >&2
        return 1
    fi
}

if [ "${KVCACHED_CI_VLLM_REUSE:-0}" = 1 ] && [ -f "$WORK/ready" ]; then
    phase "reusing the venv in $WORK (KVCACHED_CI_VLLM_REUSE=1)"
    . "$WORK/venv/bin/activate"      # kvcached is installed editable: the working tree's code runs
else
    phase "venv $WORK/venv: torch $TORCH_VERSION (CPU), vllm $VLLM_VERSION --no-deps, pinned imports"
    rm -rf "$WORK"
    mkdir -p "$WORK"
    python3 -m venv "$WORK/venv"
    . "$WORK/venv/bin/activate"
    pip_quiet install -q --upgrade pip
    pip_quiet install -q "torch==$TORCH_VERSION"
    pip_quiet install -q --no-deps "vllm==$VLLM_VERSION" "xgrammar==$XGRAMMAR_VERSION"
    pip_quiet install -q -r "$REQUIREMENTS"
    pip_quiet install -q -e "$REPO[test]"
    python -c "import vllm, torch; import vllm.v1.core.sched.scheduler; print('vllm', vllm.__version__, 'torch', torch.__version__)"

    phase "vLLM's tests from its sdist, an offline Hugging Face cache of model configs"
    VLLM_SKIP_VERSION_SUFFIX=1 VLLM_TARGET_DEVICE=empty pip_quiet download -q --no-deps --no-binary :all: \
        --no-build-isolation -d "$WORK/sdist" "vllm==$VLLM_VERSION"
    # Only tests/ is unpacked, so the installed vllm is the one imported.
    mkdir -p "$WORK/run"
    tar xzf "$WORK/sdist/vllm-$VLLM_VERSION.tar.gz" -C "$WORK/run" --strip-components=1 "vllm-$VLLM_VERSION/tests"
    # The markers vLLM's tests use; the file also keeps pytest from taking this repo's configuration.
    printf '[pytest]\nmarkers =\n    cpu_test\n    slow_test\n    skip_global_cleanup\n' >"$WORK/run/pytest.ini"
    python "$REPO/.ci/hf_offline_cache.py" "$WORK/hf"
    touch "$WORK/ready"
fi

# vLLM's tests under tests/v1/core, in $WORK/run, with the pool named by KVCACHED_VLLM_POOL
# ("kvcached" or "stock"): vllm_core_tests JUNIT_XML [pytest arguments...]. Some of them fail on
# a CPU whatever the pool (exit status 1, the junit xml tells which); any other status fails.
vllm_core_tests() {
    local xml=$1 status=0
    shift
    (cd "$WORK/run" && HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 PYTHONPATH="$REPO/.ci" \
        python -m pytest -p vllm_pool_plugin -p no:cacheprovider -q -rN --continue-on-collection-errors \
        --junitxml="$xml" "$@" tests/v1/core) \
        || status=$?
    if [ "$status" -gt 1 ]; then
        echo "pytest over vLLM's tests/v1/core exited with status $status" >&2
        return "$status"
    fi
}
