#!/usr/bin/env bash
# Horovod Elastic host discovery for the emulated cluster:
#   horovodrun --min-np 1 --max-np 2 --host-discovery-script benchmarks/cluster/discover_hosts.sh ...
# Prints one 'host:slots' line per available node. The list is a file ('up' writes
# node1:1 .. nodeN:1 to /run/<prefix>cluster/hosts), so a test or a person can remove or
# add a host while the job runs: Horovod calls this script every second or so.
# ACC_CLUSTER_HOSTS_FILE overrides the file.
set -euo pipefail
prefix="${ACC_CLUSTER_PREFIX:-acc-}"
hosts_file="${ACC_CLUSTER_HOSTS_FILE:-/run/${prefix}cluster/hosts}"
[[ -r "$hosts_file" ]] || { echo "discover_hosts.sh: no $hosts_file (is the cluster up?)" >&2; exit 1; }
# Skip blank lines and comments; Horovod rejects lines it cannot parse.
grep -Ev '^[[:space:]]*(#|$)' "$hosts_file" || true
