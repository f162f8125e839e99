"""jaxtrain's default XLA flags (jaxtrain/xla_flags.py): set before jax starts, only for the jaxlib versions they
are for, never over a flag the user set. What the flag does to the compiled program: tests/test_plan_gpu.py."""

import os

from jaxtrain import xla_flags

FLAG = "--xla_gpu_enable_dynamic_slice_fusion"


def test_dynamic_slice_fusion_is_off_from_jaxlib_0_11_and_the_users_setting_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_flags.set_defaults("0.10.2") == []  # 0.10's XLA computes no gemm twice
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert xla_flags.set_defaults("0.11.2") == [f"{FLAG}=false"]
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}=false"
    assert xla_flags.set_defaults("0.11.2") == []  # once
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=true")
    assert xla_flags.set_defaults("1.2.0") == [] and os.environ["XLA_FLAGS"] == f"{FLAG}=true"
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flags.set_defaults("0.12.0") == [f"{FLAG}=false"] and os.environ["XLA_FLAGS"] == f"{FLAG}=false"
