#!/usr/bin/env bash
# Runs the memory and speed benches of two trees in one session, one after
# the other, so "before" and "after" come from the same machine in the same
# state (the page cache, the other core's load, the build flags).
#
#   scripts/bench-side-by-side.sh BEFORE_TREE [OUT_DIR]
#
# BEFORE_TREE is a checkout of the older commit beside this one, e.g.
#   git worktree add ../before b992a76
# OUT_DIR (default target/side-by-side) receives one file per bench and
# tree, and summary.txt with the lines that carry the numbers.
#
# In order: release builds of both trees; `cargo bench --bench fold` and
# `--bench assembly` in each tree (divan, same corpus from ../shared/data);
# `--bench nats_ingest` alternating before/after for ROUNDS passes (default
# 3: issue 26 asks for three medians); then this tree's process benches
# `fleet_memory` and `takeover` with both binaries
# (CONTEXTFOLD_BENCH_BINS); `fleet_memory` again with the
# fleet's window at 128,000 (no compaction); `run` on the real-transcript
# fleet (`scripts/bench-run-transcripts.sh`, both binaries alternating,
# RUN_RUNS runs each, default 3) under windows 32,000 and 1,000,000 (no
# compaction). With TEN_X=1, last, `fleet_memory` on 20,000 conversations
# (a log ten times the default's, ~4 GiB; about 25 minutes more), for
# cold queries on a large log. Benches a tree does not have are skipped
# and said so. Knobs the benches read (CONTEXTFOLD_FLEET_*,
# CONTEXTFOLD_TAKEOVER_*, CONTEXTFOLD_BENCH_EVENTS, ...) pass through.
# About 60 minutes on 2 cores, most of it the two release builds.
set -euo pipefail

after="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
before="$(cd "${1:?usage: $0 BEFORE_TREE [OUT_DIR]}" && pwd)"
out="${2:-$after/target/side-by-side}"
rounds="${ROUNDS:-3}"
mkdir -p "$out"
: > "$out/summary.txt"

# nats-server as the tests find it; the older tree has no virtualenv.
export CONTEXTFOLD_NATS_SERVER="${CONTEXTFOLD_NATS_SERVER:-$after/.venv/bin/nats-server}"
[ -x "$CONTEXTFOLD_NATS_SERVER" ] || "$after/scripts/install-nats.sh"

label() { [ "$1" = "$before" ] && echo before || echo after; }
has_bench() { [ -f "$1/benches/$2.rs" ]; }
note() { echo "$*" | tee -a "$out/summary.txt"; }

note "side by side: before $(git -C "$before" rev-parse --short HEAD) ($before), after $(git -C "$after" rev-parse --short HEAD) ($after), $(date -u +%FT%TZ)"
for tree in "$before" "$after"; do
    echo "== building $(label "$tree")"
    (cd "$tree" && cargo build --release --locked --quiet \
        && cargo bench --locked --no-run --quiet --bench fold --bench assembly --bench nats_ingest)
done

for bench in fold assembly; do
    for tree in "$before" "$after"; do
        file="$out/$bench.$(label "$tree").txt"
        if ! has_bench "$tree" "$bench"; then
            note "$bench: $(label "$tree") has no such bench"
            continue
        fi
        echo "== $bench, $(label "$tree")"
        (cd "$tree" && cargo bench --locked --quiet --bench "$bench") > "$file" 2>&1
    done
done

for round in $(seq 1 "$rounds"); do
    for tree in "$before" "$after"; do
        file="$out/nats_ingest.$(label "$tree").$round.txt"
        echo "== nats_ingest, $(label "$tree"), pass $round"
        (cd "$tree" && cargo bench --locked --quiet --bench nats_ingest) > "$file" 2>&1
        note "nats_ingest $(label "$tree") pass $round: $(grep -iE 'ratio' "$file" | tail -1)"
    done
done

export CONTEXTFOLD_BENCH_BINS="before=$before/target/release/contextfold,after=$after/target/release/contextfold"
for bench in fleet_memory takeover; do
    echo "== $bench, both binaries"
    (cd "$after" && cargo bench --locked --quiet --bench "$bench") > "$out/$bench.txt" 2>&1
done
echo "== fleet_memory without compaction, both binaries"
(cd "$after" && CONTEXTFOLD_FLEET_WINDOW=128000 cargo bench --locked --quiet --bench fleet_memory) \
    > "$out/fleet_memory.no-compaction.txt" 2>&1

# `run` on real transcripts. The after binary is A: when the fleet file
# is not there yet, A imports it.
median() { sort -n | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
# note_run WINDOW TREE COLUMN FILE: the median events/s of COLUMN's runs in
# FILE, and the distinct state hashes they ended in.
note_run() {
    local runs
    runs="$(grep "^$3:" "$4" || true)"
    note "run on real transcripts, window $1, $2: median $(awk '{ print $4 }' <<< "$runs" | median) events/s, state $(grep -o 'state [0-9a-f]*' <<< "$runs" | awk '{ print $2 }' | sort -u | tr '\n' ' ')"
}
for window in 32000 1000000; do
    echo "== run on real transcripts, window $window, both binaries"
    file="$out/run-transcripts.$window.txt"
    WINDOW="$window" "$after/scripts/bench-run-transcripts.sh" \
        "$after/target/release/contextfold" "$before/target/release/contextfold" "${RUN_RUNS:-3}" > "$file" 2>&1
    note_run "$window" after A "$file"
    note_run "$window" before B "$file"
done

if [ "${TEN_X:-0}" = 1 ]; then
    echo "== fleet_memory on a log ten times larger, both binaries"
    (cd "$after" && CONTEXTFOLD_FLEET_CONVERSATIONS=20000 cargo bench --locked --quiet --bench fleet_memory) \
        > "$out/fleet_memory.ten-x.txt" 2>&1
fi
note "outputs in $out"
