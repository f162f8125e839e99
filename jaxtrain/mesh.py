"""Build the device mesh from a MeshConfig with jax's own mesh utilities."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxtrain.config import CPU_MAX_DEVICES, MESH_AXES, AxisSizes, MeshConfig, describe_axes
from jaxtrain.errors import UserError


def _fill(sizes: AxisSizes, total: int, what: str) -> tuple[int, ...]:
    shape = list(sizes.as_tuple())
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if total % known:
            raise UserError(f"cannot fill the -1 axis of {what}: {total} is not divisible by {known}, the product of the other axes")
        shape[shape.index(-1)] = total // known
    return tuple(shape)


def _describe(shape: tuple[int, ...]) -> str:
    return describe_axes(dict(zip(MESH_AXES, shape)))


def resolve_shape(mesh_cfg: MeshConfig, num_devices: int, num_processes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ici_shape, dcn_shape) with -1 filled in; raises UserError if they do not cover the devices."""
    if num_processes == 1:  # one process holds every device: the two levels multiply
        combined = AxisSizes(*(-1 if -1 in (i, d) else i * d for i, d in zip(mesh_cfg.ici.as_tuple(), mesh_cfg.dcn.as_tuple())))
        if combined.as_tuple().count(-1) > 1:
            raise UserError(f"the mesh has more than one -1 axis ({combined}); fix all but one axis size")
        combined = _fill(combined, num_devices, "the mesh")
        if math.prod(combined) != num_devices:
            raise UserError(
                f"the mesh has {math.prod(combined)} devices ({_describe(combined)}) but {num_devices} "
                f"device(s) are present; use a mesh file for {num_devices} devices, or on CPU pass --devices {math.prod(combined)}")
        return combined, (1,) * len(MESH_AXES)
    local = num_devices // num_processes
    ici = _fill(mesh_cfg.ici, local, "ici")
    dcn = _fill(mesh_cfg.dcn, num_processes, "dcn")
    if math.prod(ici) != local or math.prod(dcn) != num_processes:
        raise UserError(
            f"the mesh has ici {_describe(ici)} per process and dcn {_describe(dcn)} across processes, but there are "
            f"{num_processes} processes with {local} devices each; make ici cover one process and dcn the process count")
    return ici, dcn


def device_array(mesh_cfg: MeshConfig, devices: list, num_processes: int) -> np.ndarray:
    """``devices`` arranged on the axes (data, fsdp, tensor, stage, expert); with several processes each axis is its dcn
    size of process blocks (outer) times its ici size within a process (inner). Apart from build_mesh so that a
    multi-process arrangement can be checked in one process."""
    ici, dcn = resolve_shape(mesh_cfg, len(devices), num_processes)
    if num_processes == 1:
        return np.asarray(mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True))
    return np.asarray(mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True))


def build_mesh(mesh_cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """An Auto-typed (GSPMD) mesh with axes (data, fsdp, tensor, stage, expert) over ``devices`` (default: all);
    hybrid ICI/DCN across processes."""
    devices = devices or jax.devices()
    if devices[0].platform == "cpu" and len(devices) > CPU_MAX_DEVICES:  # a plan's or a CPU run's: its compile fails
        raise UserError(f"a mesh of {len(devices)} CPU devices: XLA:CPU compiles programs for at most {CPU_MAX_DEVICES} devices; "
                        f"use a mesh of at most {CPU_MAX_DEVICES} (fewer nodes across: a smaller mesh.dcn axis)")
    array = device_array(mesh_cfg, devices, jax.process_count())
    return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
