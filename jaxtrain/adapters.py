"""The trained / frozen split of a LoRA run's parameters: adapters (every ``lora_*`` subtree) train, the base stays.

Pure tree functions on the nested parameter dicts (arrays, ShapeDtypeStructs or shardings alike), shared by the
train state, the step, checkpoints and export.
"""

from __future__ import annotations

ADAPTER_PREFIX = "lora_"  # models/lora.py names each adapter lora_<target>


def is_adapter(key) -> bool:
    return isinstance(key, str) and key.startswith(ADAPTER_PREFIX)


def split_frozen(tree: dict) -> tuple[dict, dict | None]:
    """(trained, frozen): the adapters and the rest when the tree has adapters; else (tree, None)."""

    def walk(node: dict) -> tuple[dict, dict]:
        trained, frozen = {}, {}
        for key, value in node.items():
            if is_adapter(key):
                trained[key] = value
            elif isinstance(value, dict):
                inner_trained, inner_frozen = walk(value)
                if inner_trained:
                    trained[key] = inner_trained
                if inner_frozen:
                    frozen[key] = inner_frozen
            else:
                frozen[key] = value
        return trained, frozen

    trained, frozen = walk(tree)
    return (trained, frozen) if trained else (tree, None)


def join_frozen(frozen: dict | None, trained: dict) -> dict:
    """The inverse of ``split_frozen``."""
    if frozen is None:
        return trained
    out = dict(frozen)
    for key, value in trained.items():
        out[key] = join_frozen(out[key], value) if key in out else value
    return out
