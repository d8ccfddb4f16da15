# Shared helpers for the set-up scripts. Sourced, not run.
#
# The rule for every step: its full output goes to a log under $ACC_LOG_DIR, and a failure
# prints ONE line that says what is missing (network, compiler, root, ...) plus where the
# log is. Nobody should have to read a 500-line CMake or pip log to learn "no network".

ACC_LOG_DIR=${ACC_LOG_DIR:-"$PWD/build/setup-logs"}
mkdir -p "$ACC_LOG_DIR"

say()  { printf '[setup] %s\n' "$*"; }
die()  { printf 'setup error: %s\n' "$*" >&2; exit 1; }

# Can we reach the package index (PIP_INDEX_URL, else PyPI)? A few seconds at most.
index_reachable() {
    python3 - "${PIP_INDEX_URL:-https://pypi.org/simple/}" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5)
PY
}

# Explain a failed download/install from its log. Prints one cause, or nothing.
diagnose_log() {
    local log=$1
    # pip without retries says only "No matching distribution"; then ask the network itself.
    if grep -qE 'from versions: none|No matching distribution found' "$log" && ! index_reachable; then
        echo "no network: the package index could not be reached"
    elif grep -qiE 'Temporary failure in name resolution|Network is unreachable|Failed to establish a new connection|Could not resolve host|Connection timed out|NewConnectionError|ConnectTimeoutError|Could not connect to|Cannot initiate the connection' "$log"; then
        echo "no network: the package index could not be reached"
    elif grep -qiE 'No CMAKE_CXX_COMPILER could be found|command .?(c\+\+|g\+\+|gcc).? not found|unable to execute .?(gcc|g\+\+|c\+\+)|error: command .*(gcc|g\+\+|c\+\+).* failed: No such file' "$log"; then
        echo "no C++ compiler found (install g++, e.g. apt-get install g++)"
    elif grep -qiE 'No space left on device' "$log"; then
        echo "the disk is full"
    fi
}

# run_logged NAME WHAT CMD...: run CMD with its output in $ACC_LOG_DIR/NAME.log; on failure
# print one line naming WHAT failed, the likely cause and the log.
run_logged() {
    local name=$1 what=$2; shift 2
    local log="$ACC_LOG_DIR/$name.log"
    if ! "$@" >"$log" 2>&1; then
        local cause; cause=$(diagnose_log "$log")
        die "$what failed${cause:+: $cause} (full log: $log)"
    fi
}
