import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from jaxtrain import config as config_lib
from jaxtrain.config import AxisSizes, Config, apply_overrides, from_dict, load_mesh_file, to_dict
from jaxtrain.errors import UserError


def test_overrides_are_typed():
    cfg = apply_overrides(Config(), ["train.steps=100", "model.num_layers=4", "model.dtype=float32", "optim.lr=3e-4",
                                     "log.every=1", "model.tie_embeddings=true", "model.head_dim=none", "data.path=/x"])
    assert cfg.train.steps == 100 and cfg.model.num_layers == 4 and cfg.model.dtype == "float32"
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.log.every == 1 and cfg.model.tie_embeddings is True and cfg.model.head_dim is None
    assert cfg.data.path == "/x"
    assert apply_overrides(cfg, ["data.tokenizer=/t", "data.tokenizer=null"]).data.tokenizer is None  # YAML's word for none
    # a shell's and YAML's words for a bool; train.compile_cache (bool or a folder) reads them as off and on, not folders
    flags = apply_overrides(cfg, ["optim.offload=1", "log.progress=0", "log.tensorboard=no", "train.compile_cache=0"])
    assert (flags.optim.offload, flags.log.progress, flags.log.tensorboard, flags.train.compile_cache) == (True, False, False, False)
    assert apply_overrides(cfg, ["train.compile_cache=On"]).train.compile_cache is True
    assert apply_overrides(cfg, ["model.head_dim=64"]).model.head_dim == 64


def test_unknown_key_names_closest():
    with pytest.raises(UserError, match=r"unknown config key 'train.step'; did you mean 'train.steps'\?"):
        apply_overrides(Config(), ["train.step=3"])
    with pytest.raises(UserError, match="did you mean 'optim.lr'"):
        apply_overrides(Config(), ["optim.lrr=3"])


@pytest.mark.parametrize("item, message", [
    ("train.steps=abc", "train.steps expects int, got 'abc'"),
    ("optim.lr=fast", "optim.lr expects float, got 'fast'"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings expects bool"),
    ("model.head_dim=x", "model.head_dim expects int or NoneType"),
    # a key whose 0 turns its feature off says so to a user turning it off another way
    ("optim.clip_norm=none", "optim.clip_norm expects float, got 'none'; optim.clip_norm=0 means no clipping"),
    ("train.skip_spikes=off", "train.skip_spikes expects float, got 'off'; train.skip_spikes=0 means off"),
    ("train.steps", "not of the form key=value"),
])
def test_wrong_types_are_errors(item, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        apply_overrides(Config(), [item])


def test_config_round_trips_through_dict():
    cfg = apply_overrides(Config(), ["train.steps=7", "mesh.ici.tensor=4", "rules=tp", "model.remat=full"])
    assert from_dict(to_dict(cfg)) == cfg


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().train.steps = 3


def test_check_reports_model_problems():
    with pytest.raises(UserError, match="model.remat='fancy' is not a remat policy; choose one of none, full"):
        config_lib.check(apply_overrides(Config(), ["model.remat=fancy"]))
    with pytest.raises(UserError, match="num_heads=8 is not a multiple of model.num_kv_heads=3"):
        config_lib.check(apply_overrides(Config(), ["model.num_kv_heads=3"]))


@pytest.mark.parametrize("overrides,message", [
    (["model.remat=full", "model.remat_layers=0"], "model.remat_layers=0 must be a number of layers from 1 to model.num_layers=4, or null"),
    (["model.remat=full", "model.remat_layers=5"], "model.remat_layers=5 must be a number of layers from 1 to model.num_layers=4, or null"),
    (["model.remat=full", "model.remat_layers=true"], "model.remat_layers expects int or NoneType, got 'true'"),
    (["model.remat_layers=2"], "model.remat_layers=2 says how many layers model.remat recomputes, but model.remat=none; set a policy"),
])
def test_remat_layers_is_a_count_of_layers_under_a_policy(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        config_lib.check(apply_overrides(Config(), overrides))
    config_lib.check(apply_overrides(Config(), ["model.remat=full", "model.remat_layers=4"]))  # every layer, as null


def test_mesh_files_parse():
    cpu8 = load_mesh_file("cpu8")
    assert cpu8.ici == AxisSizes(2, 2, 2) and cpu8.dcn == AxisSizes(1, 1, 1)
    h64 = load_mesh_file("h100x64")
    assert h64.ici.tensor == 8 and h64.dcn.data * h64.dcn.fsdp == 8
    for name in ("gpu1", "h100x8"):
        load_mesh_file(name)


@pytest.mark.parametrize("body", ["ici: {data: 2, fsdp: 4}", "ici: {data: 2, fsdp: 4}\ndcn:\n"])
def test_a_mesh_file_may_leave_out_dcn_and_axes(tmp_path: Path, body):
    """A one-host mesh file needs no dcn level (a KeyError traceback if read as required); an axis left out is 1."""
    path = tmp_path / "m.yaml"
    path.write_text(body)
    assert load_mesh_file(str(path)) == config_lib.MeshConfig(ici=AxisSizes(data=2, fsdp=4), dcn=AxisSizes())


@pytest.mark.parametrize("body, message", [
    ("ici: {data: 2, pipeline: 2}", "unknown axis 'ici.pipeline'"),
    ("ici: {data: -1, fsdp: -1}", "at most one axis per level may be -1"),
    ("ici: {data: 0}", "must be a positive integer or -1"),
    ("ici: {tensor: yes}", "ici.tensor=True must be a positive integer or -1"),  # YAML's yes is a bool, which int takes as 1
    ("hosts: 2", "only the keys 'ici' and 'dcn'"),
    # read as every axis 1: one device, where the file was empty or cut short
    ("", "m.yaml gives no axis sizes; give them, e.g. ici: {data: 2, fsdp: 2, tensor: 2} (one device: --mesh gpu1)"),
    ("# h100x64\nici:\n", "m.yaml gives no axis sizes"),
])
def test_bad_mesh_files(tmp_path: Path, body, message):
    path = tmp_path / "m.yaml"
    path.write_text(body)
    with pytest.raises(UserError, match=re.escape(message)):
        load_mesh_file(str(path))


def test_unknown_experiment_lists_available():
    with pytest.raises(UserError, match="unknown experiment 'nope'; available: .*tiny"):
        config_lib.load_experiment("nope")
    # a path that is not there is a missing file, not an unknown name
    for missing in ("runs/tiny/config.yaml", "mine.yaml", "experiments/mine"):
        with pytest.raises(UserError, match=f"^experiment file {missing} does not exist; give an experiment .py file with "
                                            r"config\(\) -> Config, a .yaml file of config sections, or a name under "
                                            "jaxtrain/experiments/: .*tiny"):
            config_lib.load_experiment(missing)


def test_an_experiment_path_must_be_a_python_file(tmp_path):
    data = tmp_path / "extra.jsonl"
    data.write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match=r"extra.jsonl is neither a Python nor a YAML file; an experiment is a .py file with "
                                        r"config\(\) -> Config \(see .*\) or a .yaml file of config sections") as raised:
        config_lib.load_experiment(str(data))
    # the example it points to by its real path, which an installed jaxtrain's user has (not jaxtrain/experiments/tiny.py)
    example = Path(re.fullmatch(r".*\(see (.*?)\).*", str(raised.value)).group(1))
    assert example.is_absolute() and config_lib.load_experiment(str(example)) == config_lib.load_experiment("tiny")
    with pytest.raises(UserError, match=r"is a directory; give an experiment .py or .yaml file, or a name under "
                                        r"jaxtrain/experiments/: .*tiny"):
        config_lib.load_experiment(str(tmp_path))
    broken = tmp_path / "broken.py"
    broken.write_text("def config():\n    return Config(\n")
    with pytest.raises(UserError, match=rf"^experiment file {broken} line 2: '\(' was never closed; fix the file$"):
        config_lib.load_experiment(str(broken))
    broken.write_text("import nosuchmod\ndef config(): pass\n")
    with pytest.raises(UserError, match=rf"^experiment file {broken} failed to load: ModuleNotFoundError: No module named 'nosuchmod'; "
                                        "fix the file$"):
        config_lib.load_experiment(str(broken))
    broken.write_text("import sys\nsys.exit(3)\n")  # it ended the command with status 3 and no word
    with pytest.raises(UserError, match=rf"^experiment file {broken} failed to load: SystemExit: 3; fix the file$"):
        config_lib.load_experiment(str(broken))
    # config() itself raising (a misspelt field): where in the file, one line
    broken.write_text("from jaxtrain.models.config import LlamaConfig\n\ndef config():\n    return LlamaConfig(d_modle=64)\n")
    with pytest.raises(UserError, match=rf"^experiment file {broken} line 4: config\(\) raised TypeError: .*'d_modle'; fix the file$"):
        config_lib.load_experiment(str(broken))



def test_a_yaml_experiment_is_config_sections_read_as_overrides_are(tmp_path):
    """Keys given as config.yaml writes them, each read as its override is, the others at their defaults; a run's
    config.yaml is one, its resolved: section a record left out; a mistake in the file is one line naming it."""
    path = tmp_path / "mine.yaml"
    path.write_text("model: {num_layers: 3, dtype: float32}\ntrain: {steps: '7', epochs: 1.5}\nrules: dp\n"
                    "resolved: {devices: 8}\n")
    assert config_lib.load_experiment(str(path)) == config_lib.apply_overrides(
        Config(), ["model.num_layers=3", "model.dtype=float32", "train.steps=7", "train.epochs=1.5", "rules=dp"])
    tiny = config_lib.with_absolute_paths(config_lib.load_experiment("tiny"))
    config_lib.save_yaml(tiny, tmp_path / "config.yaml", {"resolved": {"devices": 8}})  # as a run writes it
    assert config_lib.load_experiment(str(tmp_path / "config.yaml")) == tiny
    for text, problem in (("model: {num_layrs: 3}\n",
                           "unknown config key 'model.num_layrs'; did you mean 'model.num_layers'\\?; fix the file"),
                          ("train: {steps: many}\n", "train.steps expects int, got 'many'; fix the file"),
                          ("- model\n", "must be a mapping of config sections \\(model, data, train, ...\\), got list"),
                          ("model: {num_layers: [3\n", "is not valid YAML at line 2, column 1")):
        path.write_text(text)
        with pytest.raises(UserError, match=f"^experiment file {path}:? {problem}"):
            config_lib.load_experiment(str(path))


def test_a_runs_config_yaml_defaults_to_its_run_and_another_config_yaml_to_runs(tmp_path):
    """The run's own (beside its metrics or checkpoints) resumes it; a user's experiment named config.yaml in a project
    folder is written to runs/config, not into that folder."""
    from jaxtrain.cli import default_run_dir

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "config.yaml").write_text("train: {steps: 3}\n")
    assert default_run_dir(str(tmp_path / "project" / "config.yaml")) == Path("runs/config")
    for made in ("metrics.jsonl", "checkpoints"):
        run = tmp_path / made.split(".")[0]
        run.mkdir()
        (run / "config.yaml").write_text("train: {steps: 3}\n")
        if made == "metrics.jsonl":
            (run / made).write_text("")
        else:
            (run / made).mkdir()
        assert default_run_dir(str(run / "config.yaml")) == run
    assert default_run_dir("tiny") == Path("runs/tiny") and default_run_dir("exp/mine.yaml") == Path("runs/mine")


def test_keys_of_a_feature_that_is_off_are_noted_when_set(capsys):
    """model.lora.alpha=32 without model.lora.rank trained every weight without a word (and the like for the other
    features' keys); the shipped experiments set none."""
    from jaxtrain.cli import resolve_config

    resolve_config("tiny", None, None, ["model.lora.alpha=32", "model.lora.dropout=0.1", "model.rope_scaling.factor=4",
                                        "optim.decay_shape=cosine", "data.truncate=true", "train.spike_window=64",
                                        "optim.loss_scale_period=100", "model.moe.top_k=1"])
    assert capsys.readouterr().err.splitlines() == [
        "jaxtrain: note: model.lora.alpha=32.0, model.lora.dropout=0.1 have no effect with model.lora.rank=0 (no adapters: "
        "every weight trains; give model.lora.rank to train LoRA adapters)",
        "jaxtrain: note: model.moe.top_k=1 has no effect with model.moe.num_experts=0 (a dense model; give model.moe.num_experts "
        "for a mixture of experts)",
        "jaxtrain: note: model.rope_scaling.factor=4.0 has no effect with model.rope_scaling.type=none (no rotary scaling; give "
        "model.rope_scaling.type=llama3)",
        "jaxtrain: note: optim.decay_shape=cosine has no effect with optim.schedule=cosine (only optim.schedule=wsd's decay uses them)",
        "jaxtrain: note: data.truncate=true has no effect with data.format=text (only instruction data, data.format=sft, is "
        "packed and cut)",
        "jaxtrain: note: train.spike_window=64 has no effect with train.skip_spikes=0.0 (no spike guard; give train.skip_spikes)",
        "jaxtrain: note: optim.loss_scale_period=100 has no effect with model.dtype=float32 (only float16 compute, "
        "model.dtype=float16, scales the loss)"]
    resolve_config("tiny", None, None, ["model.lora.rank=4", "model.lora.alpha=32", "optim.schedule=wsd", "optim.decay_shape=cosine"])
    assert capsys.readouterr().err == ""  # on, the keys are used
    # what the devices chose for auto, which a run's config.yaml keeps (a dense run's config.yaml resumed noted it)
    assert config_lib.unused_key_notes(config_lib.apply_overrides(Config(), ["model.moe.grouped_matmul=xla"])) == []
    shipped = sorted(p.stem for p in config_lib.EXPERIMENTS_DIR.glob("*.py") if not p.stem.startswith("_"))
    assert len(shipped) > 10 and {name: config_lib.unused_key_notes(config_lib.load_experiment(name)) for name in shipped} == \
        {name: [] for name in shipped}


def test_a_folder_in_the_working_directory_leaves_a_shipped_name_to_its_experiment_and_mesh(tmp_path, monkeypatch):
    """A user's project folder named as an experiment or a mesh (``llama3_8b/`` for its data, say) made the name
    unusable: "experiment llama3_8b is a directory; give ... or a name under jaxtrain/experiments/: ..., llama3_8b, ..."
    (the rule sets' lookup already passed a folder by). A directory is never an experiment or a mesh file."""
    monkeypatch.chdir(tmp_path)
    for name in ("tiny", "cpu8", "gpu1"):
        (tmp_path / name).mkdir()
    assert config_lib.load_experiment("tiny") == config_lib.load_experiment(str(config_lib.EXPERIMENTS_DIR / "tiny.py"))
    assert load_mesh_file("cpu8") == load_mesh_file(str(config_lib.MESHES_DIR / "cpu8.yaml"))
    assert load_mesh_file("gpu1").ici.data == 1
    # a folder of no shipped name is still refused as one, and so is a path to one
    (tmp_path / "mine").mkdir()
    with pytest.raises(UserError, match="^experiment mine is a directory; give an experiment .py or .yaml file"):
        config_lib.load_experiment("mine")
    with pytest.raises(UserError, match="^experiment ./tiny is a directory"):
        config_lib.load_experiment("./tiny")
    with pytest.raises(UserError, match="^--mesh mine is a directory; give a mesh YAML file or one of: a100x4, "):
        load_mesh_file("mine")
    # the hidden helper module is no experiment, as the listing says
    with pytest.raises(UserError, match="^unknown experiment '_llama'; available: finetune, "):
        config_lib.load_experiment("_llama")


def test_an_experiment_file_imports_the_helpers_beside_it(tmp_path, monkeypatch):
    """As `python FILE.py` does and as the shipped experiments import jaxtrain/experiments/_llama.py: a user's experiments
    sharing a helper module failed to load ("No module named '_common'"), from any working directory."""
    folder = tmp_path / "exps"
    folder.mkdir()
    (folder / "_common.py").write_text("import dataclasses\nfrom jaxtrain.config import load_experiment\n\ndef base(steps):\n"
                                       "    cfg = load_experiment('tiny')\n"
                                       "    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))\n")
    (folder / "at_load.py").write_text("from _common import base\n\ndef config():\n    return base(7)\n")
    (folder / "in_config.py").write_text("def config():\n    from _common import base\n    return base(9)\n")
    monkeypatch.chdir(tmp_path)  # not the files' folder
    path_before = list(sys.path)
    assert config_lib.load_experiment("exps/at_load.py").train.steps == 7
    monkeypatch.delitem(sys.modules, "_common")  # imported afresh: from the folder, not from the first one's import
    assert config_lib.load_experiment(str(folder / "in_config.py")).train.steps == 9
    monkeypatch.delitem(sys.modules, "_common")
    assert sys.path == path_before


def test_a_shipped_mesh_or_rule_set_at_its_path_of_before_the_move_is_told_its_name(tmp_path, monkeypatch):
    """experiments/meshes/h100x8.yaml and sharding_rules/fsdp.yaml were the paths DESIGN's and README's commands gave
    until 2026-12-06, when those folders moved into the package; a mistyped name gets no such advice."""
    from jaxtrain import partitioning

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^mesh file 'experiments/meshes/h100x8.yaml' not found; the shipped ones are in "
                                        r"jaxtrain/experiments/meshes/ since 2026-12-06: give the name, h100x8; give a path"):
        load_mesh_file("experiments/meshes/h100x8.yaml")
    with pytest.raises(UserError, match=r"^rule set 'sharding_rules/fsdp.yaml' not found; the shipped ones are in "
                                        r"jaxtrain/sharding_rules/ since 2026-12-06: give the name, fsdp; give a path"):
        partitioning.load_rules("sharding_rules/fsdp.yaml")
    with pytest.raises(UserError, match=r"^rule set 'sharding_rules/fsd.yaml' not found; give a path"):
        partitioning.load_rules("sharding_rules/fsd.yaml")


@pytest.mark.parametrize("line, module", [("from models.config import LlamaConfig", "models.config"),
                                          ("from experiments._llama import llama", "experiments._llama")])
def test_an_experiment_file_of_before_the_move_into_jaxtrain_is_told_the_new_import(line, module, tmp_path, monkeypatch):
    """models, experiments and sharding_rules were top-level packages of the wheel until 2026-12-06: an experiment file
    copied from tiny.py then imports models.config, which is jaxtrain.models.config now."""
    monkeypatch.chdir(tmp_path)  # no models/ of the checkout's on the path
    (tmp_path / "old.py").write_text(f"{line}\n\ndef config():\n    pass\n")
    top = module.split(".")[0]
    with pytest.raises(UserError, match=f"^experiment file old.py failed to load: ModuleNotFoundError: No module named '{top}'; "
                                        f"jaxtrain's {top} package is jaxtrain.{top} since 2026-12-06: import from jaxtrain.{top} "
                                        f"where the file imports from {top}$"):
        config_lib.load_experiment("old.py")

@pytest.mark.parametrize("key, hint", [
    # a QA report: these printed all 90 keys, or a key of another name ('train' -> 'train.seed', 'model.moe' -> 'model.d_model')
    ("lr", "; did you mean 'optim.lr'?"), ("seed", "; did you mean 'data.seed' or 'train.seed'?"),
    ("mesh.data", "; did you mean 'mesh.ici.data' or 'mesh.dcn.data'?"),
    ("mesh.ici", ", a section; give one of its keys: mesh.ici.data, mesh.ici.expert, mesh.ici.fsdp, mesh.ici.stage, mesh.ici.tensor"),
    ("train", ", a section; give one of its keys: train.compile_cache, train.epochs, train.eval_batches,"),
])
def test_an_unknown_key_names_the_keys_of_that_name_or_section(key, hint):
    with pytest.raises(UserError, match=f"^unknown config key '{key}'{hint}"):
        config_lib.apply_overrides(config_lib.Config(), [f"{key}=1"])


def test_an_experiment_files_values_are_read_as_overrides_are(tmp_path):
    """Dataclasses check no types: a QA report: LogConfig(progress="false") was truthy, and a string learning rate
    a traceback in the range checks."""
    path = tmp_path / "mine.py"
    path.write_text("from jaxtrain.config import Config, LogConfig, OptimConfig, TrainConfig\n\ndef config():\n"
                    "    return Config(log=LogConfig(progress='false'), optim=OptimConfig(offload='no', lr='3e-4'),\n"
                    "                  train=TrainConfig(compile_cache='false', steps='7'))\n")
    cfg = config_lib.load_experiment(str(path))
    assert (cfg.log.progress, cfg.optim.offload, cfg.optim.lr, cfg.train.compile_cache, cfg.train.steps) == (False, False, 3e-4, False, 7)
    path.write_text("from jaxtrain.config import Config, TrainConfig\n\ndef config():\n    return Config(train=TrainConfig(steps=3.5))\n")
    with pytest.raises(UserError, match=rf"^experiment {path}: in the Config its config\(\) returned, train.steps expects int, got 3.5; "
                                        "fix the file$"):
        config_lib.load_experiment(str(path))


@pytest.mark.parametrize("key, ours", [("optim.learning_rate", "optim.lr"), ("train.batch_size", "train.global_batch"),
                                       ("train.max_steps", "train.steps"), ("optim.lrr", "optim.lr"),
                                       ("optim.lr_scheduler_type", "optim.schedule"), ("optim.decay_type", "optim.decay_shape"),
                                       ("mesh.ici.tp", "mesh.ici.tensor"), ("mesh.dcn.pp", "mesh.dcn.stage"),
                                       ("mesh.ici.pipeline", "mesh.ici.stage"), ("log.freq", "log.every"), ("TRAIN.STEPS", "train.steps")])
def test_an_unknown_key_suggests_ours_for_other_frameworks_names(key, ours):
    """optim.learning_rate is spelt more like optim.min_lr_ratio than optim.lr, which difflib alone suggested; it offered
    mesh.ici.fsdp for mesh.ici.tp, log.progress for log.freq, and every key for TRAIN.STEPS."""
    with pytest.raises(UserError, match=f"unknown config key '{key}'; did you mean '{ours}'"):
        config_lib.apply_overrides(config_lib.Config(), [f"{key}=1"])


@pytest.mark.parametrize("item, message", [
    ("optim.lr=-1", "optim.lr=-1.0 must be at least 0"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number, at least 0"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number, at least 0"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5 must be at least 0"),
    ("optim.b1=-0.1", r"optim.b1=-0.1 must be in \[0, 1\)"),
    ("optim.b2=1", r"optim.b2=1.0 must be in \[0, 1\)"),
    ("optim.eps=0", "optim.eps=0.0 must be greater than 0"),
    ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio=1.5 must be in \[0, 1\] \(the share of optim.lr"),
    ("optim.decay_fraction=1.2", r"optim.decay_fraction=1.2 must be in \[0, 1\] \(the share of train.steps optim.schedule=wsd"),
    ("optim.schedule=step", "optim.schedule='step' is not a learning-rate schedule; choose one of cosine, linear, wsd"),
    ("optim.decay_shape=sqrt", "optim.decay_shape='sqrt' is not a decay shape; choose one of linear, 1-sqrt, cosine"),
    ("optim.clip_norm=-1", r"optim.clip_norm=-1.0 must be at least 0 \(0: no clipping\)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be at least 0"),
    ("train.eval_batches=0", "train.eval_batches=0 must be at least 1"),
    ("train.eval_every=-1", r"train.eval_every=-1 must be at least 0 \(0: evaluate only at the end\)"),
    ("train.seed=-1", r"train.seed=-1 must be in \[0, 4294967295\]"),
    ("data.seed=-3", r"data.seed=-3 must be in \[0, 4294967295\]"),
    ("data.val_fraction=1", r"data.val_fraction=1.0 must be in \(0, 1\)"),
    ("log.layer_every=-1", "log.layer_every=-1 must be at least 0"),
    ("log.peak_tflops=0", "log.peak_tflops=0.0 must be greater than 0"),
    ("log.prometheus_port=70000", r"log.prometheus_port=70000 must be in \[1, 65535\]"),
    ("checkpoint.keep_every=-2", "checkpoint.keep_every=-2 must be at least 0"),
    ("train.microbatches=0", "train.microbatches=0 must be at least 1 or 'auto'"),
    ("mesh.ici.data=0", r"mesh.ici.data=0 must be a positive integer or -1 \(fill\)"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be a finite positive number"),
    ("model.rope_theta=-1", "model.rope_theta=-1.0 must be a finite positive number"),
    ("model.rope_theta=inf", "model.rope_theta=inf must be a finite positive number"),
    ("model.init_std=inf", "model.init_std=inf must be a finite positive number"),
    # the sub-keys of a feature that is off are checked too (a QA report: accepted, ignored)
    ("model.moe.top_k=0", "model.moe.top_k=0 must be at least 1"),
    ("model.moe.capacity_factor=-1", "model.moe.capacity_factor=-1.0 must be a finite positive number"),
    ("model.moe.aux_loss_weight=inf", r"model.moe.aux_loss_weight=inf must be 0 \(off\) or a finite positive number"),
    ("model.lora.alpha=inf", "model.lora.alpha=inf must be a finite positive number"),
    ("model.rope_scaling.factor=inf", "model.rope_scaling.factor=inf and original_max_len=8192 must be finite and positive"),
    ("log.profile_steps=5:200", "log.profile_steps=5:200 ends after train.steps=100; end the range by step 100 or raise train.steps"),
    ("model.head_dim=0", "model.head_dim=0 must be positive, or none for model.d_model / model.num_heads"),
    ("model.head_dim=-2", "model.head_dim=-2 must be positive"),
    # the keys counted from 1 (steps, sequences, positions, checkpoints): 0 is one line, not a run that does nothing
    ("train.steps=0", "train.steps=0 must be at least 1"), ("train.global_batch=0", "train.global_batch=0 must be at least 1"),
    ("data.seq_len=0", "data.seq_len=0 must be at least 1"), ("log.every=0", "log.every=0 must be at least 1"),
    ("checkpoint.every=0", "checkpoint.every=0 must be at least 1"), ("checkpoint.keep=0", "checkpoint.keep=0 must be at least 1"),
    ("optim.loss_scale_period=0", r"optim.loss_scale_period=0 must be in \[1, 2147483647\]"),
    # the train state counts these in int32: larger was jax's OverflowError traceback at the first step (a QA report)
    ("optim.loss_scale_period=2147483648", r"optim.loss_scale_period=2147483648 must be in \[1, 2147483647\]$"),
    ("train.spike_window=3000000000", r"train.spike_window=3000000000 must be in \[2, 2147483647\] \(the steps the mean"),
    (f"train.spike_window={10**400}", rf"train.spike_window={10**400} must be in \[2, 2147483647\]"),  # no float() of it
    ("data.val_fraction=0", r"data.val_fraction=0.0 must be in \(0, 1\)"),
    ("log.profile_steps=0:2", "log.profile_steps='0:2' must be START:END with 0 < START <= END"),  # steps count from 1
    ("train.loss_chunk=-4", r"train.loss_chunk=-4 must be 0 \(off\) or a positive divisor of data.seq_len=256"),
    ("train.microbatches=3", "train.global_batch=32 is not divisible by train.microbatches=3"),
    ("train.microbatches=atuo", "train.microbatches='atuo' must be a positive integer or 'auto'"),
    # anything but sft was read as text: instruction data trained as one stream, the loss on the prompts too
    ("data.format=SFT", "data.format='SFT' must be one of text, sft"),
])
def test_every_numeric_key_is_range_checked(item, message):
    with pytest.raises(UserError, match=message):
        config_lib.check(apply_overrides(Config(), [item]))


@pytest.mark.parametrize("word", ["none", "Null"])
def test_compile_cache_none_is_not_taken_for_a_folder(word):
    """none is every optional key's off; here it had silently made a cache folder named 'none' in the working directory."""
    with pytest.raises(UserError, match=f"train.compile_cache={word} names a folder '{word}', not no cache; give false"):
        config_lib.check(apply_overrides(Config(), [f"train.compile_cache={word}"]))
    config_lib.check(apply_overrides(Config(), [f"train.compile_cache=./{word}"]))


@pytest.mark.parametrize("key, what", [("data.tokenizer", "a tokenizer.json or a directory holding one, or none for raw bytes"),
                                       ("log.wandb", "a W&B project name, or none"), ("log.mlflow", "an MLflow experiment name, or none")])
def test_an_empty_optional_value_is_one_line_not_off(key, what):
    """'' read as off: data.tokenizer="$TOK" with TOK unset trained on raw bytes, recording the working directory as the
    run's tokenizer; log.mlflow="$EXP" logged nowhere."""
    with pytest.raises(UserError) as error:
        config_lib.check(apply_overrides(Config(), [f"{key}="]))
    assert str(error.value) == f"{key} is empty (an unset shell variable?); give {what}"  # alone: not also "needs the package"


def test_the_optimizers_rounding_takes_the_values_next_to_its_limits():
    """Each largest or smallest value the optimizer's dtypes hold as they should (the refused ones: tests/test_cli_errors.py)."""
    assert config_lib.optimizer_rounding_problems(apply_overrides(Config(), [
        "optim.b1=0.99999994", "optim.b2=0.999", "optim.eps=1.18e-38", "optim.lr=3.4e38", "optim.weight_decay=3.4e38"])) == []
    # bfloat16 parameters: the moments are float32 all the same (jaxtrain.optim.in_float32)
    assert config_lib.optimizer_rounding_problems(apply_overrides(Config(), ["model.param_dtype=bfloat16", "optim.b2=0.999"])) == []
    assert len(config_lib.optimizer_rounding_problems(apply_overrides(Config(), ["optim.b1=0.99999998"]))) == 1


def test_defaults_and_boundaries_are_in_range():
    config_lib.check(apply_overrides(Config(), ["optim.lr=0", "optim.warmup_steps=0", "optim.b1=0", "optim.min_lr_ratio=1",
                                                "optim.clip_norm=0", "optim.weight_decay=0", "train.eval_every=0",
                                                "optim.decay_fraction=0"]))
    config_lib.check(apply_overrides(Config(), ["optim.decay_fraction=1", "optim.schedule=wsd"]))
    config_lib.check(apply_overrides(Config(), ["train.steps=1", "checkpoint.keep=1", "checkpoint.every=1", "log.every=1",
                                                "log.profile_steps=1:1", "train.microbatches=32", "train.loss_chunk=256"]))
    config_lib.check(apply_overrides(Config(), ["log.profile_steps=90:100"]))  # through the last step, train.steps=100


@pytest.mark.parametrize("item, package", [("log.mlflow=exp", "mlflow"), ("log.prometheus_port=9100", "prometheus_client"),
                                           ("log.wandb=proj", "wandb")])
def test_exporter_without_its_package_is_one_line(monkeypatch, item, package):
    real = config_lib.importlib.util.find_spec
    monkeypatch.setattr(config_lib.importlib.util, "find_spec", lambda name: None if name == package else real(name))
    with pytest.raises(UserError, match=f"needs the {package} package; pip install "):
        config_lib.check(apply_overrides(Config(), [item]))


def test_a_runs_config_records_its_files_by_absolute_path(tmp_path, monkeypatch):
    """generate and export-hf read config.yaml from wherever they are run: a relative data.tokenizer was 'not found'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "mine.yaml").write_text("extends: fsdp\n")
    cfg = apply_overrides(Config(), ["data.path=data/tokens.bin", "data.tokenizer=tok", "rules=rules/mine.yaml",
                                     "train.compile_cache=cache"])  # a QA report: generate made a new cache beside it
    config_lib.save_yaml(cfg, tmp_path / "config.yaml")
    saved = config_lib.load_run_config(tmp_path)
    assert (saved.data.path, saved.data.tokenizer, saved.rules, saved.train.compile_cache) == (
        str(tmp_path / "data" / "tokens.bin"), str(tmp_path / "tok"), str(tmp_path / "rules" / "mine.yaml"), str(tmp_path / "cache"))
    by_name = apply_overrides(Config(), ["rules=fsdp", "data.tokenizer=/abs/tok"])
    config_lib.save_yaml(by_name, tmp_path / "config.yaml")
    saved = config_lib.load_run_config(tmp_path)
    assert (saved.rules, saved.data.path, saved.data.tokenizer, saved.train.compile_cache) == ("fsdp", None, "/abs/tok", "auto")
    for off in ("false", "true"):
        config_lib.save_yaml(apply_overrides(Config(), [f"train.compile_cache={off}"]), tmp_path / "config.yaml")
        assert config_lib.load_run_config(tmp_path).train.compile_cache is (off == "true")
    # the folder training used: generate read '~/cache' as ./~/cache, a new cache in a folder named '~'
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config_lib.save_yaml(apply_overrides(Config(), ["train.compile_cache=~/cache"]), tmp_path / "config.yaml")
    assert config_lib.load_run_config(tmp_path).train.compile_cache == str(tmp_path / "home" / "cache")
    # the same for the data, the tokenizer and a rule-set file (the shell leaves ~ in data.path=~/corpus as it is: the run
    # said data.path=~/corpus does not exist)
    home = apply_overrides(Config(), ["data.path=~/corpus", "data.tokenizer=~/tok.json", "rules=~/rules/mine.yaml"])
    expected = tuple(str(tmp_path / "home" / p) for p in ("corpus", "tok.json", "rules/mine.yaml"))
    assert (home.data.path, home.data.tokenizer, home.rules) == expected


@pytest.mark.parametrize("body, message", [
    ("train: {stepz: 2}\n", r"config.yaml: unknown config key 'train.stepz'; did you mean 'train.steps'\? \(or a later jaxtrain's key: "
                           r"read this run with that jaxtrain\)$"),
    # where and what: it said only "while parsing a flow sequence" (a QA report)
    ("model: [1\n", r"is not valid YAML at line 2, column 1: expected ',' or '\]', but got '<stream end>' \(while parsing a flow "
                    r"sequence from line 1\)"),
    ("- 1\n", r"must be a mapping of config sections \(model, data, train, ...\), got list"),
    ("", r"config.yaml is empty \(a write cut short\?\); remove it and run the run's `jaxtrain train` command again"),
])
def test_a_damaged_run_config_is_one_line_naming_it(tmp_path, body, message):
    """A QA report: a config.yaml that is not a mapping, or not YAML, was a traceback for generate and export-hf, and a
    key another jaxtrain wrote did not say which file held it."""
    (tmp_path / "config.yaml").write_text(body)
    with pytest.raises(UserError, match=message):
        config_lib.load_run_config(tmp_path)


SAVE_ON_A_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from jaxtrain import config as config_lib
from jaxtrain.errors import UserError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as one on a full disk with ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (37, resource.RLIM_INFINITY))  # the file cut after 'model: ... d_model: 2'
try:
    config_lib.save_yaml(config_lib.apply_overrides(config_lib.Config(), ["train.steps=9"]), Path(sys.argv[1]))
except UserError as e:  # one line, not OSError's traceback
    failed = str(e)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(failed)
"""


def test_a_run_config_that_fails_to_save_leaves_the_one_before(tmp_path):
    """Each start rewrites config.yaml: a full disk mid-write left it cut short, and read back it was another model
    (d_model: 256 cut to d_model: 2) and the default train.steps, or, empty, the default config."""
    config_lib.save_yaml(apply_overrides(Config(), ["train.steps=7"]), tmp_path / "config.yaml")
    done = subprocess.run([sys.executable, "-c", SAVE_ON_A_FULL_DISK, str(tmp_path / "config.yaml")], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == (f"could not write run config {tmp_path / 'config.yaml'}: the file would pass the file size "
                                   "limit (ulimit -f) (File too large); the file there before is kept; raise the limit or "
                                   "write elsewhere"), done.stderr[-2000:]
    saved = config_lib.load_run_config(tmp_path)
    assert (saved.train.steps, saved.model.d_model) == (7, Config().model.d_model)
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temporary file left


def test_the_logical_axes_rule_sets_may_name_are_those_the_built_in_rule_sets_name():
    """A rule for a name outside models.sharding.LOGICAL_AXES is refused (a misspelt `mpl` was ignored): the list must
    hold every name the shipped rule sets give rules for, and nothing they never map (a name the model dropped)."""
    import yaml

    from jaxtrain.partitioning import RULES_DIR, STATE_SECTIONS
    from jaxtrain.models.sharding import LOGICAL_AXES

    named = set()
    for path in RULES_DIR.glob("*.yaml"):
        named |= set(yaml.safe_load(path.read_text())) - {*STATE_SECTIONS, "extends"}
    assert named == set(LOGICAL_AXES) and len(LOGICAL_AXES) == len(set(LOGICAL_AXES))
