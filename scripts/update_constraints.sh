#!/usr/bin/env bash
# Rewrite constraints.txt: every package (dependencies of dependencies included) at the newest version that
# requirements.txt and requirements-dev.txt allow today, resolved in a new virtual environment. Run it when CI's
# "newest versions" step has passed with versions newer than the file's, then commit the file with the CI run
# that passed on it. If that step fails instead, fix rlhf or tighten the requirement's upper bound in
# requirements.txt (and pyproject.toml) first, so that a plain `pip install -r requirements.txt` never resolves
# to a combination that fails.
#
#   scripts/update_constraints.sh            # writes constraints.txt
#   scripts/update_constraints.sh -o FILE    # writes FILE instead (CI compares it with constraints.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
output=constraints.txt
if [ "${1:-}" = "-o" ]; then output=$2; fi
python=${PYTHON:-python3}

venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
{
    echo "# The versions CI tests, for reproducible installs: pip install -r requirements.txt -c constraints.txt"
    echo "# Written by scripts/update_constraints.sh on $(date -u +%Y-%m-%d) with $("$venv/bin/python" -V) on $(uname -sm);"
    echo "# requirements.txt says what rlhf allows, this file what it was tested with. torch's local version label"
    echo "# (+cpu, +cu128) is dropped, so that the same line admits the CPU and the CUDA build."
    "$venv/bin/python" -m pip freeze --disable-pip-version-check --exclude-editable \
        | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
} > "$output"
echo "wrote $output ($(grep -vc '^#' "$output") packages)"
