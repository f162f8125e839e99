"""Where each parameter lives in a Hugging Face safetensors checkpoint, and reading the slices of it a
device holds.

Our layout differs from transformers': layers are stacked on a leading axis, attention projections keep
the heads apart ((d_model, heads, head_dim) where Hugging Face has (heads * head_dim, d_model)), and dense
weights are (in, out) where torch's Linear is (out, in). A ``TensorMap`` says how one Hugging Face tensor
becomes one layer of a parameter: viewed as ``split`` (merged dimensions apart), transposed by ``perm``.
Both directions use it: import reads the rows and columns of each tensor that one device's block needs,
export writes a gathered layer back in Hugging Face's layout.

No jax import (the directory is checked before jax starts); the arrays are numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxtrain.errors import UserError
from jaxtrain.interop.hf_config import read_json
from jaxtrain.models.config import LlamaConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PYTORCH_FILES = "pytorch_model*.bin"  # transformers' older format, torch pickles: pytorch_model.bin or its shards
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors dtype names -> numpy


@dataclasses.dataclass(frozen=True)
class TensorMap:
    path: tuple[str, ...]  # the parameter in the params tree
    name: str  # Hugging Face tensor name, with '{layer}' in stacked parameters and '{expert}' in experts'
    hf_shape: tuple[int, ...]
    split: tuple[int, ...]  # hf_shape with merged dimensions (heads * head_dim) apart
    perm: tuple[int, ...]  # one layer (one expert of a layer) of ours = hf.reshape(split).transpose(perm)
    layers: int = 0  # stacked layers; 0: not stacked
    experts: int = 0  # mixture-of-experts weights: one Hugging Face tensor per expert, stacked after the layers

    @property
    def stacked(self) -> tuple[int, ...]:
        """Sizes of our leading dimensions that stack Hugging Face tensors: (), (layers,) or (layers, experts)."""
        return tuple(n for n in (self.layers, self.experts) if n)

    def names(self) -> list[str]:
        return [self.tensor_name(index) for index in itertools.product(*map(range, self.stacked))]

    def tensor_name(self, index: tuple[int, ...]) -> str:
        """The Hugging Face tensor at ``index`` of the stacked dimensions."""
        return self.name.format(**dict(zip(("layer", "expert"), index)))

    def groups(self) -> list[list[int]]:
        """The split dimensions each Hugging Face dimension is made of."""
        groups, dim = [], 0
        for size in self.hf_shape:
            group = [dim]
            while math.prod(self.split[d] for d in group) < size:
                dim += 1
                group.append(dim)
            groups.append(group)
            dim += 1
        return groups

    def hf_order(self, layer: np.ndarray) -> np.ndarray:
        """One layer of our parameter as a view whose row-major order is the Hugging Face tensor's (shape ``split``)."""
        return layer.transpose(np.argsort(self.perm))

    def to_hf(self, layer: np.ndarray) -> np.ndarray:
        """One layer of our parameter -> the Hugging Face tensor (a copy where the layouts differ)."""
        return self.hf_order(layer).reshape(self.hf_shape)

    def read_block(self, checkpoint: "Checkpoint", index: tuple[slice, ...], shape: tuple[int, ...], dtype) -> np.ndarray:
        """The block ``index`` of our parameter (global ``shape``), reading only the Hugging Face rows and
        columns it covers: a block of whole heads is a contiguous run of rows."""
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
        lead = len(self.stacked)
        ranges, bounds = [range(*b) for b in bounds[:lead]], bounds[lead:]
        split_bounds = [None] * len(self.split)
        for ours, split_dim in enumerate(self.perm):
            split_bounds[split_dim] = bounds[ours]
        read, view, take = [], [], []
        for group in self.groups():
            (start, stop), inner = split_bounds[group[0]], group[1:]
            rows = math.prod(self.split[d] for d in inner)  # the inner dimensions are read whole
            read.append(slice(start * rows, stop * rows))
            view += [stop - start, *(self.split[d] for d in inner)]
            take += [slice(None), *(slice(*split_bounds[d]) for d in inner)]
        out = None
        for i, stacked_index in enumerate(itertools.product(*ranges)):
            raw = checkpoint.read(self.tensor_name(stacked_index), tuple(read))
            block = raw.reshape(view)[tuple(take)].transpose(self.perm)
            if out is None:
                out = np.empty((math.prod(map(len, ranges)), *block.shape), dtype)
            out[i] = block  # transposed and converted in one copy
        return out.reshape(*map(len, ranges), *out.shape[1:])


def tensor_maps(cfg: LlamaConfig) -> list[TensorMap]:
    """Every parameter of the model and its Hugging Face tensor(s), in Hugging Face's order."""
    d, h, k, hd, m, v, n = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                            cfg.vocab_size, cfg.num_layers)
    layer = "model.layers.{layer}."
    maps = [TensorMap(("embed",), "model.embed_tokens.weight", (v, d), (v, d), (0, 1))]
    for proj, heads in (("q", h), ("k", k), ("v", k)):
        maps.append(TensorMap(("layers", "attn", f"w{proj}"), f"{layer}self_attn.{proj}_proj.weight", (heads * hd, d),
                              (heads, hd, d), (2, 0, 1), n))
        if cfg.qkv_bias:
            maps.append(TensorMap(("layers", "attn", f"b{proj}"), f"{layer}self_attn.{proj}_proj.bias", (heads * hd,),
                                  (heads, hd), (0, 1), n))
    maps += [
        TensorMap(("layers", "attn", "wo"), f"{layer}self_attn.o_proj.weight", (d, h * hd), (d, h, hd), (1, 2, 0), n),
        *(moe_maps(cfg) if cfg.moe.num_experts else swiglu_maps(("layers", "mlp"), f"{layer}mlp.", d, m, n)),
        TensorMap(("layers", "attn_norm", "scale"), f"{layer}input_layernorm.weight", (d,), (d,), (0,), n),
        TensorMap(("layers", "mlp_norm", "scale"), f"{layer}post_attention_layernorm.weight", (d,), (d,), (0,), n),
        TensorMap(("final_norm", "scale"), "model.norm.weight", (d,), (d,), (0,)),
    ]
    if not cfg.tie_embeddings:  # tied models have no lm_head.weight in the file
        maps.append(TensorMap(("lm_head",), "lm_head.weight", (v, d), (v, d), (1, 0)))
    return maps


def swiglu_maps(path: tuple[str, ...], prefix: str, d: int, m: int, layers: int, experts: int = 0,
                names=("gate_proj", "up_proj", "down_proj")) -> list[TensorMap]:
    """A SwiGLU MLP's three weights (an expert's: ``experts`` of them per layer), torch (out, in) -> our (in, out)."""
    gate, up, down = names
    return [TensorMap((*path, "w_gate"), f"{prefix}{gate}.weight", (m, d), (m, d), (1, 0), layers, experts),
            TensorMap((*path, "w_up"), f"{prefix}{up}.weight", (m, d), (m, d), (1, 0), layers, experts),
            TensorMap((*path, "w_down"), f"{prefix}{down}.weight", (d, m), (d, m), (1, 0), layers, experts)]


def moe_maps(cfg: LlamaConfig) -> list[TensorMap]:
    """A mixture-of-experts layer: Qwen2-MoE's names for a model with shared experts, else Mixtral's."""
    d, m, n, e = cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.moe.num_experts
    path, layer = ("layers", "mlp"), "model.layers.{layer}."
    if not cfg.moe.num_shared_experts:  # Mixtral: w1 gate, w3 up, w2 down
        return [TensorMap((*path, "router"), f"{layer}block_sparse_moe.gate.weight", (e, d), (e, d), (1, 0), n),
                *swiglu_maps(path, f"{layer}block_sparse_moe.experts.{{expert}}.", d, m, n, e, ("w1", "w3", "w2"))]
    shared = cfg.moe.num_shared_experts * m
    return [TensorMap((*path, "router"), f"{layer}mlp.gate.weight", (e, d), (e, d), (1, 0), n),
            *swiglu_maps(path, f"{layer}mlp.experts.{{expert}}.", d, m, n, e),
            *swiglu_maps((*path, "shared"), f"{layer}mlp.shared_expert.", d, shared, n),
            TensorMap((*path, "shared_gate"), f"{layer}mlp.shared_expert_gate.weight", (1, d), (1, d), (1, 0), n)]


class Checkpoint:
    """The safetensors files of a Hugging Face model directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), memory-mapped; counts the bytes of tensor data read."""

    def __init__(self, hf_dir: Path):
        # registers bfloat16 with numpy, for the tensors read; here, not at import: loading ml_dtypes took 0.75 s of
        # every command's start, also of those that stop at a mistake in their arguments
        import ml_dtypes  # noqa: F401

        self.dir = hf_dir
        self.bytes_read = 0
        if (hf_dir / SINGLE_FILE).is_file():  # before an index beside it, as transformers reads them
            self.where, self.listing = None, SINGLE_FILE  # every tensor in model.safetensors
        elif (hf_dir / INDEX_FILE).is_file():
            weight_map = read_json(hf_dir / INDEX_FILE).get("weight_map")
            # a file name that is not a string was a TypeError traceback (a QA report)
            if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
                raise UserError(f"{hf_dir / INDEX_FILE} has no weight_map object of tensor names to file names; download the model again")
            self.where, self.listing = dict(weight_map), INDEX_FILE
        elif pickled := sorted(p.name for p in hf_dir.glob(PYTORCH_FILES)):  # "give one with its weights" did not say how
            raise UserError(f"{hf_dir} has its weights as PyTorch pickles ({', '.join(pickled)}), which jaxtrain does not read; "
                            f"save them as safetensors, transformers.AutoModelForCausalLM.from_pretrained('{hf_dir}')"
                            ".save_pretrained(NEW_DIR), and give NEW_DIR")
        else:
            raise UserError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; give a Hugging Face model directory with its weights")
        self._stack = contextlib.ExitStack()
        self._files = {}
        for name in sorted(set(self.where.values()) if self.where else {SINGLE_FILE}):
            path = hf_dir / name
            if not path.is_file():
                self.close()
                raise UserError(f"{path} is missing ({INDEX_FILE} lists it); download the model again")
            try:
                self._files[name] = self._stack.enter_context(safe_open(path, framework="np"))
            except SafetensorError as e:
                self.close()
                raise UserError(f"{path} is not a complete safetensors file ({e}); download it again") from None
        if self.where is None:
            self.where = {t: SINGLE_FILE for t in self._files[SINGLE_FILE].keys()}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _slice(self, name: str):
        file = self.where.get(name)
        if file is None or name not in self._files[file].keys():
            # a tensor the index leaves out is missing from the index, not from a model.safetensors there is none of
            raise UserError(f"tensor {name} is missing from {self.dir / (file or self.listing)}; the model directory does not match "
                            "its config.json")
        return file, self._files[file].get_slice(name)

    def check(self, maps: list[TensorMap]) -> None:
        """Every tensor the model needs is there, with its shape and a dtype we read."""
        for tm in maps:
            for name in tm.names():
                file, tensor = self._slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
                if shape != tm.hf_shape:
                    raise UserError(f"tensor {name} in {self.dir / file} has shape {shape}, expected {tm.hf_shape} from config.json")
                if dtype not in DTYPES:
                    raise UserError(f"tensor {name} in {self.dir / file} has dtype {dtype}; supported: {', '.join(DTYPES)}")

    def model_bytes(self, maps: list[TensorMap]) -> int:
        """Bytes of tensor data the model's tensors take in the files."""
        total = 0
        for name in (n for tm in maps for n in tm.names()):
            tensor = self._slice(name)[1]
            total += math.prod(tensor.get_shape()) * np.dtype(DTYPES[tensor.get_dtype()]).itemsize
        return total

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        block = self._slice(name)[1][index]
        self.bytes_read += block.nbytes
        return block


def check_dir(hf_dir: Path, cfg: LlamaConfig) -> None:
    """Before jax starts: the weight files are there, complete, and hold every tensor with its shape."""
    with Checkpoint(hf_dir) as checkpoint:
        checkpoint.check(tensor_maps(cfg))
