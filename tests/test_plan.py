"""The memory planner: estimate vs compiled truth, train.microbatches=auto, suggestions, CLI contract; and the
experiment files' public Llama shapes."""

import json

import pytest
from conftest import REPO, run_cli, small_config, with_

from jaxtrain import plan as plan_lib
from jaxtrain.config import check, load_experiment
from jaxtrain.state import model_spec
from jaxtrain.train import make_layout

GIB = plan_lib.GIB


def medium_config(rules: str, remat: str, mesh=(1, 4, 2), microbatches: int = 1):
    """Big enough that activations and logits dominate, as they do at scale; compiles in a few seconds."""
    cfg = small_config(rules=rules, mesh=mesh, vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                       mlp_dim=1024, dtype="bfloat16", remat=remat)
    return with_(cfg, data={"seq_len": 512}, train={"global_batch": 16, "microbatches": microbatches})


@pytest.mark.parametrize("rules,remat", [("fsdp_tp", "full"), ("fsdp", "save_dots")])
def test_estimate_within_15_percent_of_compiled(rules, remat):
    layout = make_layout(medium_config(rules, remat))
    estimate = sum(plan_lib.estimate(layout).values())
    compiled = plan_lib.compile_truth(layout)
    assert compiled.total == compiled.argument + compiled.output - compiled.alias + compiled.temp
    assert abs(estimate / compiled.total - 1) < 0.15, (estimate, compiled)


def test_estimate_counts_state_shards_exactly():
    layout = make_layout(medium_config("fsdp_tp", "full"))
    params = layout.spec.num_params * 4  # float32
    items = plan_lib.estimate(layout)
    # fsdp 4 x tensor 2: every weight matrix is split 8 ways, the norm scales (d_model per layer) are replicated
    norms = (2 * 4 + 1) * 256 * 4
    assert items["parameters"] == (params - norms) // 8 + norms
    assert items["optimizer state"] == 2 * items["parameters"] + 8  # Adam mu and nu; Adam's and the schedule's int32 counts


def test_auto_microbatches_picks_the_fewest_that_fit():
    cfg = medium_config("fsdp", "none", mesh=(1, 2, 4))  # batch over 2 shards: 1, 2, 4, 8 micro-batches are valid
    layout = make_layout(cfg)
    totals = {k: sum(plan_lib.estimate(make_layout(with_(cfg, train={"microbatches": k}))).values()) for k in (1, 2, 4)}
    assert totals[1] > totals[2] > totals[4]
    memory = (totals[2] + totals[4]) / 2 / (1 - plan_lib.DEFAULT_HEADROOM)  # room for 4 micro-batches, not for 2
    assert plan_lib.fewest_microbatches(cfg, memory * (1 - plan_lib.DEFAULT_HEADROOM)) == 4
    assert layout.cfg.train.microbatches == 1
    # on CPU no device reports a memory limit: auto means one pass
    assert plan_lib.with_auto_microbatches(with_(cfg, train={"microbatches": "auto"})).train.microbatches == 1


def test_suggestions_fit_and_are_ranked_by_step_time():
    cfg = medium_config("fsdp", "none", mesh=(1, 8, 1))
    total = sum(plan_lib.estimate(make_layout(cfg)).values())
    usable = total / 3
    suggestions = plan_lib.suggest(cfg, usable)
    assert suggestions and all(s.total <= usable for s in suggestions)
    times = [s.relative_step_time for s in suggestions]
    assert times == sorted(times) and times[0] >= 1.0
    assert all(s.changes for s in suggestions)


@pytest.mark.parametrize("name,params", [("llama3_1b", 1_235_814_400), ("llama3_3b", 3_212_749_824),
                                         ("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496),
                                         ("llama3_405b", 405_853_388_800)])
def test_experiments_have_the_public_llama3_parameter_counts(name, params):
    cfg = load_experiment(name)
    check(cfg)
    assert model_spec(cfg.model).num_params == params


def test_every_experiment_loads_and_checks():
    for name in ("small", "llama_125m", "llama_350m"):
        check(load_experiment(name))


def test_cli_plan_json_with_auto_microbatches(tmp_path):
    cfg = load_experiment("tiny")  # cpu8 mesh: batch over data 2 x fsdp 2
    totals = {k: sum(plan_lib.estimate(make_layout(with_(cfg, train={"microbatches": k}))).values()) for k in (1, 2)}
    memory_gib = (totals[1] + totals[2]) / 2 / (1 - plan_lib.DEFAULT_HEADROOM) / GIB  # room for 2 micro-batches, not 1
    png = tmp_path / "plan.png"
    result = run_cli("plan", "tiny", "train.microbatches=auto", "--device-memory", str(memory_gib), "--json", "--plot", str(png),
                     cwd=REPO)
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["experiment"]["microbatches"] == 2
    assert body["devices"] == 8 and body["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert set(body["estimate_bytes"]) == {"parameters", "optimizer state", "gradients", "activations", "logits and loss",
                                           "largest transient", "total"}
    assert body["estimate_bytes"]["total"] == totals[2]
    compiled = body["compiled_bytes"]
    assert compiled["total"] == compiled["argument"] + compiled["output"] - compiled["alias"] + compiled["temp"]
    assert body["usable_bytes"] == int(int(memory_gib * GIB) * (1 - plan_lib.DEFAULT_HEADROOM))
    assert body["fits"] is (compiled["total"] <= body["usable_bytes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--gpu", "h900"], "unknown GPU 'h900'; known: h100, h200, a100"),
    (["--device-memory", "0"], "--device-memory 0 must be positive"),
    (["--rules", "tp", "mesh.ici.data=1", "mesh.ici.fsdp=1", "mesh.ici.tensor=8"],
     "(logical axis 'kv_heads', size 2) is not divisible by mesh axes tensor 8"),
    (["--mesh", "h100x8", "mesh.dcn.data=-1"], "pass --devices N"),
])
def test_cli_plan_bad_input(args, message, tmp_path):
    result = run_cli("plan", "tiny", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
