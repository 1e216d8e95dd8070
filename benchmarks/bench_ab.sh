#!/usr/bin/env bash
# flatshard bench at an older commit ("old") and at the working tree ("new"), interleaved
# old, new, old, new, ... so that both sides meet the same machine noise.
#
#   benchmarks/bench_ab.sh OLD_REV ROUNDS [bench options...]
#   benchmarks/bench_ab.sh 3e2aeca 2 --preset byte-gpt --systems flatshard,fsdp2,floor
#
# Each side runs with its own src/ first on PYTHONPATH (the ranks inherit it); the tables
# land in $OUT (default /tmp/bench_ab)/{old,new}_N/log.txt and bench.json.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
old_rev="$1"; rounds="$2"; shift 2
out="${OUT:-/tmp/bench_ab}"
old_tree="$out/old-tree"
mkdir -p "$out"
[ -d "$old_tree" ] || git -C "$root" worktree add -q "$old_tree" "$old_rev"
for i in $(seq 1 "$rounds"); do
  for side in old new; do
    src="$root/src"; [ "$side" = old ] && src="$old_tree/src"
    dir="$out/${side}_$i"; mkdir -p "$dir"
    (cd "$dir" && PYTHONPATH="$src" "$root/.venv/bin/python" -c \
      "import sys; from flatshard.cli.main import entry; sys.argv = ['flatshard', 'bench', *sys.argv[1:]]; entry()" \
      "$@" --out "$dir") > "$dir/log.txt" 2>&1
    echo "$side $i:"; sed -n 2,6p "$dir/log.txt"
  done
done
