"""The GPUs plans are made for: memory sizes, and XLA target descriptions for compiling without the GPU.

With jax's CUDA plugin installed (``pip install 'jaxtrain[gpu-plan]'``), XLA's GPU compiler runs on a
machine without a GPU: jax's compile-only topology gives devices of a described GPU model, in any
number, and the real train step compiles for them (fusion, buffer assignment and rematerialisation as
on the cluster; cuDNN attention included). The description is XLA's ``TargetConfig`` text proto; the
values below are the vendors' published figures for each model.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import UserError

MIB = 2**20
# Total memory per device as nvidia-smi reports it (MiB); the CUDA context and NCCL take some of it.
GPU_MEMORY_MIB = {"h100": 81559, "h200": 143771, "a100": 81920, "a100-40gb": 40960, "l4": 23034}
# Bytes/s one GPU sends per direction: to the GPUs of its node (NVLink; L4 nodes have only PCIe) and to
# other nodes (one InfiniBand NIC per GPU as in DGX/HGX systems: NDR 400 Gb/s for Hopper, HDR 200 Gb/s
# for A100; 100 GbE assumed for L4).
LINK_BYTES_PER_S = {"h100": (450e9, 50e9), "h200": (450e9, 50e9), "a100": (300e9, 25e9), "a100-40gb": (300e9, 25e9),
                    "l4": (32e9, 12.5e9)}


@dataclasses.dataclass(frozen=True)
class GpuModel:
    description: str  # the device kind jax reports
    compute_capability: tuple[int, int]
    sms: int
    fp32_cores_per_sm: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block_optin: int  # bytes
    l2_cache: int  # bytes
    memory_bandwidth: int  # bytes/s
    clock_ghz: float


# The models the planner can compile for without the GPU (the others are simulated with CPU devices).
GPU_MODELS = {
    "h100": GpuModel("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 50 * MIB, 3_352_320_000_000, 1.98),
    "h200": GpuModel("NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 50 * MIB, 4_800_000_000_000, 1.98),
    "a100": GpuModel("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 40 * MIB, 2_039_000_000_000, 1.41),
}


def gpu_memory_bytes(name: str) -> int:
    key = name.lower()
    if key not in GPU_MEMORY_MIB:
        raise UserError(f"unknown GPU '{name}'; known: {', '.join(GPU_MEMORY_MIB)} (or give --device-memory GiB)")
    return GPU_MEMORY_MIB[key] * MIB


def target_config(name: str) -> str:
    """XLA's ``TargetConfig`` text proto for the GPU model ``name`` (a key of GPU_MODELS)."""
    g = GPU_MODELS[name]
    major, minor = g.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {g.sms}
  fpus_per_core: {g.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {g.memory_bandwidth}
  l2_cache_size: {g.l2_cache}
  clock_rate_ghz: {g.clock_ghz}
  device_memory_size: {gpu_memory_bytes(name)}
  shared_memory_per_block_optin: {g.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 8
}}
device_description_str: "{g.description}"
"""


def compile_only_devices(name: str | None, count: int) -> list | None:
    """``count`` compile-only devices of GPU model ``name`` (8 per host), or None when the planner cannot
    compile for it here: no model given, a model without a description, or no CUDA plugin installed."""
    if name is None or name.lower() not in GPU_MODELS:
        return None
    from jax.experimental import topologies

    per_host = count if count <= 8 or count % 8 else 8
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(name.lower()),
                                                topology=f"1x{count // per_host}x{per_host}")
    except (NotImplementedError, RuntimeError):  # no CUDA plugin: jax has no topology factory for cuda
        return None
    return list(topology.devices)
