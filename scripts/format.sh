#!/usr/bin/env bash
# Formats every tracked C++/CUDA source with the repo's .clang-format; `--check` only reports (CI
# runs it from .ci/run): it lists the files that differ and exits 1. clang-format 14 (Debian 12's,
# which scripts/setup.sh installs) is the reference: another version may format differently.
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-$(command -v clang-format-14 || command -v clang-format || true)}
if [[ -z "$CF" ]]; then
  echo "parallax: error: clang-format not found (scripts/setup.sh installs it)" >&2
  exit 1
fi
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
if [[ "${1:-}" == "--check" ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$CF" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf '  %s\n' "${bad[@]}" >&2
    echo "parallax: error: ${#bad[@]} of ${#files[@]} files are not clang-formatted ($("$CF" --version)); run scripts/format.sh" >&2
    exit 1
  fi
  echo "[format] ${#files[@]} files clang-formatted ($("$CF" --version))"
else
  "$CF" -i "${files[@]}"
  echo "[format] ${#files[@]} files"
fi
