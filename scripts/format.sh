#!/usr/bin/env bash
# Formats every C++ source with the repo's .clang-format (pass --check to only report).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
if [[ "${1:-}" == "--check" ]]; then
  clang-format --dry-run --Werror "${files[@]}"
else
  clang-format -i "${files[@]}"
  echo "[format] ${#files[@]} files"
fi
