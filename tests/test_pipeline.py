"""Pipeline parallelism on the `stage` mesh axis: the same losses as one device, checkpoints that move between
pipelined and plain meshes, and the schedule's arithmetic."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import small_config, subprocess_env, with_
from jaxtrain.plan import estimate as plan_lib
from jaxtrain import stages as stages_lib
from jaxtrain.config import AxisSizes, MeshConfig, SamplingConfig
from jaxtrain.errors import UserError
from jaxtrain.generate import generate, load
from jaxtrain.layout import make_layout
from jaxtrain.observe.metrics import format_summary, startup_summary
from jaxtrain.partitioning import model_tracing
from jaxtrain.stages import Schedule
from jaxtrain.state import bytes_per_device
from jaxtrain.train import build, train
from jaxtrain.models.config import LoraConfig, MoEConfig, PipelineConfig
from jaxtrain.models.llama import Llama
from test_parity import _losses
from test_plan import medium_config

# mesh sizes (data, fsdp, tensor, stage) on 8 devices
STEPS = 7


def _config(rules="dp", mesh=(1, 1, 1, 1), pipeline=PipelineConfig(), remat="none"):
    # a constant learning rate: the checkpoint test's legs raise train.steps, which sets the cosine's length. Scanned
    # layers without stages too (model.scan_layers=auto unrolls on CPUs): 8 unrolled layers took XLA:CPU 2-3x as long
    # to compile, and scan and unrolled layers agree (test_model.py)
    return with_(small_config(rules, mesh, num_layers=8, remat=remat, pipeline=pipeline, scan_layers=True), optim={"min_lr_ratio": 1.0})


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """Losses of 7 steps on one device."""
    losses = _losses(with_(_config(), train={"steps": STEPS}), corpus, tmp_path_factory.mktemp("one-device"), jax.devices()[:1])
    assert len(losses) == STEPS and losses[-1] < losses[0]  # it trains
    return losses


def test_stage4_data2_circular_matches_one_device(reference, corpus, tmp_path):
    """stage 4 x data 2, circular: each stage holds 2 groups of 1 layer, 4 micro-batches; remat inside the stages."""
    cfg = _config("pp_dp", (2, 1, 1, 4), PipelineConfig(microbatches=4, repeats=2), remat="full")
    np.testing.assert_allclose(_losses(cfg, corpus, tmp_path), reference[:5], rtol=1e-5)


def test_stage2_fsdp2_tensor2_matches_one_device_and_its_checkpoint_moves_to_a_plain_mesh_and_back(reference, corpus, tmp_path):
    """5 steps on stage 2 x fsdp 2 x tensor 2 (2 micro-batches in flight, gradient accumulation over 2 passes around
    the pipeline), step 6 restored onto a plain fsdp_tp mesh (data 2 x fsdp 2 x tensor 2), step 7 back on the
    pipelined one: the one-device losses throughout. Then `jaxtrain generate` of the run (on its own pipelined mesh
    and rules): the greedy tokens of the same checkpoint on the plain cpu8 mesh."""
    pipelined = with_(_config("pp_fsdp_tp", (1, 2, 2, 2), PipelineConfig(microbatches=2)), train={"microbatches": 2})
    plain = with_(_config("fsdp_tp", (2, 2, 2, 1)), train={"microbatches": 2})
    run_dir = tmp_path / "moved"
    for cfg, steps in ((pipelined, 5), (plain, 6), (pipelined, 7)):
        cfg = with_(cfg, train={"steps": steps})  # each leg saves its last step
        train(cfg, run_dir, build(cfg, corpus))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r], reference, rtol=1e-5)
    # the last leg's start-up summary: its stages scan their layers, though model.scan_layers=auto unrolls on CPUs
    assert json.loads((run_dir / "summary.json").read_text())["layers"] == "scanned"
    prompts = np.array([corpus.train[:5], corpus.train[100:105]])
    sampling = SamplingConfig(max_new_tokens=12)
    on_pipeline = generate(load(run_dir), prompts, sampling).tokens
    assert len(np.unique(on_pipeline)) > 4  # a varied continuation
    np.testing.assert_array_equal(on_pipeline, generate(load(run_dir, mesh="cpu8", rules="fsdp_tp"), prompts, sampling).tokens)


def test_explicit_unrolled_layers_under_stages_are_named_in_the_start_up_summary():
    """model.scan_layers=auto resolves to true under stages (what runs there); an explicit false, which has no
    effect there, gets a note in the printed summary. Without stages false stays false and gets none."""
    pipelined = _config("pp_fsdp", (1, 2, 1, 4), PipelineConfig(microbatches=4))
    summary = lambda cfg: startup_summary(make_layout(cfg), 0.0, None, "test", None, "none")  # noqa: E731
    assert make_layout(pipelined).cfg.model.scan_layers is True
    auto, explicit = summary(pipelined), summary(with_(pipelined, model={"scan_layers": False}))
    assert auto["layers"] == explicit["layers"] == "scanned"
    assert not auto["scan_layers_ignored"] and explicit["scan_layers_ignored"]
    assert "model.scan_layers=false has no effect with pipeline stages" in format_summary(explicit)
    assert "scan_layers" not in format_summary(auto)
    # and the schedule with its bubble, as the plan names them (4 stages, 4 micro-batches: 3 of 7 iterations idle; a QA
    # report: the summary said only "in 1 micro-batch(es)")
    assert auto["pipeline"] == {"stages": 4, "microbatches": 4, "repeats": 1, "bubble": 3 / 7,
                                "described": "pipeline 4 stages x 1 repeat(s), 4 micro-batches in flight per pass, bubble 42.9%"}
    assert f"in 1 micro-batch(es), each a {auto['pipeline']['described']}" in format_summary(auto)
    plain = summary(with_(_config("fsdp", (1, 8, 1, 1)), model={"scan_layers": False}))
    assert plain["layers"] == "unrolled" and not plain["scan_layers_ignored"] and plain["pipeline"] is None


@pytest.mark.parametrize("remat_layers", [2, 4])
def test_remat_on_the_first_layers_of_each_stage_matches_plain_layers(remat_layers):
    """8 layers as 2 stages x 4 layers, model.remat_layers=2 (4): the first layer (two) of each stage recomputed, the
    others kept whole; outputs and gradients as without stages or remat."""
    cfg = with_(_config("pp_fsdp", (1, 4, 1, 2), PipelineConfig(microbatches=2), remat="full"),
                model={"remat_layers": remat_layers})
    graphdef, params = nnx.split(Llama(cfg.model, rngs=nnx.Rngs(0)))
    plain_graphdef = nnx.split(Llama(dataclasses.replace(cfg.model, remat="none", remat_layers=None), rngs=nnx.Rngs(0)))[0]
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.model.vocab_size)

    def loss(params, graphdef):
        hidden = nnx.merge(graphdef, params).hidden(tokens)
        return jnp.mean(jnp.square(hidden)), hidden

    plain, plain_grads = jax.grad(loss, has_aux=True)(params, plain_graphdef)[::-1]
    layout = make_layout(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=8)))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        piped, piped_grads = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)(params, graphdef)[::-1]
    np.testing.assert_allclose(piped, plain, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), piped_grads, plain_grads)


@pytest.mark.parametrize("cfg, message", [
    (with_(_config("pp_fsdp", (1, 4, 1, 2), PipelineConfig(microbatches=2), remat="full"), model={"remat_layers": 3}),
     "model.remat_layers=3 does not split over 2 stages x model.pipeline.repeats=1: each stage rematerialises the same "
     "number of its layers in each repeat; use a multiple of 2"),
    # 2 of 8 layers over 2 stages x 2 repeats: each stage's group of 2 layers would have recomputed 2 // 4 = none
    (with_(_config("pp_fsdp", (1, 4, 1, 2), PipelineConfig(microbatches=2, repeats=2), remat="full"), model={"remat_layers": 2}),
     "model.remat_layers=2 does not split over 2 stages x model.pipeline.repeats=2: each stage rematerialises the same "
     "number of its layers in each repeat; use a multiple of 4"),
    # the whole batch splits into 8 micro-batches over 2 batch shards; each of the 4 gradient-accumulation passes does not
    (with_(_config("pp_dp", (2, 1, 1, 4), PipelineConfig(microbatches=8)), train={"global_batch": 32, "microbatches": 4}),
     "train.global_batch=32 / train.microbatches=4 = 8 sequences do not split into model.pipeline.microbatches=8 micro-batches "
     "over the 2 batch shards; use a multiple of 16 per pass"),
    (with_(_config("pp_fsdp", (1, 2, 1, 4)), model={"moe": MoEConfig(num_experts=4)}),
     "model.moe.num_experts=4: mixture-of-experts layers do not run through pipeline stages yet (rule set pp_fsdp); use an "
     "expert-parallel rule set without pp_ (dp_ep, fsdp_ep, fsdp_tp_ep)"),
    # it said "set mesh.ici.stage or mesh.dcn.stage", which generate and export-hf do not take (generate --mesh gpu1)
    (_config("pp_fsdp_tp", (2, 2, 2, 1)),
     "rule set pp_fsdp_tp splits the layers into pipeline stages over mesh axis stage, but the mesh (data 2 x fsdp 2 x tensor 2) "
     "has size 1 there; give it a stage axis (mesh.ici.stage or mesh.dcn.stage, or a --mesh file with one), or use rule set "
     "fsdp_tp (--rules fsdp_tp), the same without pp_"),
    (_config("pp_fsdp", (1, 2, 1, 4), PipelineConfig(repeats=0)), "model.pipeline.repeats=0 must be at least 1"),
    (_config("pp_fsdp", (1, 2, 1, 4), PipelineConfig(microbatches=-1)),
     "model.pipeline.microbatches=-1 must be 0 (as many as stages) or positive"),
], ids=["remat-layers", "remat-layers-circular", "micro-batches-per-pass", "moe", "no-stage-axis", "no-repeats", "negative-micro-batches"])
def test_a_pipeline_the_model_batch_or_config_cannot_run_is_one_line(cfg, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        make_layout(cfg)


def test_a_batch_no_count_of_train_microbatches_auto_splits_into_the_pipeline_is_one_line_naming_auto():
    """It named train.microbatches=1, which the user had not written, and a multiple per pass that auto decides."""
    cfg = with_(_config("pp_dp", (2, 1, 1, 4), PipelineConfig(microbatches=4)), train={"global_batch": 12, "microbatches": "auto"})
    with pytest.raises(UserError, match="^" + re.escape(
            "train.global_batch=12 does not split into model.pipeline.microbatches=4 micro-batches over the 2 batch shards at any "
            "micro-batch count train.microbatches=auto may choose; use a multiple of 8 (e.g. train.global_batch=16)") + "$"):
        plan_lib.unfitted_layout(cfg)


def test_circular_schedule_with_more_microbatches_than_stages_matches_plain_layers():
    """Outputs and parameter gradients of the stacked layers: 8 layers as 4 stages x 2 repeats x 1 layer, 6
    micro-batches, so the last stage's outputs wait in the buffer before their next repeat."""
    cfg = _config("pp_fsdp", (1, 2, 1, 4), PipelineConfig(microbatches=6, repeats=2))
    model = Llama(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (24, 16), 0, cfg.model.vocab_size)

    def loss(params):
        hidden = nnx.merge(graphdef, params).hidden(tokens)
        return jnp.mean(jnp.square(hidden)), hidden

    plain, plain_grads = jax.grad(loss, has_aux=True)(params)[::-1]
    layout = make_layout(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=24)))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        piped, piped_grads = jax.jit(jax.grad(loss, has_aux=True))(params)[::-1]
    np.testing.assert_allclose(piped, plain, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), piped_grads, plain_grads)


def _compiled_backward(cfg):
    """The compiled gradient, over the parameters laid out as ``cfg`` says, of the final hidden states' mean square."""
    layout = make_layout(cfg)
    graphdef, params = nnx.split(Llama(layout.cfg.model, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((cfg.train.global_batch, cfg.data.seq_len), jnp.int32)

    def loss(params):
        return jnp.mean(jnp.square(nnx.merge(graphdef, params).hidden(tokens)))

    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        return jax.jit(jax.grad(loss), in_shardings=(layout.shardings.params,)).lower(nnx.to_pure_dict(params)).compile()


def test_remat_layers_under_a_circular_schedule_recompute_their_share_of_each_repeat():
    """8 layers as 2 stages x 2 repeats x 2 layers, model.remat_layers=4: the first layer of each stage's group in
    each repeat recomputed, the other's activations kept, so the compiled backward's working memory lies between full
    remat's and none's (recomputing both layers of each group, as 4 // 2 stages would, is full remat's)."""
    def temp_bytes(remat, remat_layers=None):
        cfg = with_(_config("pp_fsdp", (1, 4, 1, 2), PipelineConfig(microbatches=2, repeats=2), remat=remat),
                    model={"remat_layers": remat_layers}, train={"global_batch": 8})
        return _compiled_backward(cfg).memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < temp_bytes("full", remat_layers=4) < temp_bytes("none")


def _weight_heavy(pipeline: PipelineConfig):
    """Layer weights dominate the step's memory, as they do at 405B: 12 layers of d_model 512, MLP 2048, 64-token
    sequences; stage 2 x fsdp 2 x tensor 2."""
    cfg = small_config("pp_fsdp_tp", (1, 2, 2, 2), vocab_size=1024, d_model=512, num_layers=12, num_heads=8, num_kv_heads=4,
                       mlp_dim=2048, dtype="bfloat16", remat="full", pipeline=pipeline)
    return with_(cfg, data={"seq_len": 64}, train={"global_batch": 16})


@pytest.mark.estimate_vs_cpu_compile
@pytest.mark.parametrize("cfg,within", [
    # save_dots saves nothing more than full remat through stages: vmapped over them, every dot has a batch dimension
    (with_(medium_config("pp_fsdp_tp", "save_dots", mesh=(1, 2, 2, 2)), model={"pipeline": PipelineConfig(microbatches=2, repeats=2)}),
     0.15),
    # the stage's weights of one repeat, were they kept for the backward of every iteration (as they were before
    # the layers took them inside their remat), would double the compiled figure; the circular view is one copy
    (_weight_heavy(PipelineConfig(microbatches=4, repeats=3)), 0.15),
    # model.remat_layers=2: the first of each stage's 2 layers recomputed, the other's activations saved: 22% over,
    # as remat none's estimate through stages is (16% over; under, full remat's is 11% under)
    (with_(medium_config("pp_fsdp_tp", "full", mesh=(1, 2, 2, 2)), model={"pipeline": PipelineConfig(microbatches=2), "remat_layers": 2}),
     0.25),
], ids=["activations-save-dots-circular", "weights-circular", "remat-first-layers"])
def test_planner_memory_estimate_of_a_pipeline_within_15_percent_of_compiled_or_as_noted(cfg, within):
    """Per device: the stage's layers on one micro-batch at a time, the saved stacks of every iteration."""
    layout = make_layout(cfg)
    estimate = plan_lib.estimate_total(plan_lib.estimate(layout))
    assert abs(estimate / plan_lib.compile_truth(layout).total - 1) < within


@pytest.mark.parametrize("repeats, accumulation, copies", [(1, 1, 5), (3, 1, 5), (1, 2, 6)])
def test_per_stage_memory_counts_a_stage_of_layers_and_the_whole_embedding_and_output_layer(repeats, accumulation, copies):
    """stage 2 x fsdp 2 x tensor 2: a device holds 1/8 of the layers' weights but 1/4 of the embedding and output
    tables (split over fsdp and tensor, not over stages; the final norm is replicated); each with AdamW's two moments, the gradient and the
    update: 5 float32 copies, 6 with the accumulator of 2 gradient-accumulation passes. The circular schedule's re-layout
    (repeats 3: one more copy of the stage's layers) is the transformer layers'."""
    cfg = with_(_weight_heavy(PipelineConfig(microbatches=4, repeats=repeats)), train={"microbatches": accumulation})
    layout = make_layout(cfg)
    items = plan_lib.estimate(layout)
    per_stage = stages_lib.stage_memory(layout, items)
    m = cfg.model
    hd = m.d_model // m.num_heads
    per_layer = m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * m.d_model * m.mlp_dim
    norms = 2 * m.d_model  # split over stages only
    layers_copy = 4 * m.num_layers * (per_layer / 8 + norms / 2)
    assert per_stage["transformer layers"] == pytest.approx((copies + (repeats > 1)) * layers_copy, rel=1e-6)
    assert per_stage["embedding and output layer"] == pytest.approx(copies * 4 * (2 * m.vocab_size * m.d_model / 4 + m.d_model), rel=1e-6)
    assert per_stage["micro-batch activations in flight"] == items["activations"]
    assert per_stage["logits working set"] == items["logits and loss"]


def test_per_stage_memory_of_a_lora_run_puts_its_frozen_embedding_and_output_layer_with_them():
    """A LoRA run's trained parameters are all adapters of the layers; its frozen base's embedding and output tables
    are on every stage all the same (they were counted as transformer layers, the embedding and output layer 0 bytes)."""
    cfg = with_(_weight_heavy(PipelineConfig(microbatches=4)), model={"lora": LoraConfig(rank=4)})
    layout = make_layout(cfg)
    items = plan_lib.estimate(layout, plan_lib.ACCELERATOR)
    per_stage = stages_lib.stage_memory(layout, items)
    base = layout.abstract_state().model_params
    tables = bytes_per_device(base) - bytes_per_device(base["layers"])  # embedding, output layer and final norm, frozen
    assert tables > 0 and per_stage["embedding and output layer"] == pytest.approx(tables, abs=1)
    assert sum(per_stage.values()) == pytest.approx(sum(items.values()), abs=2)


@pytest.mark.parametrize("repeats", [1, 3])
def test_per_stage_memory_regroups_every_byte_of_the_estimate(repeats):
    """The per-stage items add up to the planner's (within the int rounding of the split), the circular schedule's
    re-layout of the layers (repeats 3) counted with the transformer layers."""
    layout = make_layout(_weight_heavy(PipelineConfig(microbatches=4, repeats=repeats)))
    items = plan_lib.estimate(layout)
    assert ("circular re-layout" in items) == (repeats > 1)
    assert sum(stages_lib.stage_memory(layout, items).values()) == pytest.approx(sum(items.values()), abs=2)


def test_planner_suggests_pipeline_stages_when_fsdp_gathers_cross_the_network():
    across = dataclasses.replace(medium_config("fsdp", "full"), mesh=MeshConfig(ici=AxisSizes(1, 2, 1), dcn=AxisSizes(1, 4, 1)))
    best = plan_lib.suggest(across, 1e12, gpu="h100")[0]
    # with memory to spare the best also drops remat; the stages are what takes the gathers off the network
    staged = {"rules": "pp_fsdp", "mesh.dcn.fsdp": 1, "mesh.dcn.stage": 4, "model.pipeline.microbatches": 8}
    assert best.changes.items() >= staged.items()
    assert best.relative_step_time < 1
    # fsdp inside one node: no network axis to turn into stages
    assert not any("rules" in s.changes and s.changes["rules"].startswith("pp_")
                   for s in plan_lib.suggest(medium_config("fsdp", "full", mesh=(1, 8, 1)), 1e12, gpu="h100"))


@pytest.mark.parametrize("stages, microbatches, repeats, bubble", [(4, 4, 1, 3 / 7), (4, 8, 2, 3 / 19), (2, 2, 1, 1 / 3)])
def test_bubble_formula(stages, microbatches, repeats, bubble):
    assert Schedule(stages, microbatches, repeats).bubble == pytest.approx(bubble)


def test_the_plan_of_a_pipeline_names_its_schedule_and_the_bubble_its_step_time_counts():
    """4 stages x 2 repeats, 4 micro-batches: each stage idles 3 of 11 iterations. The plan showed neither the schedule
    nor the bubble (its step time counted it); a plan without stages shows neither still."""
    plan = plan_lib.make_plan(_config("pp_dp", (2, 1, 1, 4), PipelineConfig(microbatches=4, repeats=2)))
    text = plan_lib.render(plan)
    assert text.splitlines()[0].endswith("; pipeline 4 stages x 2 repeat(s), 4 micro-batches in flight per pass, bubble 27.3%")
    assert "at 45% MFU with the pipeline's 27.3% bubble;" in text
    assert plan.to_json()["pipeline"] == {"stages": 4, "microbatches": 4, "repeats": 2, "bubble": pytest.approx(3 / 11)}
    plain = plan_lib.make_plan(_config("dp", (8, 1, 1, 1)))
    assert "bubble" not in plan_lib.render(plain) and "pipeline" not in plain.to_json()


def test_a_rule_set_splitting_the_stages_but_not_the_stored_layers_over_stage_leaves_no_axis_idle(tmp_path):
    """The pipeline splits the work over the stage axis whether or not the stored layers are split there too: the
    start-up summary's note said the stage axis split nothing, its devices repeating each other's work."""
    rules = tmp_path / "stages_only.yaml"
    rules.write_text("extends: fsdp_tp\nlayer_stages: stage\n")
    layout = make_layout(_config(str(rules), (1, 2, 2, 2), PipelineConfig(microbatches=2)))
    assert stages_lib.schedule(layout.cfg, layout.rules, layout.mesh).stages == 2 and layout.idle_axes == {}


def test_packed_instruction_data_through_stages_is_one_line():
    """The layers would see the packed rows' segment ids and positions whole, not per micro-batch."""
    with pytest.raises(UserError, match=r"^data.format=sft \(packed instruction data\) does not run through pipeline stages yet"):
        make_layout(with_(_config("pp_fsdp", (1, 2, 1, 4)), data={"format": "sft"}))


def test_pipeline_micro_batches_default_to_the_stages():
    """model.pipeline.microbatches unset (0): as many micro-batches in flight as stages, a bubble of 3 / 7 on 4."""
    layout = make_layout(_config("pp_fsdp", (1, 2, 1, 4)))
    assert stages_lib.schedule(layout.cfg, layout.rules, layout.mesh) == Schedule(4, 4, 1)


def test_gpu_script_skips_the_pipelined_row_with_one_device_saying_why(tmp_path):
    """A lent machine has one GPU; with --tiny the row runs on 8 simulated CPU devices (make gpu-dry-run)."""
    out = tmp_path / "rows.jsonl"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_h200.py"
    result = subprocess.run([sys.executable, str(script), "--only", "pipeline_1b", "--out", str(out)],
                            env=subprocess_env() | {"JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["devices"] == 1
    assert records[1] == {"row": "pipeline_1b", "status": "skipped", "reason": "needs 2 or more devices, 1 visible"}
