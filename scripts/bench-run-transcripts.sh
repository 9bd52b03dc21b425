#!/usr/bin/env bash
# `contextfold run` throughput on real transcripts (issue 26): events/s of
# one binary, or of two side by side.
#
#   scripts/bench-run-transcripts.sh BINARY [BINARY_B] [RUNS]
#
# The fleet: the Claude Code transcripts of ../shared/data (the long
# session fa812bfe, tool_heavy and short: 382 events) imported with
# BINARY's `import` and copied COPIES times (default 200: 76,400 events),
# each copy's conversation keys (`KEY#xN`), event ids and times made its
# own (copies one after the other, times increasing), written once to
# OUT_DIR/fleet.jsonl. Each run folds it with `run` into a fresh data
# directory under WINDOW (default 32000, so the long session compacts: the
# deterministic summarizer writes ~3,000 summaries; 1000000 for no
# compaction) and prints its wall time, events/s and the final line (the
# state hash: the same for both binaries when the summaries are).
# With two binaries the runs alternate A B A B ... RUNS (default 3) each.
# Needs jq.
#
# MEASURE=instructions counts each run's instructions under valgrind's
# cachegrind instead of timing it (Debian: apt-get install valgrind). For
# a release build the count repeats to within a few hundredths of a
# percent where wall times on a shared VM spread over +-20%, so a change
# of a few percent shows in one run; it is about 50x slower, so use
# COPIES=20 (7,640 events). Count release builds: a build without LTO
# counts work the release build does not do (a future copied per record),
# and under compaction its count moves by about 1% from run to run (the
# share of readings shed to the fold follows the threads' timing). It
# counts work, not time: waits, the disk, cache misses and how the two
# threads overlap are not in it, and 4-5% fewer instructions have timed
# the same (docs/notes/issue-26.md, twenty-fourth pass). So a change that
# counts less is then timed, and kept for its time, not its count.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
a="${1:?usage: $0 BINARY [BINARY_B] [RUNS]}"
b="${2:-}"
runs="${3:-3}"
copies="${COPIES:-200}"
window="${WINDOW:-32000}"
out="${OUT_DIR:-$here/target/bench-run-transcripts}"
data="${CONTEXTFOLD_SHARED_DATA:-$here/../shared/data}"
cc="$data/transcripts/claude-code_marot-spotter"
mkdir -p "$out"

fleet="$out/fleet.$copies.jsonl"
if [ ! -s "$fleet" ]; then
    one="$out/one-copy.jsonl"
    : > "$one"
    for f in fa812bfe-b295-4cca-9c2f-fdf01028cb46.jsonl tool_heavy.jsonl short.jsonl; do
        "$a" import "$cc/$f" >> "$one" 2>/dev/null
    done
    # Copy k is shifted back (copies-1-k) x 200,000,000 ms (2.3 days, longer
    # than one copy spans), so times increase and none is in the future.
    for k in $(seq 0 $((copies - 1))); do
        jq -c --argjson k "$k" --argjson n "$copies" \
            '.id += "-x\($k)" | .conversation += "#x\($k)" | .time -= (($n - 1 - $k) * 200000000)' \
            "$one"
    done > "$fleet.tmp"
    mv "$fleet.tmp" "$fleet"
fi
events=$(wc -l < "$fleet")
echo "fleet: $fleet, $events events, window $window"

one_run() {
    local label="$1" bin="$2" dir="$out/data.$1"
    rm -rf "$dir"
    if [ "${MEASURE:-wall}" = instructions ]; then
        command -v valgrind > /dev/null || { echo "MEASURE=instructions needs valgrind" >&2; exit 1; }
        CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW="$window" valgrind --tool=cachegrind --cache-sim=no \
            --cachegrind-out-file=/dev/null "$bin" --data "$dir" run "$fleet" > "$out/run.$label.txt" 2> "$out/valgrind.$label.txt"
        echo "$label: $(grep -o 'I *refs: *[0-9,]*' "$out/valgrind.$label.txt" | tr -s ' ') instructions | $(tail -1 "$out/run.$label.txt")"
        rm -rf "$dir"
        return
    fi
    local start end
    start=$(date +%s.%N)
    CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW="$window" "$bin" --data "$dir" run "$fleet" > "$out/run.$label.txt" 2>&1
    end=$(date +%s.%N)
    awk -v l="$label" -v s="$start" -v e="$end" -v n="$events" -v last="$(tail -1 "$out/run.$label.txt")" \
        'BEGIN { printf "%s: %.2f s, %.0f events/s | %s\n", l, e - s, n / (e - s), last }'
    rm -rf "$dir"
}

for r in $(seq 1 "$runs"); do
    one_run A "$a"
    [ -n "$b" ] && one_run B "$b"
done
