#!/usr/bin/env bash
# The working tree a device call carries is limited to 64 MiB (tracked files, untracked files git does not ignore, and
# the carried paths). The tracked tree alone is larger (bundled adapters, result records), and the GPU run needs
# neither: it builds its own random model and adapters and writes under OUT. This script sets those folders aside
# outside the checkout for the call and puts them back after it.
#   scripts/gpu_tree.sh size [CARRY...]   bytes that would travel now (with the carried paths, default .gpu_kit)
#   scripts/gpu_tree.sh out  [CARRY...]   moves assets/ and eval/results/ to $GPU_TREE_STASH (default ../gpu_tree_stash),
#                                         then checks the size against the limit
#   scripts/gpu_tree.sh in                moves them back; fails loudly if anything is missing
# The full GPU run:  scripts/gpu_kit.sh .gpu_kit && scripts/gpu_tree.sh out
#                    run(command="scripts/gpu_live.sh $OUT .gpu_kit", carry=[".gpu_kit"], timeout_s=600)
#                    scripts/gpu_tree.sh in
set -euo pipefail
cd "$(dirname "$0")/.."
limit=$((64 * 1024 * 1024))
stash=${GPU_TREE_STASH:-../gpu_tree_stash}
heavy=(assets eval/results)
verb=${1:?usage: scripts/gpu_tree.sh size|out|in [CARRY...]}
shift || true
carry=("$@")
[ ${#carry[@]} -eq 0 ] && carry=(.gpu_kit)

travelling_bytes() {
  local files=0 extra=0 p spec=()
  for p in "${carry[@]}"; do spec+=(":(exclude)$p"); done
  # tracked files that exist, and untracked files git does not ignore (a carried path counts once, below)
  files=$(git ls-files -z --cached --others --exclude-standard -- . "${spec[@]}" | sort -zu \
    | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
  for p in "${carry[@]}"; do
    [ -e "$p" ] && extra=$((extra + $(du -sb -- "$p" | cut -f1)))
  done
  echo $((files + extra))
}

case "$verb" in
  size)
    b=$(travelling_bytes)
    echo "would travel: $((b / 1024 / 1024)) MiB of $((limit / 1024 / 1024)) MiB (carry: ${carry[*]})"
    [ "$b" -le "$limit" ]
    ;;
  out)
    if [ -e "$stash" ]; then
      echo "gpu_tree: $stash exists already (an earlier 'out' not put back?): run 'scripts/gpu_tree.sh in' first" >&2
      exit 1
    fi
    if [ -n "$(git status --porcelain -- "${heavy[@]}")" ]; then
      echo "gpu_tree: ${heavy[*]} have uncommitted changes; commit or stash them first" >&2
      exit 1
    fi
    mkdir -p "$stash"
    for d in "${heavy[@]}"; do
      mkdir -p "$stash/$(dirname "$d")"
      mv -- "$d" "$stash/$d"
    done
    echo "gpu_tree: ${heavy[*]} set aside in $stash; put them back with 'scripts/gpu_tree.sh in'"
    "$0" size "${carry[@]}"
    ;;
  in)
    [ -d "$stash" ] || { echo "gpu_tree: nothing set aside ($stash does not exist)" >&2; exit 1; }
    for d in "${heavy[@]}"; do
      if [ -e "$d" ]; then
        echo "gpu_tree: $d exists in the checkout; not overwriting it (set-aside copy left in $stash/$d)" >&2
        exit 1
      fi
      mv -- "$stash/$d" "$d"
    done
    rm -rf -- "$stash"
    if [ -n "$(git status --porcelain -- "${heavy[@]}")" ]; then
      echo "gpu_tree: ${heavy[*]} differ from git after putting them back:" >&2
      git status --short -- "${heavy[@]}" >&2
      exit 1
    fi
    echo "gpu_tree: ${heavy[*]} back in place"
    ;;
  *)
    echo "usage: scripts/gpu_tree.sh size|out|in [CARRY...]" >&2
    exit 2
    ;;
esac
