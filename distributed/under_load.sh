#!/usr/bin/env bash
# under_load.sh COMMAND...: runs COMMAND while a busy loop spins on every core,
# as on a machine whose other processes keep all its cores busy; exits with
# COMMAND's status. The MPI tests run this way (ctest's *_loaded variants) to
# show that what they check (every rank's error message, the job's end) does
# not depend on how the ranks happen to be scheduled. The loops end with the
# command, or after 30 minutes on their own if this script is killed.
set -uo pipefail
loops=()
stop() { kill "${loops[@]}" 2>/dev/null; wait "${loops[@]}" 2>/dev/null; }
trap stop EXIT
for _ in $(seq "$(nproc)"); do
  timeout 1800 bash -c 'while :; do :; done' &
  loops+=($!)
done
"$@"
