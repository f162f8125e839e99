"""Mixture-of-experts models from and to Hugging Face: Mixtral and Qwen2-MoE (a gated shared expert, top-k weights
not renormalised), tiny random models made here, imported onto the expert-parallel cpu8 mesh; logits equal
transformers'; the export loads back in transformers with the same logits."""

import dataclasses
import json

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from conftest import small_config
from jaxtrain.errors import UserError
from jaxtrain.models.config import MoEConfig
from jaxtrain.models.moe import router_stats
from jaxtrain.interop import hf_config, hf_export, hf_import
from jaxtrain.layout import make_layout
from test_hf import SEQ, _assert_close, _hf_logits, _our_logits

SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, num_experts_per_tok=2)
MODELS = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(**SHAPE, intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
        **SHAPE | dict(num_experts_per_tok=3), intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_experts=4, norm_topk_prob=False)),
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
    # the source's config.json comes back as it was on every key it sets (Qwen2-MoE's intermediate_size was the
    # experts'), but the load-balancing coefficient: the run's own (README, "Losses")
    source, exported = (json.loads((d / "config.json").read_text()) for d in (hf_dir, out))
    changed = {k for k in source.keys() & exported.keys() if source[k] is not None and source[k] != exported[k]}
    assert changed == {"router_aux_loss_coef"}, {k: (source[k], exported[k]) for k in changed}
    assert jax.tree.structure(params) == jax.tree.structure(layout.abstract_state().params)
    # exported as a run trained from scratch is: config.json alone says how many experts there are (4, not transformers'
    # default 8 for Mixtral or 60 for Qwen2-MoE) and how many a token takes (Qwen2-MoE: 3, not its default 4)
    scratch = tmp_path / "scratch"
    hf_export.write_model(params, cfg, scratch, "float32")
    _assert_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(scratch)), ours)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_exported_load_balancing_coefficient_weighs_transformers_loss_as_the_run_weighed_ours(top_k):
    """transformers' load-balancing loss is top_k times ours at the same routing (its token shares sum to top_k): the
    exported router_aux_loss_coef was our weight, so fine-tuning the export weighed that loss top_k times as much."""
    moe = MoEConfig(num_experts=4, top_k=top_k, aux_loss_weight=0.01)
    model = dataclasses.replace(small_config().model, moe=moe)
    coefficient = hf_config.export_config(model, "float32", SEQ)["router_aux_loss_coef"]
    logits = np.random.default_rng(top_k).normal(size=(2, 8, 4)).astype(np.float32)  # one layer's router, (batch, length, experts)
    probs = jax.nn.softmax(logits, axis=-1)
    experts = jax.lax.top_k(probs, top_k)[1]
    ours = router_stats(logits, probs, experts, np.ones(experts.shape, bool))["aux_loss"]
    theirs = load_balancing_loss_func((torch.from_numpy(logits.reshape(16, 4)),), 4, top_k)
    assert coefficient * float(theirs) == pytest.approx(moe.aux_loss_weight * float(ours), rel=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_expert_adapters_equal_peft_on_the_fused_expert_parameters_both_ways(name, tmp_path):
    """PEFT's LoRA on transformers' fused expert parameters (target_parameters experts.gate_up_proj / down_proj, one
    A per expert shared by gate and up) beside attention adapters: read into our adapters, the LoRA model on the
    expert-parallel mesh (dropless, fsdp x tensor x expert) gives PEFT's logits, merged too; written back, the
    tensors are PEFT's own, name for name, and PEFT loads them to the same logits."""
    from safetensors.numpy import load_file

    from jaxtrain.adapt import lora as lora_lib
    from jaxtrain.adapt.adapters import join_frozen
    from jaxtrain.interop import peft as peft_io
    from jaxtrain.models.config import LoraConfig

    model_cls, hf_cfg = MODELS[name]
    torch.manual_seed(0)
    reference = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for pname, p in reference.named_parameters():
            p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
    hf_dir, adapter_dir, exported = tmp_path / "hf", tmp_path / "adapter", tmp_path / "exported"
    reference.save_pretrained(hf_dir)
    adapted = peft.get_peft_model(reference, peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        init_lora_weights=False)).eval()  # random A and B
    adapted.save_pretrained(adapter_dir)
    expected = _hf_logits(adapted)
    assert np.max(np.abs(expected - _hf_logits(model_cls.from_pretrained(hf_dir)))) > 1e-2  # the adapters matter

    config, tensors, _ = peft_io.read_adapter(adapter_dir)
    cfg = small_config("fsdp_tp_ep", (1, 2, 2, 1, 2))
    base_model = hf_config.model_config(hf_dir, cfg.model, set(), SEQ)
    targets = peft_io.targets_of(config, adapter_dir, base_model)
    assert targets == "q,v,gate,up,down"
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(base_model, lora=LoraConfig(rank=2, alpha=6.0, targets=targets)))
    assert cfg.model.expert_adapters() == ["gate_up", "down"]
    layout = make_layout(cfg)
    adapters = {"layers": peft_io.from_peft(tensors, cfg.model, adapter_dir)}
    # an adapter_config.json whose r is not the tensors' rank is blamed on the config, not on the base
    with pytest.raises(UserError, match=r"adapter_config.json: r=3, but the adapter's tensors have rank 2 \(base_model.model.model."
                                        r"layers.0.mlp.experts.base_layer.lora_A is \(8, 32\)"):
        peft_io.from_peft(tensors, dataclasses.replace(cfg.model, lora=LoraConfig(rank=3, alpha=6.0, targets=targets)), adapter_dir)
    params = join_frozen(lora_lib.load_base(layout, hf_dir).frozen, adapters)
    ours = _our_logits(layout, params)
    _assert_close(ours, expected)
    plain = make_layout(dataclasses.replace(cfg, model=lora_lib.plain_config(cfg.model)))
    _assert_close(_our_logits(plain, jax.jit(lambda p: lora_lib.merged(p, cfg.model))(params)), expected)

    peft_io.write_adapter(adapters["layers"], cfg.model, exported, str(hf_dir), {})
    theirs, written = load_file(str(adapter_dir / peft_io.WEIGHTS_FILE)), load_file(str(exported / peft_io.WEIGHTS_FILE))
    assert sorted(written) == sorted(theirs)
    assert all(np.array_equal(written[k], theirs[k]) for k in theirs)
    reloaded = peft.PeftModel.from_pretrained(model_cls.from_pretrained(hf_dir), exported).eval()
    _assert_close(_hf_logits(reloaded), expected)


def test_a_qwen2_moe_without_a_shared_expert_is_one_line():
    """It was read as a Mixtral, then refused for a Mixtral tensor missing from the files ("does not match its config.json")."""
    config = MODELS["qwen2_moe"][1].to_dict() | {"shared_expert_intermediate_size": 0}
    with pytest.raises(UserError, match=r"^config.json: shared_expert_intermediate_size=0 is not supported \(a shared expert: a "
                       r"positive multiple of moe_intermediate_size=16\)$"):
        hf_config.model_values(config, "config.json", SEQ)


@pytest.mark.parametrize("config, message", [
    ({"target_modules": ["q_proj", "gate_proj"]}, "target_modules gate_proj on a mixture of experts name the shared expert's projections"),
    # transformers 4's experts
    ({"target_modules": ["w1", "w2", "w3"]}, "target_modules ['w1', 'w2', 'w3'] name none of this base's layer projections"),
    ({"target_modules": ["q_proj"], "target_parameters": ["experts.w13"]}, "target_parameters ['experts.w13'] are not this base's"),
    ({"target_parameters": ["experts.gate_up_proj"], "dense": True}, "are not this base's expert parameters (a dense model has none)"),
    # QA: read by their last name only, these were refused as "not all Llama projections" or taken as another base's
    ({"target_modules": ["q_proj", "lm_head"], "dense": True}, "target_modules ['q_proj', 'lm_head'] adapt lm_head; jaxtrain takes "
     "adapters on the layers' projections only"),
    ({"target_modules": ".*embed_tokens|.*v_proj", "dense": True}, "adapt model.embed_tokens; jaxtrain takes adapters"),
    ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["model.layers.0.self_attn.q_proj"], "dense": True},
     "the adapters are on q_proj in layers [1, 2, 3] only, of the base's 4 layers; jaxtrain applies adapters on every layer"),
    ({"target_modules": [f"model.layers.{i}.self_attn.v_proj" for i in (0, 2)], "dense": True},
     "the adapters are on v_proj in layers [0, 2] only, of the base's 4 layers"),
])
def test_peft_adapters_jaxtrain_cannot_take_are_one_line(config, message, tmp_path):
    """What jaxtrain takes no adapter on: Qwen2-MoE's shared expert, transformers 4's per-expert modules, other
    parameters; expert parameters on a dense base; the output head or the embedding, and some layers only, as PEFT
    matches target_modules and exclude_modules to the base's module names."""
    from jaxtrain.errors import UserError
    from jaxtrain.interop import peft as peft_io
    from jaxtrain.models.config import LlamaConfig, MoEConfig

    base = LlamaConfig() if config.pop("dense", False) else LlamaConfig(moe=MoEConfig(num_experts=4))
    with pytest.raises(UserError) as error:
        peft_io.targets_of(config, tmp_path, base)
    assert message in str(error.value) and "\n" not in str(error.value)
