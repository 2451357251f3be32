#!/bin/bash
# usage: scripts/simulate_rev_time.sh REV -> the user CPU seconds of `kvmgr simulate --limit 3000`
# of the tree of REV (git archive from $REPO, default this checkout, into /tmp/tidy_rev_REV), and its hit ratio
# (issue 27, helper tidy: the bisection of the simulate slowdown, BENCHMARKS.md round 4 s10)
REPO=${REPO:-$(git rev-parse --show-toplevel)}
rev=$1; d=/tmp/tidy_rev_$rev
if [ ! -d $d ]; then mkdir -p $d && git -C "$REPO" archive $rev kvmgr | tar -x -C $d; fi
cd $d && /usr/bin/time -o $d.time -f "%U" env PYTHONPATH=$d python3 -m kvmgr.cli simulate --limit 3000 > $d.out 2>&1
echo "$rev $(git -C "$REPO" log -1 --format=%ad --date=format:%m-%d_%H:%M $rev) user $(cat $d.time) $(grep -o 'hit ratio.*%;' $d.out | head -1)"
