#!/bin/bash
# The container command of scripts/k8s/train.yaml: `jaxtrain train "$@"` with the three multi-process
# flags derived from the pod's environment:
#   --process-id     JOB_COMPLETION_INDEX (set by Kubernetes in every pod of an Indexed Job: 0..N-1)
#   --num-processes  NUM_PROCESSES (the Job's completions, set in the manifest)
#   --coordinator    COORDINATOR_HOST:COORDINATOR_PORT (pod 0's DNS name under the headless service)
# `exec` makes jaxtrain the container's main process, so the SIGTERM of a pod eviction reaches it:
# it commits a checkpoint and exits 143, and the Job's podFailurePolicy restarts the pod, which resumes.
set -euo pipefail

: "${JOB_COMPLETION_INDEX:?not set: run this in a pod of an Indexed Job (completionMode: Indexed)}"
: "${NUM_PROCESSES:?not set: the manifest sets it to the completions of the Job}"
: "${COORDINATOR_HOST:?not set: the manifest sets it to JOB-0.SERVICE, pod 0 under the headless service}"

exec "${JAXTRAIN:-jaxtrain}" train "$@" \
    --coordinator "${COORDINATOR_HOST}:${COORDINATOR_PORT:-12355}" \
    --num-processes "${NUM_PROCESSES}" \
    --process-id "${JOB_COMPLETION_INDEX}"
