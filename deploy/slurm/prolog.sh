#!/bin/bash
# Slurm prolog (runs as root on every node before the job): stage the job's dataset onto the
# node's NVMe.  The job asks for it with --comment or, more commonly, environment variables
# set in the batch script and exported to the prolog through PrologFlags=Alloc and
# SLURM_JOB_... variables:
#
#   FMSTORE_STAGE_IN="s3://bucket/datasets/tokens-v3 nvme:datasets/tokens-v3"
#
# Each node stages its share (fmstore stage shards by SLURM_PROCID / SLURM_NTASKS when set,
# and re-runs skip files already present), so a requeued job starts at once.
# Install: slurm.conf  Prolog=/etc/slurm/fmstore-prolog.sh
set -euo pipefail

FMSTORE=${FMSTORE:-/opt/fmstore/bin/fmstore}
export FMSTORE_CONFIG=${FMSTORE_CONFIG:-/etc/fmstore/fmstore.toml}
LOG=/var/log/fmstore/prolog-${SLURM_JOB_ID:-0}.log
mkdir -p "$(dirname "$LOG")"

# Fail fast on a bad configuration or a tier that is not usable (a misspelt bucket, refused
# credentials, a read-only bucket): the job would otherwise start without its data, or its
# checkpoints would never reach their durable tier.
"$FMSTORE" daemon --check >>"$LOG" 2>&1

if [[ -n "${FMSTORE_STAGE_IN:-}" ]]; then
    read -r SRC DST <<<"$FMSTORE_STAGE_IN"
    echo "$(date -Is) staging $SRC -> $DST" >>"$LOG"
    # Non-zero exit drains the node (Slurm's prolog semantics): better than a job that
    # reads half a dataset.
    "$FMSTORE" stage "$SRC" "$DST" >>"$LOG" 2>&1
fi
exit 0
