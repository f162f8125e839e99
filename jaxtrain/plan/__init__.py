"""The planner: memory estimate and compiled figures (estimate), step-time model (step_cost), GPU targets for
compile-only plans (gpu_targets), and what XLA made of the step (hlo_report)."""
