# Shared by cluster.sh and bin/ssh: naming, addressing and "run a command inside a node".
# Sourced, not executed. Expects `set -euo pipefail` from the caller.
# shellcheck shell=bash disable=SC2034  # the variables are used by the sourcing scripts

# Every name this emulation creates starts with this prefix, so teardown can delete exactly
# its own namespaces and nothing else. Tests use a different prefix so that they never touch
# a cluster a benchmark has up.
ACC_PREFIX="${ACC_CLUSTER_PREFIX:-acc-}"
if [[ ! "$ACC_PREFIX" =~ ^[a-z][a-z0-9]{0,11}-$ ]]; then
    echo "cluster: ACC_CLUSTER_PREFIX must look like 'acc-' (lowercase letters/digits, ending in '-'), got '$ACC_PREFIX'" >&2
    exit 2
fi

# The node interface has the same name in every node, as on a real cluster where
# `horovodrun --network-interfaces hvd0` names one NIC valid on all hosts.
ACC_IFACE=hvd0
ACC_SWITCH_NS="${ACC_PREFIX}switch"
ACC_STATE_DIR="/run/${ACC_PREFIX}cluster"   # nodes count, rate, Elastic hosts file
ACC_MAX_NODES=250

# Node K has address 198.18.0.K. 198.18.0.0/15 is reserved for network benchmarks
# (RFC 2544) and lives only inside our namespaces, so it cannot clash with real networks.
acc_node_addr() { printf '198.18.0.%d' "$1"; }
acc_node_ns() { printf '%s%s' "$ACC_PREFIX" "$1"; }

# acc_in_node NODE CMD [ARGS...]: exec CMD inside NODE's network namespace with hostname
# NODE. `ip netns exec` also bind-mounts /etc/netns/<ns>/hosts over /etc/hosts. The
# hostname needs a private UTS namespace: Gloo advertises the address its hostname
# resolves to, so with the machine's shared hostname every node would say 127.0.0.1.
# Everything is exec'd (no fork), so the caller's process group and signals reach CMD.
acc_in_node() {
    local node=$1; shift
    # shellcheck disable=SC2016  # $0 and $@ are for the inner sh
    exec ip netns exec "$(acc_node_ns "$node")" \
        unshare --uts -- sh -c 'printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"' "$node" "$@"
}
