# What the A/B scripts share (sourced, not run): the base's source unpacked into a fresh folder,
# then ROUNDS rounds of the base and this tree, one after the other, each run a process of its
# own. Define ab_run (called as `ab_run VARIANT ROUND SRC`, VARIANT "base" or "this", SRC the
# folder to put first on PYTHONPATH), then call `ab_rounds ROUNDS BASE_TAR`; the runs write
# under $AB_WORK, which the summary reads. With PIN set (a CPU list: "2,3"), each run is pinned to
# those CPUs ($AB_PIN before its command): runs of one host otherwise differ by where they land.
AB_PIN=${PIN:+taskset -c $PIN}
ab_rounds() {
  local rounds=$1 base_tar=$2 r v
  AB_WORK=$(mktemp -d)
  mkdir -p "$AB_WORK/base" && tar -xzf "$base_tar" -C "$AB_WORK/base"
  for r in $(seq 1 "$rounds"); do
    for v in base this; do
      ab_run "$v" "$r" "$([ "$v" = base ] && echo "$AB_WORK/base/src" || echo "$PWD/src")"
    done
  done
}
