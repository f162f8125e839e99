"""Mixture-of-experts models from and to Hugging Face: Mixtral and Qwen2-MoE (a gated shared expert, top-k weights
not renormalised), tiny random models made here, imported onto the expert-parallel cpu8 mesh; logits equal
transformers'; the export loads back in transformers with the same logits."""

import dataclasses
import json

import jax
import pytest
import torch
import transformers

from conftest import small_config
from jaxtrain.interop import hf_config, hf_export, hf_import
from jaxtrain.layout import make_layout
from test_hf import SEQ, _assert_close, _hf_logits, _our_logits

SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, num_experts_per_tok=2)
MODELS = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(**SHAPE, intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        **SHAPE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
        norm_topk_prob=False)),
}


@pytest.mark.parametrize("name", MODELS)
def test_moe_import_equals_transformers_and_export_loads_back(name, tmp_path):
    model_cls, hf_cfg = MODELS[name]
    torch.manual_seed(0)
    reference = model_cls(hf_cfg).eval()
    with torch.no_grad():  # random everything, norms around 1
        for pname, p in reference.named_parameters():
            p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
    hf_dir = tmp_path / "hf"
    reference.save_pretrained(hf_dir)
    cfg = small_config("fsdp_tp_ep", (1, 2, 2, 1, 2))
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), SEQ))
    assert cfg.model.moe.num_experts == 4 and cfg.model.moe.num_shared_experts == (2 if name == "qwen2_moe" else 0)
    layout = make_layout(cfg)
    params = hf_import.load_params(hf_dir, cfg.model, layout.abstract_state().params)
    assert params["layers"]["mlp"]["w_gate"].sharding.spec[1] == "expert"
    ours = _our_logits(layout, params)
    _assert_close(ours, _hf_logits(reference))
    out = tmp_path / "export"
    hf_export.write_model(params, cfg, out, "float32", source_dir=hf_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    _assert_close(_hf_logits(reloaded), ours)
    assert jax.tree.structure(params) == jax.tree.structure(layout.abstract_state().params)
