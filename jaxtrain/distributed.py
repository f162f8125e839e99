"""Several processes, one job: ``jax.distributed.initialize`` from explicit flags or a cluster's
environment. Must run before anything asks jax for devices."""

from __future__ import annotations

import os

from jaxtrain.errors import UserError

# Environment variables that give the task count when a cluster manager started us (jax's own
# cluster detection then finds the coordinator): SLURM's srun, Open MPI's mpirun.
CLUSTER_TASK_COUNT_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")


def _cluster_tasks() -> int:
    return max((int(os.environ[v]) for v in CLUSTER_TASK_COUNT_VARS if os.environ.get(v, "").isdigit()), default=1)


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process job: with ``--coordinator HOST:PORT --num-processes N --process-id I``, or by
    jax's cluster auto-detection when a cluster manager started several tasks. Nothing otherwise."""
    flags = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    given = [k for k, v in flags.items() if v is not None]
    if given and len(given) < len(flags):
        missing = ", ".join(k for k in flags if k not in given)
        raise UserError(f"{', '.join(given)} given without {missing}; a multi-process run needs all three flags")
    if given and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id {process_id} is outside 0..{num_processes - 1} (--num-processes {num_processes})")
    if given and (":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit()):
        raise UserError(f"--coordinator {coordinator!r} must be HOST:PORT, e.g. 127.0.0.1:12355 (process 0's address)")
    if not given and _cluster_tasks() == 1:
        return

    import jax

    # CPU devices talk across processes through gloo; GPU and TPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if given:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    else:
        jax.distributed.initialize()
