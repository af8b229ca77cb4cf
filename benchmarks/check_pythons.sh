#!/usr/bin/env bash
# Both locks under each Python given, checked against the package registry by pip's dry run (not in
# the suite: it asks the registry for every locked package, about a minute a lock): a new
# environment of that Python, then `pip install --dry-run --no-deps` of each lock, with no pip
# configuration of this machine's (local wheels, caps): every locked package has a distribution
# for that Python. That each lock holds every package the Python needs is uv's resolution's to
# show (`make lock`; tests/test_envs.py resolves the GPU lock under each Python). The CPU lock's torch (2.13.0+cpu) is
# published on PyTorch's own index only: it is asked of TORCH_CPU_INDEX (the Makefile's) and
# reported as not reached where that index does not answer. A Python the Makefile refuses is
# reported with its refusal.
#
#   bash benchmarks/check_pythons.sh PYTHON...    # e.g. python3.10 python3.12, or paths
set -uo pipefail
cd "$(dirname "$0")/.."
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
scratch=$(mktemp -d /tmp/check_pythons.XXXXXX)
status=0
for python in "$@"; do
    version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || {
        echo "$python: does not run"; status=1; continue; }
    refusal=$(make -n venv "PYTHON=$python" "VENV=$scratch/refusal-$version" 2>&1 >/dev/null)
    if [ -n "$refusal" ]; then
        echo "Python $version ($python): make venv refuses it: ${refusal#*\*\*\* }"
        continue
    fi
    venv=$scratch/venv-$version
    "$python" -m venv "$venv"
    env PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet --upgrade pip==25.3
    for lock in gpu cpu; do
        file=envs/requirements-$lock.lock
        [ "$lock" = cpu ] && { grep -v '^torch==' "$file" >"$scratch/cpu-no-torch.lock"
                               file=$scratch/cpu-no-torch.lock; }
        start=$SECONDS
        if env PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install --dry-run --quiet --no-deps \
            --no-cache-dir --report "$scratch/$lock-$version.json" -r "$file" \
            >"$scratch/$lock-$version.log" 2>&1; then
            count=$("$venv/bin/python" -c "import json, sys; print(len(json.load(open(sys.argv[1]))['install']))" \
                "$scratch/$lock-$version.json")
            echo "Python $version: the $lock lock resolves: $count packages ($((SECONDS - start)) s)"
        else
            echo "Python $version: the $lock lock does not resolve:"; tail -3 "$scratch/$lock-$version.log"
            status=1
        fi
    done
    torch=$(grep '^torch==' envs/requirements-cpu.lock)
    if env PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" download --no-deps --no-cache-dir --quiet \
        --retries 1 --timeout 10 --index-url "$TORCH_CPU_INDEX" --dest "$scratch/torch-$version" \
        "$torch" >"$scratch/torch-$version.log" 2>&1; then
        echo "Python $version: $torch found on $TORCH_CPU_INDEX"
    elif ! grep -q -e "NewConnectionError" -e "Could not fetch URL" "$scratch/torch-$version.log"; then
        echo "Python $version: $torch is not on $TORCH_CPU_INDEX for this Python"; status=1
    else
        echo "Python $version: $TORCH_CPU_INDEX not reached (the CPU lock's torch unchecked)"
    fi
done
rm -rf "$scratch"
exit $status
