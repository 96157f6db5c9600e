#!/usr/bin/env bash
# Agent sessions under Locust (loadtest/locustfile.py) against `agentgate serve --backend sim`,
# headless, start to finish: start the gateway on a free 127.0.0.1 port, wait for GET /ready,
# run locust for a bounded time, stop the gateway (SIGTERM, SIGKILL past a timeout), check that
# it and its workers are gone, print the summary (loadtest/locust_report.py). The gateway is
# stopped on Ctrl-C and on any error too (trap).
#
#   loadtest/locust.sh [--workers N] [--users N] [--spawn-rate R] [--run-time S] [--out DIR]
#                      [--cost zero|cpu|h200] [--stop-timeout S] [--model DIR] [-- LOCUST_ARGS...]
#
# Each flag has an environment variable (the flag wins), default in brackets:
#   LOADTEST_WORKERS [2]      sim workers (agentgate serve --workers)
#   LOADTEST_USERS [20]       Locust users, spread evenly over the four kinds of agent
#   LOADTEST_SPAWN_RATE [5]   users started per second
#   LOADTEST_RUN_TIME [60]    seconds of load (then users finish their turn, --stop-timeout)
#   LOADTEST_STOP_TIMEOUT [30] seconds users get to finish the turn they are in at the end
#   LOADTEST_COST [h200]      the sim workers' step time (--cost): h200 paces steps like an
#                             H200 (20 ms + per token), so TTFT and ITL mean something
#   LOADTEST_OUT [$TMPDIR/agentgate-locust-DATE]  output directory
#   LOADTEST_MODEL [OUT/model]  model directory; by default the demo tokenizer and geometry
#                             with a 64k context, written here, so the 30 KB histories fit
#   LOADTEST_SERVE_ARGS       more `agentgate serve` flags, split on spaces (e.g.
#                             "--api-keys keys.toml", with AGENTGATE_API_KEY set for locust)
#   PYTHON [.venv/bin/python if there, else python3]
# After `--`, arguments go to locust as they are (e.g. `-- --think-scale-s 1 RestSessionUser`).
# The workload's own options (think times, sizes, shares) are in loadtest/locust_workload.py.
#
# Writes to OUT: locust_stats.csv, locust_failures.csv, locust_exceptions.csv,
# locust_stats_history.csv (--csv), report.html (--html), locust.log, gateway.log, and pids (the
# gateway's and its workers' pids, one "role pid" a line). Exit status: locust's (1 when any
# request failed), 2 for bad options, 3 when a process outlived the gateway's stop, 130 on Ctrl-C.
set -euo pipefail

readonly READY_TIMEOUT_S=90 GATEWAY_STOP_TIMEOUT_S=45 WORKER_EXIT_TIMEOUT_S=5
readonly CONTEXT_TOKENS=65536
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")

WORKERS=${LOADTEST_WORKERS:-2}
USERS=${LOADTEST_USERS:-20}
SPAWN_RATE=${LOADTEST_SPAWN_RATE:-5}
RUN_TIME=${LOADTEST_RUN_TIME:-60}
STOP_TIMEOUT=${LOADTEST_STOP_TIMEOUT:-30}
COST=${LOADTEST_COST:-h200}
OUT=${LOADTEST_OUT:-${TMPDIR:-/tmp}/agentgate-locust-$(date +%Y%m%d-%H%M%S)}
MODEL=${LOADTEST_MODEL:-}
read -r -a SERVE_ARGS <<<"${LOADTEST_SERVE_ARGS:-}"
LOCUST_ARGS=()
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python
fi

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while (($#)); do
    case $1 in
        --workers) WORKERS=${2:?--workers N}; shift 2 ;;
        --users) USERS=${2:?--users N}; shift 2 ;;
        --spawn-rate) SPAWN_RATE=${2:?--spawn-rate R}; shift 2 ;;
        --run-time) RUN_TIME=${2:?--run-time SECONDS}; shift 2 ;;
        --stop-timeout) STOP_TIMEOUT=${2:?--stop-timeout SECONDS}; shift 2 ;;
        --cost) COST=${2:?--cost zero|cpu|h200}; shift 2 ;;
        --out) OUT=${2:?--out DIR}; shift 2 ;;
        --model) MODEL=${2:?--model DIR}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; LOCUST_ARGS=("$@"); break ;;
        *) echo "locust.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
for value in "$WORKERS" "$USERS" "$RUN_TIME" "$STOP_TIMEOUT"; do
    [[ $value =~ ^[0-9]+$ ]] || { echo "locust.sh: not a whole number: $value" >&2; exit 2; }
done
if ((RUN_TIME == 0 || USERS == 0 || WORKERS == 0)); then
    echo "locust.sh: --run-time, --users and --workers must be above 0" >&2
    exit 2
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/locust_*.csv "$OUT/report.html" "$OUT/pids"  # NOTE: a rerun into the same dir
MODEL=${MODEL:-$OUT/model}
GATEWAY_PID="" LOCUST_PID="" WORKER_PIDS=() LEFT_BEHIND=0

log() { echo "locust.sh: $*" >&2; }

# A live process (not a zombie, not gone) with this pid.
alive() {
    local state
    state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ $state != Z* ]]
}

# Wait up to $2 seconds for pid $1 to be gone; true if it is.
gone_within() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        alive "$1" || return 0
        sleep 0.1
    done
    ! alive "$1"
}

# The gateway's current children (its workers), added to WORKER_PIDS and to OUT/pids.
note_workers() {
    local pid
    [[ -n $GATEWAY_PID ]] || return 0
    for pid in $(pgrep -P "$GATEWAY_PID" 2>/dev/null || true); do
        [[ " ${WORKER_PIDS[*]} " == *" $pid "* ]] && continue
        WORKER_PIDS+=("$pid")
        echo "worker $pid" >>"$OUT/pids"
    done
}

stop_locust() {
    [[ -n $LOCUST_PID ]] && alive "$LOCUST_PID" || return 0
    # NOTE: SIGTERM (timeout passes it on): locust stops its users and writes its CSV files;
    # a background job of a script starts with SIGINT ignored
    kill -TERM "$LOCUST_PID" 2>/dev/null || true
    gone_within "$LOCUST_PID" $((STOP_TIMEOUT + 10)) || kill -KILL "$LOCUST_PID" 2>/dev/null || true
    wait "$LOCUST_PID" 2>/dev/null || true
}

# SIGTERM to the gateway (it drains, then stops its workers), SIGKILL past the timeout; then
# every worker it ever had must be gone (they die with it: PR_SET_PDEATHSIG), else SIGKILL.
stop_gateway() {
    local pid
    [[ -n $GATEWAY_PID ]] || return 0
    note_workers
    if alive "$GATEWAY_PID"; then
        kill -TERM "$GATEWAY_PID" 2>/dev/null || true
        if ! gone_within "$GATEWAY_PID" "$GATEWAY_STOP_TIMEOUT_S"; then
            log "the gateway ignored SIGTERM for ${GATEWAY_STOP_TIMEOUT_S} s: SIGKILL"
            kill -KILL "$GATEWAY_PID" 2>/dev/null || true
            LEFT_BEHIND=1
        fi
    fi
    local rc=0
    wait "$GATEWAY_PID" 2>/dev/null || rc=$?
    log "gateway $GATEWAY_PID stopped: exit status $rc"
    for pid in "${WORKER_PIDS[@]}"; do
        gone_within "$pid" "$WORKER_EXIT_TIMEOUT_S" && continue
        # NOTE: only our own worker, by pid, and only if the pid is still a worker
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q engine.worker; then
            log "worker $pid outlived the gateway: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            LEFT_BEHIND=1
        fi
    done
    GATEWAY_PID=""
}

cleanup() {
    local rc=$?
    # NOTE: a second Ctrl-C must not cut the cleanup short (every wait in it is bounded)
    trap '' INT TERM
    trap - EXIT
    stop_locust
    stop_gateway
    ((LEFT_BEHIND)) && ((rc == 0)) && rc=3
    exit "$rc"
}
trap cleanup EXIT
trap 'log interrupted; exit 130' INT
trap 'log terminated; exit 143' TERM

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

write_model() {
    [[ -f $MODEL/config.json ]] && return 0
    "$PYTHON" - "$MODEL" "$CONTEXT_TOKENS" <<'EOF'
import json, sys
from pathlib import Path
from engine.models.checkpoint import DEMO_CONFIG
from gateway.tokenizer import write_demo_tokenizer
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
write_demo_tokenizer(out)
config = DEMO_CONFIG | {"max_position_embeddings": int(sys.argv[2])}
(out / "config.json").write_text(json.dumps(config))
EOF
}

is_ready() {
    "$PYTHON" - "$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/ready", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except OSError:
    sys.exit(1)
EOF
}

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT_S))
    while ((SECONDS < deadline)); do
        if ! alive "$GATEWAY_PID"; then
            log "the gateway exited before it was ready:"; tail -n 30 "$OUT/gateway.log" >&2
            return 1
        fi
        is_ready "$1" && return 0
        sleep 0.5
    done
    log "the gateway was not ready within ${READY_TIMEOUT_S} s:"; tail -n 30 "$OUT/gateway.log" >&2
    return 1
}

cd "$REPO"
write_model
PORT=$(free_port)
URL=http://127.0.0.1:$PORT
# NOTE: its own session, so a Ctrl-C in the terminal reaches only this script, which stops the
# gateway in order; a throwaway tenant secret, so nothing is written under ~/.config
SECRET=${AGENTGATE_TENANT_SECRET:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex())')}
AGENTGATE_TENANT_SECRET=$SECRET setsid "$PYTHON" -m gateway.cli serve --model "$MODEL" \
    --backend sim --workers "$WORKERS" --cost "$COST" --host 127.0.0.1 --port "$PORT" \
    --served-model-name sim "${SERVE_ARGS[@]}" >"$OUT/gateway.log" 2>&1 &
GATEWAY_PID=$!
echo "gateway $GATEWAY_PID" >"$OUT/pids"
wait_ready "$URL"
note_workers
log "gateway $URL ready, ${#WORKER_PIDS[@]} sim worker(s) (--cost $COST);" \
    "$USERS users for $RUN_TIME s"

# NOTE: timeout bounds locust whatever happens (the run, the users' last turns, the reports)
timeout -k 10 $((RUN_TIME + STOP_TIMEOUT + 60)) "$PYTHON" -m locust -f "$HERE/locustfile.py" \
    --headless --host "$URL" --users "$USERS" --spawn-rate "$SPAWN_RATE" --run-time "${RUN_TIME}s" \
    --stop-timeout "$STOP_TIMEOUT" --csv "$OUT/locust" --html "$OUT/report.html" --only-summary \
    "${LOCUST_ARGS[@]}" >"$OUT/locust.log" 2>&1 &
LOCUST_PID=$!
locust_rc=0
wait "$LOCUST_PID" || locust_rc=$?
LOCUST_PID=""
if ((locust_rc > 1)); then
    log "locust exited $locust_rc:"
    tail -n 30 "$OUT/locust.log" >&2
fi

stop_gateway
if ((LEFT_BEHIND)); then
    log "a process outlived the gateway's stop (killed): see $OUT/pids"
fi
if [[ -f $OUT/locust_stats.csv ]]; then
    "$PYTHON" "$HERE/locust_report.py" "$OUT/locust"
    command="loadtest/locust.sh --workers $WORKERS --users $USERS --spawn-rate $SPAWN_RATE"
    command+=" --run-time $RUN_TIME --cost $COST${LOCUST_ARGS[*]:+ -- ${LOCUST_ARGS[*]}}"
    echo "command: ${LOADTEST_SERVE_ARGS:+LOADTEST_SERVE_ARGS=\"$LOADTEST_SERVE_ARGS\" }$command"
    echo "reports: $OUT/report.html, $OUT/locust_*.csv; logs: $OUT/locust.log, $OUT/gateway.log"
fi
((LEFT_BEHIND)) && exit 3
exit "$locust_rc"
