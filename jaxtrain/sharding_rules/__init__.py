"""YAML rule sets, one file each: each maps the model's logical axis names to a mesh axis (data, fsdp, tensor, stage,
expert), a list of them, or null (loaded by jaxtrain/partitioning.py). A file may start from another with
``extends: NAME`` (the pp_* sets on dp, fsdp and fsdp_tp; zero1 and zero2 on dp) and may place the optimizer state and
the gradients apart from the parameters in ``optimizer_state:`` / ``gradients:`` sections (ZeRO-1, ZeRO-2)."""
