#!/bin/sh
# Slurm HealthCheckProgram for gputopo check (slurm.conf: HealthCheckProgram=/etc/slurm/gputopo-healthcheck.sh).
# slurmd runs it as root with no PATH and only SLURMD_NODENAME in the environment: every program by its
# absolute path. Each run appends ONE timestamped line to the log (the verdict and reason, what was done to
# the node or held back, and the exit code) and prints the same line on stdout, where slurmd's own log
# shows it when the program exits non-zero. gputopo drains or resumes the node itself (--drain,
# --resume-if-healthy): never a node an administrator drained, never more than --max-drained nodes.
GPUTOPO=/opt/gputopo/bin/gputopo
LOG=/var/log/gputopo-check.log
STATE=/var/lib/gputopo/check-state.json
EXPECT_GPUS=8

out=$("$GPUTOPO" check --format npd --max-output-length 400 --budget 20 --expect-gpus "$EXPECT_GPUS" \
    --state "$STATE" --drain --resume-if-healthy 2>&1)
rc=$?
line=$(printf '%s' "$out" | /usr/bin/tr '\n' ' ' | /usr/bin/tr -s ' ')
printf '%s %s rc=%s %s\n' "$(/bin/date '+%Y-%m-%dT%H:%M:%S%z')" "${SLURMD_NODENAME:-?}" "$rc" "$line" >> "$LOG"
printf '%s\n' "$line"
exit "$rc"
