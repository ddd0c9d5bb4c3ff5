#!/bin/bash
# Slurm epilog (runs as root on every node after the job): make sure every checkpoint the
# job saved on node-local NVMe has reached the durable tiers its export policies ask for,
# before the node is handed to the next job (which may wipe the NVMe).
#
# With an fmstore daemon on the node (systemd unit), wait until its export queue is empty;
# without one, run the policies here until they are satisfied.  Either way bounded by
# FMSTORE_EPILOG_TIMEOUT seconds; on timeout the node is drained (exit 1) so nothing is lost:
# the copies are resumable and the daemon or the next epilog finishes them.
# Install: slurm.conf  Epilog=/etc/slurm/fmstore-epilog.sh
set -uo pipefail

FMSTORE=${FMSTORE:-/opt/fmstore/bin/fmstore}
export FMSTORE_CONFIG=${FMSTORE_CONFIG:-/etc/fmstore/fmstore.toml}
TIMEOUT=${FMSTORE_EPILOG_TIMEOUT:-1800}
PORT=${FMSTORE_DAEMON_PORT:-9464}
LOG=/var/log/fmstore/epilog-${SLURM_JOB_ID:-0}.log
mkdir -p "$(dirname "$LOG")"

# Optional: results written by the job to stage back out, "SRC DST".
if [[ -n "${FMSTORE_STAGE_OUT:-}" ]]; then
    read -r SRC DST <<<"$FMSTORE_STAGE_OUT"
    "$FMSTORE" stage "$SRC" "$DST" >>"$LOG" 2>&1 || exit 1
fi

if curl -fsS "http://127.0.0.1:${PORT}/healthz" >/dev/null 2>&1; then
    # A daemon runs: poll its export lag until nothing waits.
    deadline=$(( $(date +%s) + TIMEOUT ))
    while (( $(date +%s) < deadline )); do
        lag=$(curl -fsS "http://127.0.0.1:${PORT}/metrics" \
              | awk '/^fmstore_tier_export_lag_seconds /{print $2}')
        if [[ "${lag:-1}" == "0.0" ]]; then
            echo "$(date -Is) exports done" >>"$LOG"
            exit 0
        fi
        sleep 5
    done
    echo "$(date -Is) exports still pending after ${TIMEOUT}s" >>"$LOG"
    exit 1
fi

"$FMSTORE" daemon --drain --no-http --timeout "$TIMEOUT" >>"$LOG" 2>&1
rc=$?
if (( rc != 0 )); then
    echo "$(date -Is) drain exited $rc: draining the node, copies stay resumable" >>"$LOG"
    exit 1
fi
exit 0
