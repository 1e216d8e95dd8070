#!/usr/bin/env bash
# flatshard bench on every LM preset, three iterations, from a snapshot of a commit (a git
# worktree: edits to the working tree cannot reach the ranks while they run).
#
#   benchmarks/bench_presets.sh REV [systems]
#   benchmarks/bench_presets.sh ba415c6 flatshard,flatshard-dense,flatshard-twin,fsdp2,floor
#
# Logs land in $OUT (default /tmp/bench_presets)/<preset>-<i>/log.txt.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rev="$1"; systems="${2:-flatshard,flatshard-dense,flatshard-twin,fsdp2,floor}"
out="${OUT:-/tmp/bench_presets}"; tree="$out/tree"
mkdir -p "$out"
[ -d "$tree" ] || git -C "$root" worktree add -q "$tree" "$rev"
for i in 1 2 3; do
  for p in llm-32k byte-gpt default llm-128k; do
    preset=(--preset "$p"); [ "$p" = default ] && preset=()
    dir="$out/$p-$i"; mkdir -p "$dir"
    (cd "$dir" && PYTHONPATH="$tree/src" "$root/.venv/bin/python" -c \
      "import sys; from flatshard.cli.main import entry; sys.argv = ['flatshard', 'bench', *sys.argv[1:]]; entry()" \
      "${preset[@]}" --row-sparse-tables --systems "$systems" --out "$dir") > "$dir/log.txt" 2>&1
    echo "$p $i:"; sed -n 2,8p "$dir/log.txt"
  done
done
