#!/bin/sh
# Runs the lines of a queue file one at a time, never two at once, so that timed runs never
# share the machine with anything (tests go in as lines of their own, between runs).
#
#   nohup sh benchmarks/run_queue.sh /work/logs/queue >> /work/logs/queue.log 2>&1 &
#
# Each line is popped from the top when the one before it ends, so lines may be added or
# reordered while it runs (rewrite the file in place). A file "hold" beside the queue pauses it
# before the next line. Lines:
#   cmd SHELL COMMAND...                      any command (cd into a frozen worktree first)
#   explore COMMIT SETTING VARIANTS           benchmarks/explore_diloco.py from the worktree
#                                             $EXPLORE (default /work/explore) checked out at COMMIT
# It stops when the queue is empty.
queue=${1:?usage: run_queue.sh QUEUE_FILE}
dir=$(dirname "$queue")
while true; do
  while [ -e "$dir/hold" ]; do sleep 10; done
  line=$(head -n 1 "$queue" 2>/dev/null)
  if [ -z "$line" ]; then echo "$(date -u +%T) queue empty"; exit 0; fi
  tail -n +2 "$queue" > "$queue.tmp" && mv "$queue.tmp" "$queue"
  echo "$(date -u +%T) START $line"
  set -- $line
  kind=$1; shift
  case $kind in
    cmd) sh -c "$*" ;;
    # -f: result files a run left untracked that a later commit tracks (copied into it) are in the
    # way of the checkout otherwise; the worktree is the queue's alone
    explore) (cd "${EXPLORE:-/work/explore}" && git checkout -q -f --detach "$1" &&
              .venv/bin/python benchmarks/explore_diloco.py --setting "$2" --variants "$3") ;;
    *) echo "unknown line kind: $kind" ;;
  esac
  echo "$(date -u +%T) END rc=$? $line"
done
