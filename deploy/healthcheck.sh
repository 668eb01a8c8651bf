#!/bin/sh
# conveyor's health check, for both images (Docker HEALTHCHECK, Kubernetes exec probes).
#   conveyor-healthcheck [MAX_AGE_S]
# A worker: its loop touches $CONVEYOR_ALIVE_FILE each time it comes round (workers/alive.py);
# healthy while the file is younger than MAX_AGE_S (default 360: above the longest a batch
# may run, CONVEYOR_MAX_TIMEOUT_S 300, so only a loop that stopped coming round fails).
# Anything else (the gateway, or a worker still loading its model): GET /healthz answers.
max_age=${1:-360}
if [ -n "$CONVEYOR_ALIVE_FILE" ] && [ -e "$CONVEYOR_ALIVE_FILE" ]; then
    age=$(( $(date +%s) - $(stat -c %Y "$CONVEYOR_ALIVE_FILE") ))
    [ "$age" -lt "$max_age" ]
else
    exec python3 -c "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CONVEYOR_PORT', '8000'), timeout=4)"
fi
