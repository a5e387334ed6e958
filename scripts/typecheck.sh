#!/usr/bin/env bash
# mypy over the package as Python imports it (megascope.tracer, megascope.analyzer, ...).
# setuptools maps the top-level folders onto megascope.* (pyproject.toml's package-dir), which mypy can
# read neither from the config nor through the editable install's import hook; checked folder by folder,
# every `from megascope...` import would be unresolved and typed Any, and calls across the package would
# go unchecked. So check a temporary tree of symlinks laid out like the installed package, and report
# errors with repository paths.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
mypy=${MYPY:-.venv/bin/mypy}
[[ $mypy == */* && $mypy != /* ]] && mypy=$repo/$mypy  # a relative path: from the repository root
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/megascope"
for f in megascope/*.py; do ln -s "$repo/$f" "$tree/megascope/"; done
for d in tracer analyzer dashboard trainer kernels samples; do ln -s "$repo/$d" "$tree/megascope/$d"; done
cd "$tree"
"$mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p megascope \
  | sed -E 's#^megascope/(tracer|analyzer|dashboard|trainer|kernels|samples)/#\1/#'
