"""jaxtrain's defaults for XLA's environment (jaxtrain/xla_env.py): set before jax starts, only for the jaxlib
versions they are for, never over a setting the user made. What the flag does to the compiled program:
tests/test_plan_gpu.py; what the memory fraction does to a plan's verdict: tests/test_plan.py."""

import os

import pytest

from jaxtrain import xla_env
from jaxtrain.errors import UserError

FLAG = "--xla_gpu_enable_dynamic_slice_fusion"
FRACTION = f"XLA_CLIENT_MEM_FRACTION={xla_env.MEMORY_FRACTION}"


def test_dynamic_slice_fusion_is_off_from_jaxlib_0_11_and_the_users_setting_wins(monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_env.set_defaults("0.10.2") == []  # 0.10's XLA computes no gemm twice
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert xla_env.set_defaults("0.11.2") == [f"{FLAG}=false"]
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}=false"
    assert xla_env.set_defaults("0.11.2") == []  # once
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=true")
    assert xla_env.set_defaults("1.2.0") == [] and os.environ["XLA_FLAGS"] == f"{FLAG}=true"
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_env.set_defaults("0.12.0") == [f"{FLAG}=false"] and os.environ["XLA_FLAGS"] == f"{FLAG}=false"


def test_the_allocators_share_is_jaxtrains_unless_either_of_jaxs_names_sets_it(monkeypatch):
    for name in xla_env.MEMORY_FRACTION_NAMES:  # empty is unset, to jax too; setenv so teardown undoes set_defaults
        monkeypatch.setenv(name, "")
    assert xla_env.memory_fraction() == xla_env.JAX_MEMORY_FRACTION == 0.75  # what jax takes where nothing sets one
    assert xla_env.set_defaults("0.10.2") == [FRACTION]
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.92" and xla_env.memory_fraction() == 0.92
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")  # the older name: setting the new one too is jax's error
    assert xla_env.set_defaults("0.10.2") == [] and os.environ["XLA_CLIENT_MEM_FRACTION"] == ""
    assert xla_env.memory_fraction() == 0.8


def test_both_of_jaxs_names_set_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    with pytest.raises(UserError, match="unset XLA_PYTHON_CLIENT_MEM_FRACTION, the older name"):
        xla_env.memory_fraction()


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "most", "nan"])
def test_a_memory_fraction_outside_0_1_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", value)
    with pytest.raises(UserError, match=rf"XLA_CLIENT_MEM_FRACTION='{value}' is not a share of GPU memory in \(0, 1\]"):
        xla_env.set_defaults("0.10.2")


@pytest.mark.parametrize("value", ["1", "1.0", "0.5"])
def test_a_memory_fraction_in_0_1_is_the_users_whole_gpu_included(monkeypatch, value):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", value)
    assert xla_env.set_defaults("0.10.2") == [] and os.environ["XLA_CLIENT_MEM_FRACTION"] == value
    assert xla_env.memory_fraction() == float(value)


def test_the_command_stops_on_a_bad_memory_fraction_before_jax_starts(monkeypatch, tmp_path):
    from conftest import run_cli

    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "")  # in-process runs of the command in other tests set it
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "92%")
    result = run_cli("plan", "tiny", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION='92%' is not a share of GPU memory in (0, 1]" in result.stderr
