#!/usr/bin/env bash
# Emulated multi-node cluster on one machine: network namespaces as nodes, a bridge as the
# switch, tc as the link. See --help and README.md in this directory.
set -euo pipefail

CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/lib.sh
source "$CLUSTER_DIR/lib.sh"

PROG=cluster.sh
IP_TIMEOUT=10          # seconds for any single ip/tc call; they never legitimately take long
KILL_GRACE=10          # seconds between TERM and KILL for a job or a process left in a node

usage() {
    cat <<EOF
Usage: $PROG COMMAND [ARGS]

Emulate N machines on this one: each node is a network namespace ${ACC_PREFIX}nodeK with one
interface '$ACC_IFACE' (address 198.18.0.K/24, hostname nodeK), all plugged into a bridge
in namespace $ACC_SWITCH_NS. Every node's link is shaped with tc both ways.

Commands:
  up N [--rate RATE] [--delay DELAY]
        Create nodes node1..nodeN (1 <= N <= $ACC_MAX_NODES), first removing any leftovers
        of an earlier run with the same prefix.
        RATE:  per-node link rate, each direction: <int>bit|kbit|mbit|gbit, or
               'unlimited' (default 1gbit). Shaped by tbf on the node's egress (upload)
               and on its switch port's egress (download).
        DELAY: one-way latency added to every packet a node sends (netem on the node's
               egress; node-to-node RTT = 2 x DELAY): <num>us|ms|s, or 0 (default).
               Refused if the kernel has no netem qdisc.
  down  Remove every namespace, /etc/netns entry and state file with our prefix, after
        stopping the processes still inside those namespaces. Safe to run any time.
  exec NODE [--] CMD [ARGS...]
        Run CMD inside NODE (e.g. node1, the head) with hostname NODE, this working
        directory and environment, and $CLUSTER_DIR/bin (the stand-in
        ssh) first on PATH, so horovodrun/mpirun launched there reach the other nodes.
  run N [--rate RATE] [--delay DELAY] [--timeout SECONDS] [--] CMD [ARGS...]
        up N, exec node1 CMD, down. Tears down on exit, error, Ctrl-C or TERM. SECONDS
        limits CMD (TERM, then KILL $KILL_GRACE s later); 0 = no limit (default).
        Exit status: CMD's, or 124 if it timed out.
  link NODE down|up
        Cut NODE's link (its switch port goes down: frames both ways are dropped silently,
        as with a pulled cable; the node's own interface and address stay) or restore it.
  rate NODE RATE
        Change NODE's link rate both ways while jobs run (a slowed or congested link);
        'rate NODE <the rate of up>' restores it.
  status
        Show the nodes and their qdiscs.
  -h, --help
        This text.

Environment:
  ACC_CLUSTER_PREFIX   name prefix of everything created (default 'acc-'). Clusters with
                       different prefixes are independent and can be up at the same time.

Example (2 nodes, 100 Mbit/s links, Gloo across them):
  sudo $PROG run 2 --rate 100mbit --timeout 600 -- \\
      horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces $ACC_IFACE python train.py

Horovod Elastic: discover_hosts.sh prints $ACC_STATE_DIR/hosts ('nodeK:1' per line,
written by 'up'); edit that file to remove or add hosts while a job runs.
EOF
}

die() { echo "$PROG: $*" >&2; exit 1; }

# ---------------------------------------------------------------- checks

# Refuse early, with one line, rather than fail halfway through building the cluster.
require_root_and_tools() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    local tool_package tool
    for tool_package in ip:iproute2 tc:iproute2 unshare:util-linux timeout:coreutils; do
        tool=${tool_package%%:*}
        command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found on PATH (package ${tool_package#*:})"
    done
}

# RATE -> bits per second on stdout; 0 for unlimited.
parse_rate() {
    local rate=$1
    if [[ "$rate" == unlimited ]]; then echo 0; return; fi
    [[ "$rate" =~ ^([1-9][0-9]{0,5})(bit|kbit|mbit|gbit)$ ]] \
        || die "bad --rate '$rate': use e.g. 100mbit, 1gbit, 500kbit or 'unlimited'"
    local n=${BASH_REMATCH[1]}
    case "${BASH_REMATCH[2]}" in
        bit) echo "$n" ;;
        kbit) echo $((n * 1000)) ;;
        mbit) echo $((n * 1000000)) ;;
        gbit) echo $((n * 1000000000)) ;;
    esac
}

check_delay() {
    [[ "$1" =~ ^(0|[0-9]+(\.[0-9]+)?(us|ms|s))$ ]] || die "bad --delay '$1': use e.g. 1ms, 200us or 0"
}

check_node_count() {
    if ! [[ "$1" =~ ^[1-9][0-9]*$ ]] || (($1 > ACC_MAX_NODES)); then
        die "node count must be 1..$ACC_MAX_NODES, got '$1'"
    fi
}

# ---------------------------------------------------------------- teardown

# Our namespaces: exactly <prefix>nodeK and <prefix>switch, nothing else.
our_namespaces() {
    timeout "$IP_TIMEOUT" ip netns list | awk '{print $1}' \
        | grep -E "^${ACC_PREFIX}(node[0-9]+|switch)\$" || true
}

# A namespace lives on while a process is inside it, even after `ip netns delete`, so a
# crashed run's workers would keep its interfaces alive. Stop them first.
stop_processes_in() {
    local ns=$1 pids waited=0
    pids="$(timeout "$IP_TIMEOUT" ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)"
    [[ -n "${pids// }" ]] || return 0
    # shellcheck disable=SC2086  # word splitting of the pid list is intended
    kill -TERM $pids 2>/dev/null || true
    while ((waited < KILL_GRACE * 10)); do
        pids="$(timeout "$IP_TIMEOUT" ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)"
        [[ -n "${pids// }" ]] || return 0
        sleep 0.1; waited=$((waited + 1))
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

teardown() {
    local ns
    for ns in $(our_namespaces); do
        stop_processes_in "$ns"
        # Deleting a namespace destroys the interfaces in it; each veth pair has one end
        # in a node and one in the switch, so nothing is left in the root namespace.
        timeout "$IP_TIMEOUT" ip netns delete "$ns" 2>/dev/null || true
    done
    # Config and state of namespaces that no longer exist (or never got created).
    rm -rf /etc/netns/"${ACC_PREFIX}"node[0-9]* /etc/netns/"${ACC_PREFIX}switch" "$ACC_STATE_DIR"
    rmdir /etc/netns 2>/dev/null || true
    local left
    left="$(our_namespaces)"
    [[ -z "$left" ]] || die "could not delete namespaces: $left"
}

# ---------------------------------------------------------------- up

ipn() { timeout "$IP_TIMEOUT" ip -n "$@"; }
tcn() { timeout "$IP_TIMEOUT" tc -n "$@"; }

# Shape egress of DEV in namespace NS to RATE_BPS (0 = unlimited) plus DELAY (0 = none).
shape() {
    local ns=$1 dev=$2 rate_bps=$3 delay=$4
    if ((rate_bps > 0)); then
        # burst: 1 ms at line rate, at least 16 KiB. Small, so that even small messages
        # (compressed gradients) pay for their size as on a real link; tbf splits larger
        # GSO packets itself. latency: queue at most 50 ms before dropping.
        local burst=$((rate_bps / 8 / 1000))
        ((burst >= 16384)) || burst=16384
        tcn "$ns" qdisc replace dev "$dev" root handle 1: tbf rate "${rate_bps}bit" burst "$burst" latency 50ms
        if [[ "$delay" != 0 ]]; then
            tcn "$ns" qdisc replace dev "$dev" parent 1:1 handle 10: netem delay "$delay" limit 100000
        fi
    elif [[ "$delay" != 0 ]]; then
        tcn "$ns" qdisc replace dev "$dev" root handle 10: netem delay "$delay" limit 100000
    fi
}

# This kernel may lack netem (CONFIG_NET_SCH_NETEM), as the development machine does.
# Without it a delay cannot be emulated; say so instead of silently running without one.
require_netem() {
    tcn "$ACC_SWITCH_NS" qdisc add dev lo root netem delay 1ms >/dev/null 2>&1 \
        || die "--delay needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); use --delay 0"
    tcn "$ACC_SWITCH_NS" qdisc del dev lo root
}

create_switch() {
    timeout "$IP_TIMEOUT" ip netns add "$ACC_SWITCH_NS"
    ipn "$ACC_SWITCH_NS" link set lo up
    # The bridge lives in its own namespace, not the root one, so the emulation never
    # adds interfaces or addresses to the machine's real network stack.
    ipn "$ACC_SWITCH_NS" link add br0 type bridge forward_delay 0 stp_state 0
    ipn "$ACC_SWITCH_NS" link set br0 up
    # Bridged frames need not pass through (empty) iptables chains; best effort, the
    # sysctl is absent without br_netfilter.
    timeout "$IP_TIMEOUT" ip netns exec "$ACC_SWITCH_NS" \
        sh -c 'echo 0 > /proc/sys/net/bridge/bridge-nf-call-iptables' 2>/dev/null || true
}

write_hosts_file() {
    local ns=$1 node=$2 nodes=$3 k
    mkdir -p "/etc/netns/$ns"
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        for ((k = 1; k <= nodes; k++)); do
            echo "$(acc_node_addr "$k") node$k"
        done
    } > "/etc/netns/$ns/hosts"
    # `ip netns exec` bind-mounts this over /etc/hostname, for tools that read the file;
    # only if that exists, or the bind mount (and so every exec in the node) would fail.
    if [[ -e /etc/hostname ]]; then echo "$node" > "/etc/netns/$ns/hostname"; fi
}

create_node() {
    local k=$1 nodes=$2 rate_bps=$3 delay=$4
    local node="node$k" ns port="p$k"
    ns="$(acc_node_ns "$node")"
    timeout "$IP_TIMEOUT" ip netns add "$ns"
    ipn "$ns" link set lo up
    # One veth pair per node: '$port' on the switch side, '$ACC_IFACE' on the node side.
    ipn "$ACC_SWITCH_NS" link add "$port" type veth peer name "$ACC_IFACE" netns "$ns"
    ipn "$ACC_SWITCH_NS" link set "$port" master br0
    ipn "$ACC_SWITCH_NS" link set "$port" up
    ipn "$ns" addr add "$(acc_node_addr "$k")/24" dev "$ACC_IFACE"
    ipn "$ns" link set "$ACC_IFACE" up
    shape "$ns" "$ACC_IFACE" "$rate_bps" "$delay"           # upload, plus the delay
    shape "$ACC_SWITCH_NS" "$port" "$rate_bps" 0            # download
    write_hosts_file "$ns" "$node" "$nodes"
}

# node1 must reach every node: a TCP connect to a closed port is refused at once when the
# peer is reachable, and times out when it is not. Needs no tool beyond bash.
check_reachable() {
    local nodes=$1 k
    for ((k = 2; k <= nodes; k++)); do
        timeout 5 ip netns exec "$(acc_node_ns node1)" \
            bash -c "exec 3<>/dev/tcp/$(acc_node_addr "$k")/9" 2>/dev/null && continue
        (($? != 124)) || die "node1 cannot reach node$k"
    done
}

cluster_up() {
    local nodes=$1 rate=$2 delay=$3 rate_bps k
    check_node_count "$nodes"
    rate_bps="$(parse_rate "$rate")"
    check_delay "$delay"
    teardown
    # Any failure or interrupt from here on must not leave a half-built cluster.
    trap 'teardown; exit 130' INT
    trap 'teardown; exit 143' TERM
    trap 'rc=$?; if ((rc)); then teardown; fi' EXIT
    create_switch
    if [[ "$delay" != 0 ]]; then require_netem; fi
    for ((k = 1; k <= nodes; k++)); do
        create_node "$k" "$nodes" "$rate_bps" "$delay"
    done
    check_reachable "$nodes"
    mkdir -p "$ACC_STATE_DIR"
    echo "$nodes $rate $delay" > "$ACC_STATE_DIR/config"
    for ((k = 1; k <= nodes; k++)); do echo "node$k:1"; done > "$ACC_STATE_DIR/hosts"
    # `run` goes straight on to its own traps: no moment without one.
    if ((${ACC_RUNNING:-0})); then set_run_traps; else trap - INT TERM EXIT; fi
    echo "$PROG: up: node1..node$nodes (${ACC_PREFIX}node*), rate $rate, delay $delay, interface $ACC_IFACE"
}

# Parse `N [--rate R] [--delay D] [--timeout S] [--] [CMD...]`; sets the globals below.
parse_up_args() {
    opt_nodes="" opt_rate=1gbit opt_delay=0 opt_timeout=0 opt_cmd=()
    local allow_cmd=$1; shift
    while (($#)); do
        case "$1" in
            --rate) (($# >= 2)) || die "--rate needs a value"; opt_rate=$2; shift 2 ;;
            --rate=*) opt_rate=${1#*=}; shift ;;
            --delay) (($# >= 2)) || die "--delay needs a value"; opt_delay=$2; shift 2 ;;
            --delay=*) opt_delay=${1#*=}; shift ;;
            --timeout) (($# >= 2)) || die "--timeout needs a value"; opt_timeout=$2; shift 2 ;;
            --timeout=*) opt_timeout=${1#*=}; shift ;;
            --) shift; opt_cmd=("$@"); break ;;
            -*) die "unknown option '$1' (see --help)" ;;
            *)
                if [[ -z "$opt_nodes" ]]; then opt_nodes=$1; shift
                elif ((allow_cmd)); then opt_cmd=("$@"); break
                else die "unexpected argument '$1' (see --help)"
                fi ;;
        esac
    done
    [[ -n "$opt_nodes" ]] || die "missing node count (see --help)"
    [[ "$opt_timeout" =~ ^[0-9]+$ ]] || die "bad --timeout '$opt_timeout': whole seconds, 0 = none"
}

# ---------------------------------------------------------------- exec / run

node_exists() { [[ "$1" =~ ^node[1-9][0-9]*$ && -e "/run/netns/$(acc_node_ns "$1")" ]]; }

# Replace this process with CMD inside NODE. The head's shell keeps the caller's cwd and
# environment (unlike bin/ssh, which emulates a fresh login on the other nodes).
exec_in_node() {
    local node=$1; shift
    node_exists "$node" || die "no node '$node' (is the cluster up? '$PROG status')"
    (($#)) || die "exec: missing command"
    export PATH="$CLUSTER_DIR/bin:$PATH" ACC_CLUSTER_PREFIX="$ACC_PREFIX"
    acc_in_node "$node" "$@"
}

# The traps of `run` once the cluster is up (job and status are cmd_run's globals).
set_run_traps() {
    trap 'teardown' EXIT
    trap '[[ -n "$job" ]] && kill -TERM "$job" 2>/dev/null; status=143' TERM
    trap '[[ -n "$job" ]] && kill -TERM "$job" 2>/dev/null; status=130' INT
    trap '[[ -n "$job" ]] && kill -TERM "$job" 2>/dev/null; status=129' HUP
}

cmd_run() {
    parse_up_args 1 "$@"
    ((${#opt_cmd[@]})) || die "run: missing command after the node count"
    ACC_RUNNING=1 job="" status=0
    cluster_up "$opt_nodes" "$opt_rate" "$opt_delay"
    # The job runs in the background so that this shell can react to signals while it
    # waits. `timeout` makes the job its own process group, forwards TERM/INT to it, and
    # KILLs it KILL_GRACE seconds after a time-out or a forwarded signal. Processes that
    # escaped the group (Horovod starts workers with setsid) die in teardown.
    # set_run_traps (installed by cluster_up as it finishes) is in place before the job
    # starts: a signal in between must not kill this shell untrapped. It always forwards
    # TERM: a background job of a non-interactive shell starts with SIGINT ignored, so a
    # forwarded INT would not stop horovodrun.
    (exec_in_node node1 timeout --kill-after="$KILL_GRACE" "$opt_timeout" "${opt_cmd[@]}") &
    job=$!
    if ((status)); then kill -TERM "$job" 2>/dev/null; fi  # signalled before the job existed
    while kill -0 "$job" 2>/dev/null; do
        local rc=0
        wait "$job" || rc=$?
        # A trapped signal interrupts `wait` with 128+N while the job still runs; keep
        # waiting (bounded by timeout's kill-after) and report the signal afterwards.
        if ! kill -0 "$job" 2>/dev/null && ((status == 0)); then status=$rc; fi
    done
    exit "$status"
}

# Faults on a running cluster: a link that goes down and comes back, a link that slows down.
cmd_link() {
    (($# == 2)) || die "link takes NODE and 'down' or 'up'"
    node_exists "$1" || die "no node '$1' (is the cluster up? '$PROG status')"
    [[ "$2" == down || "$2" == up ]] || die "link: state must be 'down' or 'up', got '$2'"
    ipn "$ACC_SWITCH_NS" link set "p${1#node}" "$2"
}

cmd_rate() {
    (($# == 2)) || die "rate takes NODE and RATE"
    node_exists "$1" || die "no node '$1' (is the cluster up? '$PROG status')"
    local rate_bps
    rate_bps="$(parse_rate "$2")"
    ((rate_bps > 0)) || die "rate: 'unlimited' cannot be set on a running cluster; give a rate"
    local delay=0
    if [[ -r "$ACC_STATE_DIR/config" ]]; then read -r _ _ delay < "$ACC_STATE_DIR/config"; fi
    shape "$(acc_node_ns "$1")" "$ACC_IFACE" "$rate_bps" "$delay"
    shape "$ACC_SWITCH_NS" "p${1#node}" "$rate_bps" 0
}

cmd_status() {
    local ns
    if [[ -r "$ACC_STATE_DIR/config" ]]; then
        read -r n rate delay < "$ACC_STATE_DIR/config"
        echo "cluster '${ACC_PREFIX}': $n nodes, rate $rate, delay $delay"
    else
        echo "cluster '${ACC_PREFIX}': not up"
    fi
    for ns in $(our_namespaces); do
        echo "== $ns"
        ipn "$ns" -brief addr show 2>/dev/null | sed 's/^/   /'
        tcn "$ns" qdisc show 2>/dev/null | grep -v 'qdisc noqueue' | sed 's/^/   /' || true
    done
}

main() {
    local cmd="${1:-}"
    case "$cmd" in
        ""|-h|--help|help) usage; return ;;
        up|down|exec|run|link|rate|status) shift ;;
        *) die "unknown command '$cmd' (see --help)" ;;
    esac
    require_root_and_tools
    case "$cmd" in
        up) parse_up_args 0 "$@"; cluster_up "$opt_nodes" "$opt_rate" "$opt_delay" ;;
        down) (($# == 0)) || die "down takes no arguments"; teardown ;;
        exec)
            (($#)) || die "exec: missing node"
            local node=$1; shift
            if [[ "${1:-}" == -- ]]; then shift; fi
            exec_in_node "$node" "$@" ;;
        run) cmd_run "$@" ;;
        link) cmd_link "$@" ;;
        rate) cmd_rate "$@" ;;
        status) cmd_status ;;
    esac
}

main "$@"
