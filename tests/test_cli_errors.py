"""Every validation error: exit status 2, one line on stderr, no traceback, no run directory. The cases run
`jaxtrain train` in the test's process (an interpreter and jax's import saved per case), as do those of a RUN_DIR
argument that is a file; the last three run the command's entry point in a process of their own."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli, subprocess_env
from jaxtrain import cli
from jaxtrain.__main__ import interrupts_held
from jaxtrain.errors import UserError

FAST = ["train.steps=1", "log.progress=false"]
PIPELINE = ["--rules", "pp_fsdp_tp", "mesh.ici.data=1", "mesh.ici.stage=2"]  # stage 2 x fsdp 2 x tensor 2


def _rules_file(tmp_path: Path, **changes) -> str:
    rules = yaml.safe_load((REPO / "jaxtrain" / "sharding_rules" / "fsdp_tp.yaml").read_text())
    for key, value in changes.items():
        if value is ...:
            del rules[key]
        else:
            rules[key] = value
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return str(path)


def _zero1_over(tmp_path: Path, axis: str) -> str:
    """A ZeRO-1 rule file whose optimizer state is split over ``axis``."""
    path = tmp_path / "zero1_bad.yaml"
    path.write_text(yaml.safe_dump({"extends": "dp", "optimizer_state": {"embed": [axis]}}))
    return str(path)


def _random_bytes(path: Path) -> Path:
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    return path


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _peft_dir(tmp_path: Path) -> str:
    """A PEFT adapter directory as PEFT saves one (adapter_config.json; the weights are not read)."""
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "meta-llama/Llama-3.2-1B", "r": 8, "target_modules": ["q_proj", "v_proj"]}))
    (tmp_path / "peft" / "adapter_model.safetensors").write_bytes(b"")
    return str(tmp_path / "peft")


def _hf_dir(tmp_path: Path, **changes) -> str:
    """A Hugging Face model directory of tiny's shape, its config.json alone (read before any weight file)."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | changes))
    return str(tmp_path / "hf")


def _hf_dir_with_index(tmp_path: Path, weight_map) -> str:
    directory = _hf_dir(tmp_path)
    (Path(directory) / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


CASES = {
    "rule names a missing mesh axis": (lambda t: ["--rules", _rules_file(t, embed="pipeline")],
                                       "'embed' maps to mesh axis 'pipeline', which the mesh does not have"),
    # a misspelt name was ignored: the rule it meant to override stayed (a QA report)
    "rule for a logical axis the model lacks": (lambda t: ["--rules", _rules_file(t, mpl=None)],
                                                "rules.yaml: 'mpl' is not a logical axis of the model; did you mean 'mlp'?"),
    # it said the mesh axis was used by two of the parameter's dimensions ('vocab', 'embed')
    "rule naming a mesh axis twice": (lambda t: ["--rules", _rules_file(t, embed=["fsdp", "fsdp"])],
                                      "rules.yaml: 'embed' names a mesh axis twice in ['fsdp', 'fsdp']; name each mesh axis once"),
    "parameter axis without rule": (lambda t: ["--rules", _rules_file(t, mlp=...)],
                                    "logical axis 'mlp' (used by parameter layers/mlp/w_down) has no rule"),
    "activation axis without rule": (lambda t: ["--rules", _rules_file(t, activation_mlp=...)],
                                     "logical axis 'activation_mlp' (an activation of the model) has no rule"),
    # jax's DuplicateSpecError traceback while the step was traced (a QA report)
    "rule putting two dimensions of an activation on one mesh axis": (
        lambda t: ["--rules", _rules_file(t, activation_batch=["data", "fsdp", "tensor"])],
        "rules.yaml: an activation of the model with logical axes ('activation_batch', 'activation_length', 'activation_heads', "
        "'activation_head_dim') has mesh axis 'tensor' on two of its dimensions (activation_batch, activation_heads); map them "
        "to different mesh axes"),
    "dimension not divisible": (lambda t: ["model.num_heads=6", "model.num_kv_heads=3", "model.head_dim=16"],
                                "parameter layers/attn/wk (4, 128, 3, 16): dimension 2 (logical axis 'kv_heads', size 3) is not divisible by mesh axes tensor 2 = 2"),
    "unknown key": (lambda t: ["train.step=3"], "unknown config key 'train.step'; did you mean 'train.steps'?"),
    "wrong type": (lambda t: ["train.steps=many"], "train.steps expects int, got 'many'"),
    # in range, but rounded by the optimizer's float32 to NaN updates, which the health guard saw a step later, the NaN
    # already in the parameters
    "beta that float32 rounds to 1": (lambda t: ["optim.b2=0.99999999"],
                                      "optim.b2=0.99999999 is 1.0 in float32, the optimizer's arithmetic: Adam's bias "
                                      "correction 1 - b2^t is 0 (every update NaN); use at most 0.99999994"),
    "eps that float32 flushes to 0": (lambda t: ["optim.eps=1e-40"],
                                      "optim.eps=1e-40 is below float32's smallest normal number, 1.18e-38, which the optimizer's "
                                      "arithmetic flushes to 0 (0 / 0 where a gradient is 0); use at least 1.18e-38"),
    "learning rate infinite in float32": (lambda t: ["optim.lr=1e39"],
                                          "optim.lr=1e+39 is infinite in float32, the optimizer's arithmetic; use at most 3.4e+38"),
    "unknown remat policy": (lambda t: ["model.remat=some"], "model.remat='some' is not a remat policy"),
    "unknown rule set": (lambda t: ["--rules", "zero9"], "rule set 'zero9' not found; did you mean 'zero2'? give a path or one of: dp, dp_ep, fsdp, fsdp_ep, fsdp_tp, fsdp_tp_ep, pp_dp, pp_fsdp, pp_fsdp_tp, tp"),
    # "not found; did you mean 'tp'?": the directory was found
    "rule set that is a directory": (lambda t: ["--rules", str(t)], "' is a directory; give a rule-set YAML file or one of: dp, dp_ep, "),
    "rule file extending a directory": (lambda t: ["--rules", _rules_file(t, extends=str(t))],
                                        "', which is a directory; give a rule-set YAML file or one of: dp, dp_ep, "),
    # it named train.microbatches=1, which the user never wrote
    "global batch that train.microbatches=auto cannot split": (
        lambda t: ["train.microbatches=auto", "train.global_batch=6"],
        "jaxtrain: error: train.global_batch=6 does not split over the 4 batch shards of the mesh, at any micro-batch count "
        "train.microbatches=auto may choose; use a multiple of 4 (e.g. train.global_batch=8)"),
    # it said "rule set 'fsdp_tpp' not found; give a path or one of: ...", naming neither the file nor the likely one
    "rule file extending a misspelt rule set": (lambda t: ["--rules", _rules_file(t, extends="fsdp_tpp")],
                                                "rules.yaml: extends 'fsdp_tpp', which is not found; did you mean 'fsdp_tp'? give a "
                                                "path or one of: dp, dp_ep, fsdp, "),
    # it listed the model's logical axes, not the section meant
    "misspelt section of a rule file": (lambda t: ["--rules", _rules_file(t, optimizer_stat={"embed": "fsdp"})],
                                        "rules.yaml: 'optimizer_stat' is not a logical axis of the model; did you mean the section "
                                        "'optimizer_state'?"),
    "unknown mesh file": (lambda t: ["--mesh", "tpu9000"], "mesh file 'tpu9000' not found"),
    "mesh file that is not UTF-8": (lambda t: ["--mesh", str(_random_bytes(t / "bin.yaml"))], "bin.yaml is not UTF-8 text; give a YAML mesh file"),
    "rule set that is not UTF-8": (lambda t: ["--rules", str(_random_bytes(t / "bin.yaml"))], "bin.yaml is not UTF-8 text; give a YAML rule set"),
    # it said to add 'vocab: null', the first axis of the first parameter, naming no file (a QA report)
    "empty rule file": (lambda t: ["--rules", str(_text(t / "rules.yaml", "# my rules\n"))],
                        "rules.yaml is empty; give a rule per logical axis, or 'extends: NAME' (e.g. extends: fsdp_tp) and the "
                        "rules that differ"),
    "mesh file that is not a mapping": (lambda t: ["--mesh", str(_text(t / "passwd", "root:x:0:0:root:/root:/bin/bash\n" * 40))],
                                        "passwd must be a mapping with only the keys 'ici' and 'dcn', got str"),  # not the file
    "batch does not split over the mesh": (lambda t: ["train.global_batch=6"], "do not split over the 4 batch shards"),
    # 32 sequences split over the 4 shards, their 16 micro-batches of 2 do not (checked on the batch alone: a traceback)
    "micro-batches do not split over the mesh": (lambda t: ["train.microbatches=16"],
                                                 "train.global_batch=32 / train.microbatches=16 = 2 sequences per micro-batch "
                                                 "do not split over the 4 batch shards of the mesh; use a multiple of 64"),
    "missing data path": (lambda t: ["data.path=/no/such/dir"], "data.path=/no/such/dir does not exist"),
    # the sizes were the dataclass's repr, AxisSizes(data=-1, fsdp=-1, tensor=2, stage=1, expert=1)
    "mesh file that is a directory": (lambda t: ["--mesh", str(t)], "is a directory; give a mesh YAML file or one of: "),
    "two axes to fill": (lambda t: ["mesh.ici.data=-1", "mesh.ici.fsdp=-1"],
                         "at most one mesh.ici axis may be -1, got data -1 x fsdp -1 x tensor 2"),
    "bad flag": (lambda t: ["--devcies", "2"], "unrecognized arguments: --devcies (see 'jaxtrain train --help')"),
    # `--init-from "$CKPT"` with CKPT unset trained from scratch, and an empty --run-dir, --mesh or --rules fell back to
    # the default (a QA report)
    "empty --init-from": (lambda t: ["--init-from", ""],
                          "argument --init-from: expected a value, got an empty string (an unset shell variable?)"),
    "empty --run-dir": (lambda t: ["--run-dir="], "argument --run-dir: expected a value, got an empty string"),
    "device count in another script's digits": (lambda t: ["--devices", "\u0668"],  # int() reads it as 8
                                                "argument --devices: expected a positive integer, got '\u0668'"),
    "no devices": (lambda t: ["--devices", "0"], "argument --devices: expected a positive integer, got '0'"),  # read as unset
    # past XLA:CPU's 2048: minutes to start and stop, then a traceback at the compile (past int32, XLA's whole flag table)
    "more devices than XLA:CPU compiles for": (lambda t: ["--devices", "2049"],
                                               "argument --devices: expected at most 2048 simulated CPU devices, as many as XLA:CPU "
                                               "compiles a program for, got '2049'"),
    # int32 in jax: its coordinator's TypeError traceback
    "more processes than jax counts": (lambda t: ["--num-processes", str(10**20), "--process-id", "0", "--coordinator", "localhost:26199"],
                                       f"argument --num-processes: expected a positive integer of at most 2147483647, got '{10**20}'"),
    # it trained from scratch: the flag has nothing to take the parameters of
    "--params-only without --init-from": (lambda t: ["--params-only"], "--params-only needs --init-from PATH"),
    "cuDNN attention without a GPU": (lambda t: ["model.attention=cudnn"],
                                      "model.attention=cudnn (cuDNN flash attention) runs only on NVIDIA GPUs and these devices are cpu; use model.attention=auto or xla"),
    "negative learning rate": (lambda t: ["optim.lr=-1"], "optim.lr=-1.0 must be at least 0"),
    "negative warmup": (lambda t: ["optim.warmup_steps=-5"], "optim.warmup_steps=-5 must be at least 0"),
    "run directory inside a file": (lambda t: ["--run-dir", str(_random_bytes(t / "notes") / "run")],
                                    "/notes is a file, not a directory; give a path inside a directory"),
    "token file that is not a .npy file": (lambda t: [f"data.path={_random_bytes(t / 'tokens.npy')}"],
                                           "tokens.npy is not a .npy file of a 1-D integer array (numpy.save): no .npy header"),
    "pipelined rule set on a mesh without stages": (lambda t: ["--rules", "pp_fsdp_tp"],
                                                    "rule set pp_fsdp_tp splits the layers into pipeline stages over mesh axis stage, but the mesh (data 2 x fsdp 2 x tensor 2) has size 1 there"),
    "layers not divisible into stages x repeats": (lambda t: [*PIPELINE, "model.pipeline.repeats=3"],
                                                   "model.num_layers=4 does not split into 2 stages x model.pipeline.repeats=3"),
    "fewer pipeline micro-batches than stages": (lambda t: [*PIPELINE, "model.pipeline.microbatches=1"],
                                                 "model.pipeline.microbatches=1 is fewer than the 2 pipeline stages"),
    "batch not divisible into pipeline micro-batches": (lambda t: [*PIPELINE, "model.pipeline.microbatches=3"],
                                                        "= 32 sequences do not split into model.pipeline.microbatches=3 micro-batches over the 2 batch shards"),
    # 32 micro-batches of one sequence each, which the 2 batch shards cannot split
    "pipeline micro-batches smaller than the batch shards": (
        lambda t: [*PIPELINE, "model.pipeline.microbatches=32"],
        "= 32 sequences do not split into model.pipeline.microbatches=32 micro-batches over the 2 batch shards"),
    # memory techniques (issue 12): optim.offload on devices without host memory is tests/test_memory.py's (CPUs have it)
    "optimizer state over a mesh axis the mesh lacks": (lambda t: ["--rules", _zero1_over(t, "pipeline")],
                                                        "zero1_bad.yaml (optimizer_state): 'embed' maps to mesh axis 'pipeline', which the mesh does not have"),
    # it named the parameter alone, whose own rules were fine (a QA report)
    "optimizer state splitting two dimensions over one mesh axis": (
        lambda t: ["--rules", _rules_file(t, optimizer_state={"embed": "tensor"})],
        "parameter embed under rule-set section 'optimizer_state': mesh axis 'tensor' is used by two of its dimensions ('vocab', 'embed')"),
    "unknown model.quant": (lambda t: ["model.quant=int4"], "model.quant='int4' is unknown"),
    "unknown model.scan_layers": (lambda t: ["model.scan_layers=sometimes"],
                                  "model.scan_layers='sometimes' is unknown; choose true, false or auto"),
    # each was a TypeError traceback ("data type 'bf16' not understood") with the check left out: no test had one
    "unknown compute dtype": (lambda t: ["model.dtype=bf16"],
                              "model.dtype='bf16' is not supported; choose one of float32, bfloat16, float16"),
    "unknown parameter dtype": (lambda t: ["model.param_dtype=fp32"],
                                "model.param_dtype='fp32' is not supported; choose one of float32, bfloat16, float16"),
    "float16 without master weights": (lambda t: ["model.dtype=float16", "model.param_dtype=float16"],
                                       "model.param_dtype=float16 (with model.dtype=float16) keeps no float32 master weights"),
    "unknown gradient dtype": (lambda t: ["optim.grad_dtype=float16"], "optim.grad_dtype='float16' must be float32 or bfloat16"),
    "bfloat16 gradient sums with split weights": (
        lambda t: ["optim.grad_dtype=bfloat16"],
        "optim.grad_dtype=bfloat16 needs pure data parallelism (parameters whole on every device, every mesh axis a batch axis), "
        "but rule set fsdp_tp on mesh {'data': 2, 'fsdp': 2, 'tensor': 2, 'stage': 1, 'expert': 1} splits parameters over fsdp, "
        "tensor and has axes that split no batch: tensor; use rules=dp"),
    "unknown gradient sync": (lambda t: ["optim.grad_sync=never"], "optim.grad_sync='never' must be one of auto, step, microbatch"),
    "compilation cache in a folder that cannot be made": (lambda t: [f"train.compile_cache={_random_bytes(t / 'notes')}/xla"],
                                                          "/notes/xla (NotADirectoryError: Not a directory); give a writable folder, or train.compile_cache=false"),
    "empty compilation cache path": (lambda t: ["train.compile_cache="], "train.compile_cache is empty; give auto, a folder path, or false"),
    "empty data path": (lambda t: ["data.path="], "data.path is empty; give a directory of text files, a .jsonl file or a token file"),
    "empty tokenizer": (lambda t: ["data.tokenizer="], "data.tokenizer is empty (an unset shell variable?); give a tokenizer.json"),
    # a TypeError traceback from the range checks
    "Hugging Face config.json with a size that is not a number": (
        lambda t: ["--init-from", _hf_dir(t, num_hidden_layers="four", rope_theta=None)],
        "hf/config.json: num_hidden_layers='four', rope_theta=None: expected a number (a whole one for a size); download the model again"),
    "Hugging Face config.json with rope_scaling a string": (  # an AttributeError traceback
        lambda t: ["--init-from", _hf_dir(t, rope_scaling="linear")],
        "hf/config.json: rope_scaling='linear': expected an object (rope_type and its numbers) or null; download the model again"),
    "Hugging Face config.json with tie_word_embeddings a string": (  # read as true: tied embeddings
        lambda t: ["--init-from", _hf_dir(t, tie_word_embeddings="false")],
        "hf/config.json: tie_word_embeddings='false': expected true or false; download the model again"),
    "Hugging Face weight_map naming a file by a number": (  # a TypeError traceback
        lambda t: ["--init-from", _hf_dir_with_index(t, {"model.embed_tokens.weight": 5})],
        "hf/model.safetensors.index.json has no weight_map object of tensor names to file names; download the model again"),
    # it trained, writing the run's files among the model's
    "--run-dir a Hugging Face model directory": (lambda t: ["--run-dir", _hf_dir(t)],
                                                 "hf is a Hugging Face model directory (config.json); give a new directory for the run, "
                                                 "and --init-from "),
    "--init-from a path with no checkpoints": (lambda t: ["--init-from", str(t / "nonexistent")],
                                               "nonexistent: no checkpoints there; give a run directory"),
    "--init-from a PEFT adapter directory": (  # it was "no checkpoints there; give a run directory, ..."
        lambda t: ["--init-from", _peft_dir(t)],
        "peft is a PEFT adapter (adapter_config.json), which holds adapters, not a model to start from: give its base model "
        "(meta-llama/Llama-3.2-1B), a Hugging Face model directory, to --init-from (new adapters on it: model.lora.rank > 0), and "
        "the adapter to jaxtrain generate BASE_DIR --adapter "),
}


def _one_line_error(status, stderr: str) -> str:
    """The error line of a command that must fail with exit status 2 and that one line."""
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxtrain: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_validation_error(case, tmp_path, monkeypatch, capsys):
    make_args, message = CASES[case]
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    jax.devices()  # the test's 8 devices started, whatever device count the command asks XLA for
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # which it writes there
    try:
        status = cli.main(["train", "tiny", "--run-dir", str(run_dir), *FAST, *make_args(tmp_path)])
    except SystemExit as e:  # argparse's errors
        status = e.code
    assert message in _one_line_error(status, capsys.readouterr().err)
    assert not run_dir.exists()


@pytest.mark.parametrize("command", [["checkpoints"], ["plot"], ["export-hf", "--out", "hf"]])
def test_a_run_dir_argument_that_is_a_file(command, tmp_path, monkeypatch, capsys):
    """Not "does not exist", nor an error about an --out under it that was not given."""
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("notes")
    status = cli.main([command[0], "afile", *command[1:]])
    assert _one_line_error(status, capsys.readouterr().err) == \
        "jaxtrain: error: afile is a file, not a run directory; give the --run-dir of a training run"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


@pytest.mark.parametrize("command", [["checkpoints", "run", "other"], ["adapters", "run", "other"],
                                     ["generate", "run", "other", "--prompt", "hi"]])
def test_a_command_that_takes_no_overrides_refuses_an_extra_argument(command, capsys):
    """`jaxtrain checkpoints run other` listed run's alone, the second directory ignored without a word."""
    with pytest.raises(SystemExit) as exit:
        cli.main(command)
    assert _one_line_error(exit.value.code, capsys.readouterr().err) == \
        f"jaxtrain: error: unrecognized arguments: other (see 'jaxtrain {command[0]} --help')"


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_missing_experiment_names_it_alone(command, capsys):
    """The overrides are optional: the line read 'the following arguments are required: experiment, key=value'."""
    with pytest.raises(SystemExit) as exit:
        cli.main([command])
    assert _one_line_error(exit.value.code, capsys.readouterr().err) == \
        f"jaxtrain: error: the following arguments are required: experiment (see 'jaxtrain {command} --help')"


def test_a_run_dir_that_cannot_be_made(tmp_path, monkeypatch, capsys):
    """mkdir failing where access(2) let the path pass (a full disk; root, to whom /proc looks writable) was a traceback
    after the compile."""
    run_dir = tmp_path / "run"
    make_dir = Path.mkdir

    def disk_full_at_run_dir(path, *args, **kwargs):
        if path == run_dir:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return make_dir(path, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", disk_full_at_run_dir)
    status = cli.main(["train", "tiny", "--run-dir", str(run_dir), *FAST, "model.num_layers=1", "data.seq_len=32",
                       "train.global_batch=8", "train.eval_batches=1"])
    assert _one_line_error(status, capsys.readouterr().err) == \
        f"jaxtrain: error: --run-dir {run_dir}: cannot make the directory (No space left on device); give a path in a writable directory"
    assert not run_dir.exists()


def test_an_output_on_a_read_only_file_system_says_so(tmp_path, monkeypatch, capsys):
    """A QA report: an output under a read-only mount was "this user cannot write in DIR (permission denied)", which sends
    the user to chmod. access(2) refuses such a directory with EROFS (here to root too: statvfs says read-only)."""
    statvfs = os.statvfs
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
        (*statvfs(path)[:8], statvfs(path).f_flag | (os.ST_RDONLY if Path(path) == tmp_path else 0), statvfs(path).f_namemax)))
    status = cli.main(["tokenize", str(tmp_path), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "new" / "t.bin")])
    assert _one_line_error(status, capsys.readouterr().err) == \
        f"jaxtrain: error: --out {tmp_path / 'new' / 't.bin'}: {tmp_path} is on a read-only file system; give a path on a writable one"


@pytest.mark.parametrize("text, problem", [
    ("{", "is not readable JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[8]", "must hold a JSON object, got list")])
def test_adapters_refuses_a_broken_adapter_config(text, problem, tmp_path, capsys):
    """`jaxtrain adapters DIR` over a PEFT directory whose adapter_config.json is damaged printed a traceback."""
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text(text)
    status = cli.main(["adapters", str(tmp_path)])
    assert _one_line_error(status, capsys.readouterr().err) == \
        f"jaxtrain: error: {tmp_path}/peft/adapter_config.json {problem}; save the adapter again (PEFT's save_pretrained writes it)"


@pytest.mark.parametrize("directory, record, text, problem, fix", [
    ("run", "lora_base.json", '{"path": "/moved/base",}', "is not readable JSON (", "fix it by hand: a JSON object naming the run's base"),
    ("run", "lora_base.json", '{"base": "/moved/base", "hash": "5e"}', "must hold the base's \"path\" (a string, null for a base",
     "fix it by hand"),
    ("peft", "jaxtrain_adapter.json", '{"path": "/moved/base",}', "is not readable JSON (",
     "fix it, or export the adapter again (jaxtrain export-hf writes it)")])
def test_adapters_refuses_a_damaged_record_of_ours(directory, record, text, problem, fix, tmp_path, capsys):
    """A typo in a LoRA run's lora_base.json (edited by hand where its base moved, as an error asks) or in an exported
    adapter's jaxtrain_adapter.json was a JSONDecodeError traceback (a KeyError without "path" or "hash") from every
    command reading it."""
    (tmp_path / directory).mkdir()
    if directory == "peft":
        (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (tmp_path / directory / record).write_text(text)
    status = cli.main(["adapters", str(tmp_path)])
    line = _one_line_error(status, capsys.readouterr().err)
    assert line.startswith(f"jaxtrain: error: {tmp_path}/{directory}/{record} {problem}") and fix in line


def _not_a_lora_run(tmp_path: Path) -> Path:
    from jaxtrain.config import Config, save_yaml

    (tmp_path / "full").mkdir()
    save_yaml(Config(), tmp_path / "full" / "config.yaml")
    return tmp_path / "full"


def _dora_adapter(tmp_path: Path) -> Path:
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    return tmp_path / "dora"


@pytest.mark.parametrize("adapter, message", [
    (_not_a_lora_run, "full has no lora_base.json: it is not a LoRA run (model.lora.rank > 0); train one, or give its --run-dir"),
    (_dora_adapter, "dora/adapter_config.json: use_dora=True: jaxtrain applies plain LoRA adapters only")])
def test_generate_refuses_an_adapter_it_cannot_apply_before_reading_the_base(adapter, message, tmp_path, capsys):
    """The base here is a config.json alone: a mistake in --adapter found only after the whole base was read (minutes on
    a large model) would be reported as the base's missing files, not as the adapter's."""
    status = cli.main(["generate", _hf_dir(tmp_path), "--adapter", str(adapter(tmp_path)), "--prompt", "hi"])
    assert message in _one_line_error(status, capsys.readouterr().err)


def test_sigterm_while_plot_writes_leaves_no_temporary_file(tmp_path, monkeypatch, capsys, sigterm_outside):
    """`jaxtrain plot` (and `plan --plot`) terminated while writing the image left .x.png.*.tmp beside it."""
    from matplotlib.figure import Figure

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    savefig = Figure.savefig

    def savefig_then_terminated(fig, f, **kwargs):
        savefig(fig, f, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(Figure, "savefig", savefig_then_terminated)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")])
    assert stopped.value.code == 143 and capsys.readouterr().err.strip() == "jaxtrain: terminated"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


@pytest.mark.parametrize("text, problem", [(b'{"eos_token": ', "is not valid JSON (Expecting value: line 1 column 15 (char 14))"),
                                           (b"[1]", "must hold a JSON object, got list")])
def test_export_refuses_a_damaged_tokenizer_side_file(text, problem):
    """export-hf of a run whose tokenizer directory holds a damaged special_tokens_map.json printed a traceback."""
    from tokenizers import Tokenizer, models

    from jaxtrain.data import tokenizer

    files = {tokenizer.TOKENIZER_FILE: Tokenizer(models.BPE()).to_str().encode(), tokenizer.SPECIAL_TOKENS_FILE: text}
    with pytest.raises(UserError) as refused:
        tokenizer.special_token_ids(files)
    assert str(refused.value).startswith(f"the special_tokens_map.json to export {problem}; fix it beside tokenizer.json")


def test_mesh_size_differs_from_the_device_count(tmp_path):
    """In a process of its own: --devices sets how many devices jax starts with, once a process."""
    result = run_cli("train", "tiny", "--run-dir", str(tmp_path / "run"), *FAST, "--devices", "4", cwd=tmp_path)
    assert "the mesh has 8 devices (data 2 x fsdp 2 x tensor 2) but 4 device(s) are present" in \
        _one_line_error(result.returncode, result.stderr)
    assert not (tmp_path / "run").exists()


def test_unknown_experiment(tmp_path):
    result = run_cli("train", "nonexistent", cwd=tmp_path)
    assert "unknown experiment 'nonexistent'; available: " in _one_line_error(result.returncode, result.stderr)
    assert not (tmp_path / "runs").exists()


def test_run_dir_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("notes")
    result = run_cli("train", "tiny", "--run-dir", str(not_a_dir), *FAST, cwd=tmp_path)
    assert _one_line_error(result.returncode, result.stderr) == \
        f"jaxtrain: error: --run-dir {not_a_dir} is an existing file, not a directory; give a new or existing run directory"
    assert not_a_dir.read_text() == "notes" and sorted(p.name for p in tmp_path.iterdir()) == ["run"]



DROPPED_SIGNAL = """
import gc, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal leaves it (pytest-xdist's workers ignore it)
from jaxtrain.__main__ import redeliver_dropped_interrupts
from jaxtrain.atomic import Terminated, sigterm_cleans_up
if sys.argv[1] == "command":
    redeliver_dropped_interrupts()  # as the jaxtrain command does first
dropped = []
def collected(phase, info):  # a signal that lands in a garbage-collection callback (jax's, in the imports): raised there
    if not dropped:
        dropped.append(1)
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
gc.callbacks.append(collected)
with sigterm_cleans_up():  # as tokenize, train-tokenizer and export-hf run
    gc.collect()
    try:
        time.sleep(10)
        print("ran on")
    except (KeyboardInterrupt, Terminated):
        print("stopped")
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("hook, outcome", [("command", "stopped"), ("python's", "ran on")])
def test_a_signal_python_drops_in_a_gc_callback_still_stops_the_command(signal_name, hook, outcome):
    """Python drops an exception raised in a gc callback as unraisable, a KeyboardInterrupt too: the command ran on
    and trained to the end (a QA report, 2 of 17 Ctrl-Cs in the first 3 s); a SIGTERM's Terminated too (tokenize ran
    to the end, exit status 0). The command sends the signal again, and says it was terminated once."""
    done = subprocess.run([sys.executable, "-c", DROPPED_SIGNAL, hook, signal_name], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == outcome, done.stderr[-2000:]
    if signal_name == "SIGTERM" and hook == "command":
        assert done.stderr.strip() == "jaxtrain: terminated"


def test_an_empty_prompt_is_a_prompt_where_other_empty_options_are_refused():
    """Empty option values are refused (an unset shell variable: `--init-from "$CKPT"` trained from scratch); a prompt is
    text, and an empty one is a value (with --chat an empty user message)."""
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "run", "--prompt", ""]).prompt == ""
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "run", "--prompt", "hi", "--adapter", ""])


def test_a_ctrl_c_during_the_imports_is_raised_after_them():
    """Raised inside jax's imports, a KeyboardInterrupt could land in a C++ extension's initialization (exit status 134,
    once a segmentation fault): the command holds it until its imports are done; an ignored SIGINT stays ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    went_on = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)
                went_on.append("after the signal")
        assert went_on and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
