# Sourced by the other scripts: make sure uv exists, then sync the project environment with the given extras.
# Usage: source scripts/env.sh; ppt_help "$0" "$@"; ppt_env --extra cpu --extra dev
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# With -h or --help among the arguments: print the script's header comment (its usage) and exit 0, before anything
# is synced, installed, prepared or trained.
ppt_help() {
    for arg in "${@:2}"; do
        if [ "$arg" = -h ] || [ "$arg" = --help ]; then
            awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$1"
            exit 0
        fi
    done
}

ppt_env() {
    if ! command -v uv >/dev/null 2>&1; then
        echo "uv not found: installing it with python3 -m pip install uv" >&2
        python3 -m pip install --quiet uv
        export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
    fi
    uv sync --quiet --frozen --inexact "$@"  # --inexact: keep what other extras installed
}

# The extra that matches this machine; the lock installs PyPI's torch for all of them.
ppt_backend() {
    if command -v nvidia-smi >/dev/null 2>&1; then echo gpu
    elif command -v rocm-smi >/dev/null 2>&1; then echo rocm
    else echo cpu; fi
}

# run, not sourced: there is nothing to do but say what it is for
[ "${BASH_SOURCE[0]}" != "$0" ] || ppt_help "$0" --help
