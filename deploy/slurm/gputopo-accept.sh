#!/bin/sh
# gputopo accept --gate after a reboot, a driver upgrade or a GPU swap: the node earns its way back into
# service. Run it as root once slurmd is up (gputopo-accept.service, or by hand). It drains the node with
# gputopo's reason "gputopo: accepting" (unless someone else drained it: then it runs, reports and never
# resumes it), runs accept's steps, resumes the node only when accepted, and leaves a rejected node drained
# with the reason. Everything by absolute path: under systemd or slurmd there may be no PATH.
#
# With Slurm's own reboot: `scontrol reboot ASAP nextstate=DRAIN reason="gputopo: accepting" NODE` brings
# the node back drained under gputopo's reason, so no job lands on it before this script has accepted it.
GPUTOPO=/opt/gputopo/bin/gputopo
LOG=/var/log/gputopo-accept.log
STATE=/var/lib/gputopo/check-state.json
REPORTS=/var/lib/gputopo/accept
EXPECT_GPUS=8
BUDGET=1800
# DCGM's diagnostic folded in (1 quick, 2 medium, 3 long ~30 min, 4 extended); empty: not run.
DCGM_LEVEL=

set -- accept --gate --expect-gpus "$EXPECT_GPUS" --budget "$BUDGET" --state "$STATE" --report-dir "$REPORTS"
[ -n "$DCGM_LEVEL" ] && set -- "$@" --dcgm-level "$DCGM_LEVEL"
out=$("$GPUTOPO" "$@" 2>>"$LOG")  # warnings go to the log
rc=$?
# The first line is the verdict and its reason (ACCEPTED: ..., REJECTED: rejected at ...).
line=$(printf '%s\n' "$out" | /usr/bin/head -n 1)
printf '%s %s rc=%s %s\n' "$(/bin/date '+%Y-%m-%dT%H:%M:%S%z')" "${SLURMD_NODENAME:-$(/bin/hostname -s)}" "$rc" "$line" >> "$LOG"
printf '%s\n' "$line"
exit "$rc"
