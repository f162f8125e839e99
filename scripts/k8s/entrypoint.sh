#!/bin/bash
# The container command of scripts/k8s/train.yaml: `jaxtrain train "$@"` with the three multi-process
# flags derived from the pod's environment:
#   --process-id     JOB_COMPLETION_INDEX (set by Kubernetes in every pod of an Indexed Job: 0..N-1)
#   --num-processes  NUM_PROCESSES (the Job's completions, set in the manifest)
#   --coordinator    COORDINATOR_HOST:COORDINATOR_PORT (pod 0's DNS name under the headless service)
# `exec` makes jaxtrain the container's main process, so the SIGTERM of a pod eviction reaches it:
# it commits a checkpoint and exits 143, and the Job's podFailurePolicy restarts the pod, which resumes.
# jaxtrain's exit status is the container's, unchanged.
#
# A mistake in the manifest or the image (a variable missing or malformed, no jaxtrain to run) is one line
# on stderr and exit 2: the podFailurePolicy's FailJob code, since every retry would fail the same way
# (bash's own errors exit 1 or 127, which the Job retries up to backoffLimit).
set -euo pipefail

fail() { echo "entrypoint.sh: $*" >&2; exit 2; }

[[ -n ${JOB_COMPLETION_INDEX-} ]] || fail "JOB_COMPLETION_INDEX: not set: run this in a pod of an Indexed Job (completionMode: Indexed)"
[[ -n ${NUM_PROCESSES-} ]] || fail "NUM_PROCESSES: not set: the manifest sets it to the completions of the Job"
[[ -n ${COORDINATOR_HOST-} ]] || fail "COORDINATOR_HOST: not set: the manifest sets it to JOB-0.SERVICE, pod 0 under the headless service"
COORDINATOR_PORT=${COORDINATOR_PORT:-12355}
# at most 9 digits: bash's arithmetic below cannot overflow; 10# reads 08 as eight, not as bad octal
[[ $NUM_PROCESSES =~ ^[0-9]{1,9}$ ]] && (( 10#$NUM_PROCESSES >= 1 )) ||
    fail "NUM_PROCESSES='$NUM_PROCESSES' is not a positive integer: set it to the completions of the Job in the manifest"
[[ $JOB_COMPLETION_INDEX =~ ^[0-9]{1,9}$ ]] && (( 10#$JOB_COMPLETION_INDEX < 10#$NUM_PROCESSES )) ||
    fail "JOB_COMPLETION_INDEX='$JOB_COMPLETION_INDEX' is not a process index 0..$((10#$NUM_PROCESSES - 1)) (NUM_PROCESSES=$NUM_PROCESSES): completions, parallelism and NUM_PROCESSES in the manifest must agree"
[[ $COORDINATOR_PORT =~ ^[0-9]{1,5}$ ]] && (( 10#$COORDINATOR_PORT >= 1 && 10#$COORDINATOR_PORT <= 65535 )) ||
    fail "COORDINATOR_PORT='$COORDINATOR_PORT' is not a port 1..65535: set it to the headless service's port in the manifest"

# A jaxtrain that is missing, not executable, or whose #! interpreter is missing (a virtual environment copied
# into the image from another path) would make `exec` fail with 126/127 and a raw bash error.
JAXTRAIN=${JAXTRAIN:-jaxtrain}
JAXTRAIN_PATH=$(command -v "$JAXTRAIN") ||
    fail "cannot run '$JAXTRAIN' (not on PATH, or not executable): install jaxtrain in the image (pip install -e .), or set JAXTRAIN=/path/to/bin/jaxtrain"
if [[ -f $JAXTRAIN_PATH ]] && IFS= read -r -n 512 SHEBANG < "$JAXTRAIN_PATH" 2> /dev/null && [[ $SHEBANG == '#!'* ]]; then
    read -r INTERPRETER _ <<< "${SHEBANG#??}"
    [[ -x $INTERPRETER ]] ||
        fail "cannot run '$JAXTRAIN_PATH': its interpreter '$INTERPRETER' does not exist (a virtual environment moved after it was created?); reinstall jaxtrain in the image"
fi

exec "$JAXTRAIN_PATH" train "$@" \
    --coordinator "${COORDINATOR_HOST}:${COORDINATOR_PORT}" \
    --num-processes "${NUM_PROCESSES}" \
    --process-id "${JOB_COMPLETION_INDEX}"
