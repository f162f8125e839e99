"""Logical axis rules: load a rule set, check it against the mesh and the model, and turn logical
axis names into PartitionSpecs / NamedShardings."""

from __future__ import annotations

import contextlib
import difflib
import math
from pathlib import Path

import jax
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import sharding_rules
from jaxtrain.config import moved_file_hint, read_yaml_mapping
from jaxtrain.errors import UserError
from jaxtrain.mesh import describe_axes
from jaxtrain.models.sharding import LOGICAL_AXES, MissingLogicalRule, RepeatedMeshAxis

RULES_DIR = Path(sharding_rules.__file__).parent

Rules = dict[str, tuple[str, ...] | None]


# Optional sections of a rule file: logical-axis overrides for the optimizer state and the gradients, so
# one file says how ZeRO-1/2 place them apart from the parameters (absent: they follow the parameters).
STATE_SECTIONS = ("optimizer_state", "gradients")


def _did_you_mean(word, choices) -> str | None:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return close[0] if close else None


def _rule_path(name_or_path: str, extended_by: Path | None = None) -> Path:
    """The file of ``--rules NAME|FILE``, or of ``extends: NAME|FILE`` in rule file ``extended_by``."""
    path = Path(name_or_path)
    if not path.is_file():
        path = RULES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))
        what = f"rule set '{name_or_path}'" if extended_by is None else f"rule set {extended_by}: extends '{name_or_path}', which"
        if name_or_path and Path(name_or_path).is_dir():  # it was "not found; did you mean 'tp'?" for /tmp (Path("") is ".")
            raise UserError(f"{what} is a directory; give a rule-set YAML file or one of: {', '.join(names)}")
        close = _did_you_mean(name_or_path, names)
        hint = moved_file_hint(name_or_path, RULES_DIR) or (f"did you mean '{close}'? " if close else "")
        raise UserError(f"{what}{' is' if extended_by else ''} not found; {hint}give a path or one of: {', '.join(names)}")
    return path


def _rule_file(name_or_path: str) -> tuple[Path, dict]:
    path = _rule_path(name_or_path)
    body = read_yaml_mapping(path, "rule set", "a mapping of logical axis names to mesh axes")
    if not body:  # an empty or comment-only file was told to add 'vocab: null', the first parameter's axis
        raise UserError(f"rule set {path} is empty; give a rule per logical axis, or 'extends: NAME' (e.g. extends: fsdp_tp) "
                        "and the rules that differ")
    return path, body


def _base_rule_set(path: Path, base: str) -> str:
    """What ``extends: base`` in rule file ``path`` names: a file beside it (a relative path is read from the file's
    directory, not the working directory, which a resumed run or ``generate`` elsewhere need not share), else what
    ``--rules base`` names (a shipped rule set, or a path from the working directory)."""
    beside = path.parent / base
    return str(beside) if beside.is_file() else base


def _parse_rules(body: dict, where: str, sections: tuple[str, ...] = ()) -> Rules:
    """``sections``: the other keys the mapping may hold (a rule file's top level), offered for a misspelt one too."""
    rules: Rules = {}
    for logical, target in body.items():
        if logical not in LOGICAL_AXES:
            close = _did_you_mean(logical, (*LOGICAL_AXES, *sections))
            hint = (f"did you mean the section '{close}'?" if close in STATE_SECTIONS else f"did you mean '{close}'?" if close
                    else f"the model's logical axes are {', '.join(LOGICAL_AXES)}")
            raise UserError(f"rule set {where}: '{logical}' is not a logical axis of the model; {hint}")
        if isinstance(target, list) and len(set(target)) < len(target):
            raise UserError(f"rule set {where}: '{logical}' names a mesh axis twice in {target}; name each mesh axis once")
        if target is None:
            rules[logical] = None
        elif isinstance(target, str):
            rules[logical] = (target,)
        elif isinstance(target, list) and all(isinstance(t, str) for t in target):
            rules[logical] = tuple(target) or None
        else:
            raise UserError(f"rule set {where}: '{logical}' must map to a mesh axis name, a list of them, or null; got {target!r}")
    return rules


def load_rules(name_or_path: str, _extending: tuple[Path, ...] = ()) -> Rules:
    """A rule set maps each logical axis name to a mesh axis, a list of mesh axes, or null; ``extends: NAME``
    starts from rule set NAME and overrides its entries (e.g. a pipeline on top of fsdp_tp)."""
    path, body = _rule_file(name_or_path)
    chain = _extending + (path.resolve(),)
    rules: Rules = {}
    base = body.pop("extends", None)
    if base is not None:
        if not isinstance(base, str) or _rule_path(_base_rule_set(path, base), extended_by=path).resolve() in chain:
            raise UserError(f"rule set {path}: 'extends' must name another rule set without a cycle, got {base!r}")
        rules = load_rules(_base_rule_set(path, base), chain)
    return rules | _parse_rules({k: v for k, v in body.items() if k not in STATE_SECTIONS}, str(path), ("extends", *STATE_SECTIONS))


def load_state_rules(name_or_path: str) -> dict[str, Rules]:
    """The rules that place the optimizer state and the gradients: the rule set's own, with the overrides of its
    ``optimizer_state:`` / ``gradients:`` sections (ZeRO-1 and ZeRO-2) on top."""
    base = load_rules(name_or_path)  # checks the ``extends`` chain first
    return {section: base | {logical: nested_under(base.get(logical), targets) for logical, targets in overrides.items()}
            for section, overrides in _section_overrides(name_or_path).items()}


def nested_under(own: tuple[str, ...] | None, targets: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """A section's mesh axes for a logical axis, the parameters' own axes first where it splits over at least them:
    each device's slice of the state then lies inside its slice of the weight, so the update is computed on a local
    slice of the gradient and its all-gather over the other axes rebuilds the weight's shard. In another order
    (``embed: [data, fsdp]`` over fsdp_tp's ``embed: fsdp``) a device's slice lay in another device's shard: XLA moved
    the updates by collective permutes over data x fsdp and gathered twice the bytes (test_hlo_report.py)."""
    if not own or not targets or not set(own) <= set(targets):
        return targets
    return own + tuple(axis for axis in targets if axis not in own)


def _section_overrides(name_or_path: str) -> dict[str, Rules]:
    """Each section's overrides, those of the rule set it ``extends`` first: a file extending zero2 had lost ZeRO-2's
    sections, its optimizer state and gradients whole on every device with no word."""
    path, body = _rule_file(name_or_path)
    base = load_rules(name_or_path)
    extends = body.get("extends")
    out = _section_overrides(_base_rule_set(path, extends)) if extends is not None else {section: {} for section in STATE_SECTIONS}
    for section in STATE_SECTIONS:
        overrides = body.get(section) or {}
        if not isinstance(overrides, dict):
            raise UserError(f"rule set {path}: '{section}' must map logical axis names to mesh axes, got {overrides!r}")
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            raise UserError(f"rule set {path}: '{section}' overrides {', '.join(unknown)}, which the rule set does not map; "
                            f"override only its logical axes ({', '.join(base)})")
        out[section] = out[section] | _parse_rules(overrides, f"{path} ({section})")
    return out


def check_rules_against_mesh(rules: Rules, mesh: Mesh, source: str) -> None:
    for logical, targets in rules.items():
        for axis in targets or ():
            if axis not in mesh.axis_names:
                raise UserError(
                    f"rule set {source}: '{logical}' maps to mesh axis '{axis}', which the mesh does not have "
                    f"(mesh axes: {', '.join(mesh.axis_names)})")


def flax_rules(rules: Rules) -> tuple:
    """The rules in the form flax's ``logical_axis_rules`` context expects (read by jaxtrain/models/sharding.py)."""
    return tuple((logical, targets[0] if targets and len(targets) == 1 else targets) for logical, targets in rules.items())


@contextlib.contextmanager
def model_tracing(mesh: Mesh, rules: Rules, rules_name: str):
    """The mesh and logical rules the model's activation constraints read while it is traced; an
    activation axis without a rule, or an activation with two dimensions on one mesh axis, becomes a UserError."""
    with jax.set_mesh(mesh), spmd.logical_axis_rules(flax_rules(rules)):
        try:
            yield
        except MissingLogicalRule as e:
            raise UserError(f"logical axis '{e.axis}' (an activation of the model) has no rule in rule set {rules_name}; "
                            f"add '{e.axis}: null' or map it to mesh axes") from None
        except RepeatedMeshAxis as e:
            raise UserError(f"rule set {rules_name}: an activation of the model with logical axes {e.logical_axes} has mesh "
                            f"axis '{e.mesh_axis}' on two of its dimensions ({', '.join(e.clashing)}); map them to different "
                            "mesh axes") from None


def logical_to_spec(logical_axes, rules: Rules, what: str) -> PartitionSpec:
    entries = []
    used = set()
    for axis in logical_axes:
        if axis is None:
            entries.append(None)
            continue
        if axis not in rules:
            raise UserError(f"logical axis '{axis}' (used by {what}) has no rule in the rule set; add '{axis}: null' or map it to mesh axes")
        targets = rules[axis]
        for t in targets or ():
            if t in used:
                raise UserError(f"{what}: mesh axis '{t}' is used by two of its dimensions {tuple(logical_axes)}; map them to different mesh axes")
            used.add(t)
        entries.append(None if targets is None else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*entries)


def param_shardings(logical_axes: dict, shapes: dict, rules: Rules, mesh: Mesh, section: str | None = None) -> dict:
    """NamedSharding per parameter; raises UserError for a dimension its mesh axes do not divide. ``section``: the
    rule-set section (STATE_SECTIONS) the rules are, named in those errors: the parameters' own rules may be fine."""

    def one(path, axes, shape):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        what = f"parameter {name}" + ("" if section is None else f" under rule-set section '{section}'")
        spec = logical_to_spec(axes, rules, what)
        for dim, (logical, entry) in enumerate(zip(axes, spec)):
            mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            ways = math.prod(mesh.shape[a] for a in mesh_axes)
            if shape.shape[dim] % ways:
                sizes = describe_axes({a: mesh.shape[a] for a in mesh_axes})
                raise UserError(
                    f"{what} {tuple(shape.shape)}: dimension {dim} (logical axis '{logical}', size {shape.shape[dim]}) "
                    f"is not divisible by mesh axes {sizes} = {ways}; change the mesh or map '{logical}' to other axes")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, logical_axes, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(rules: Rules, mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a (batch, length, ...) input array."""
    axes = ("activation_batch", "activation_length") + (None,) * (ndim - 2)
    return NamedSharding(mesh, logical_to_spec(axes, rules, "the input batch"))


def logical_ways(rules: Rules, mesh: Mesh, logical: str) -> int:
    """How many ways the rules split a dimension with logical axis ``logical``."""
    return math.prod(mesh.shape[a] for a in rules.get(logical) or ())


def gather_axes(rules: Rules, logical_axes) -> tuple[str, ...]:
    """The batch mesh axes a weight with these logical axes is all-gathered over where it is used (FSDP): all of
    them, except the expert axes for an expert's weights, which stay on their experts' devices."""
    own = (rules.get("experts") or ()) if "experts" in tuple(logical_axes) else ()
    return tuple(a for a in rules.get("activation_batch") or () if a not in own)


def batch_shards(rules: Rules, mesh: Mesh) -> int:
    """How many ways the batch dimension is split."""
    return logical_ways(rules, mesh, "activation_batch")


def spec_axes(spec: PartitionSpec) -> list[str]:
    """Mesh axis names a PartitionSpec uses."""
    return [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
