"""Quantized training (``model.quant=int8|fp8``) with qwix's ``QtProvider``: the matmuls inside the layers run
on quantized operands (int8: both int8, scales per channel; fp8: e4m3 forward, e5m2 gradients), the
parameters and optimizer state stay float32 and the logits projection stays in the compute dtype.

qwix intercepts the einsums and matmuls the model's layers call while it traces them. It tells a weight from an
activation by finding the array among the module's parameters; ours are cast to the compute dtype (and sliced
by the layer scan) before use, so it sees two activations and quantizes both operands dynamically, the same as
a weight would be for a QT rule with matching types. The attention core's two products (query-key scores,
probabilities-values) are einsums in the same module as the projections, so they are quantized too: qwix's
rules match a module path and an op name, and both are ``einsum`` under ``layers/attn``.
"""

from __future__ import annotations

import jax.numpy as jnp
import qwix
from flax import nnx

# forward and backward types of each model.quant (jaxtrain/models/config.py QUANT_TYPES names them)
QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
LAYER_MATMULS = "layers/.*"  # qwix module paths: the scanned blocks, not the embedding or the logits


def quantized(model: nnx.Module, quant: str) -> nnx.Module:
    """The model with qwix's quantized-training interception on its layers' matmuls; itself for ``none``."""
    if quant == "none":
        return model
    forward, backward = QTYPES[quant]
    rule = qwix.QtRule(module_path=LAYER_MATMULS, weight_qtype=forward, act_qtype=forward, bwd_qtype=backward)
    # qwix intercepts one method: ``hidden`` runs the layers both for ``__call__`` and for the chunked loss
    # (train.loss_chunk), which calls it directly. Its first call would only create the rule's calibration statistics,
    # which dynamic (per-call) scaling has none of, so it is skipped: a call here traced the attention the config names,
    # and cuDNN's (jaxtrain plan --gpu / --device-memory on a machine without one) stopped with a traceback
    return qwix.quantize_model(model, qwix.QtProvider([rule]), jnp.zeros((1, 2), jnp.int32), methods=("hidden",),
                               skip_nnx_init=True)
