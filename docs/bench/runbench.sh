#!/bin/bash
# Run a command in its own autogroup with raised priority (the machine is shared; see
# ../shared/reference/peer-bench.md) and print the load average before and after it.
echo -10 > /proc/self/autogroup 2>/dev/null || echo "runbench: cannot raise autogroup priority (not root?)" >&2
echo "loadavg before: $(cat /proc/loadavg)" >&2
"$@"
rc=$?
echo "loadavg after:  $(cat /proc/loadavg)" >&2
exit $rc
