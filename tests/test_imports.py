"""The import layering of jaxtrain/ (jaxtrain/models/ among it; docs/ARCHITECTURE.md, "Imports"), read from the source with ``ast``:
no cycle among the modules' imports, and nothing of this tree imported inside a function but to defer a heavy
import; the commands that need no jax load none. (That jaxtrain/models/ never imports the trainer: test_model.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxtrain",)

# in-tree imports inside a function, (importing module, imported module) -> why; each defers a heavy import (jax,
# the stack built on it, matplotlib, tokenizers) to the command or call that needs it. Anything else is a top-level
# import, or a layering debt to fix, not to add here.
_JAX_AFTER_ARGUMENTS = "jax starts after the arguments are read and the environment is set (cli.py's docstring)"
_MATPLOTLIB = "matplotlib (about 1 s) only for a plot"
DEFERRED_IMPORTS = {
    ("jaxtrain.__main__", "jaxtrain.cli"): "the CLI's imports after the jemalloc re-exec, with Ctrl-C held",
    **{("jaxtrain.cli", f"jaxtrain.{name}"): _JAX_AFTER_ARGUMENTS for name in (
        "checkpoint", "train", "adapt.lora", "interop.hf_export", "plan.estimate", "compile_cache", "generate")},
    ("jaxtrain.cli", "jaxtrain.observe.plot"): _MATPLOTLIB,
    ("jaxtrain.plan.estimate", "jaxtrain.observe.plot"): _MATPLOTLIB,
    ("jaxtrain.observe.exporters", "jaxtrain.observe.plot"): _MATPLOTLIB,
    ("jaxtrain.cli", "jaxtrain.data.token_file"): "the tokenizers library only for the tokenizer commands",
    ("jaxtrain.cli", "jaxtrain.data.tokenizer"): "the tokenizers library only for the tokenizer commands",
    ("jaxtrain.data", "jaxtrain.data.pipeline"): "the pipeline's names load on first use: the tokenizer commands start without jax",
    ("jaxtrain.data", "jaxtrain.data.batches"): "as the pipeline's",
    ("jaxtrain.experiments._llama", "jaxtrain.__main__"): "`python EXPERIMENT.py` only: an experiment the CLI loads "
                                                          "imports no CLI",
}


class Import(NamedTuple):
    importer: str
    imported: str
    deferred: bool  # inside a function: runs when called, not when the importer loads
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tree_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _never_runs_on_import(node: ast.If) -> bool:
    """``if TYPE_CHECKING:`` (annotations only) or ``if __name__ == "__main__":`` (the file run as a script)."""
    test = node.test
    if isinstance(test, ast.Name | ast.Attribute):
        return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__" and \
        isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The in-tree modules ``name`` imports: ``from a.b import c`` is a.b.c where that is a module, else a.b. Imports
    that never run when the module is imported (``_never_runs_on_import``) are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _never_runs_on_import(child):
                continue
            inside = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - child.level + 1], *filter(None, [base])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in child.names]
            found.extend(Import(name, t, inside, child.lineno) for t in dict.fromkeys(targets) if t in modules and t != name)
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def import_graph() -> list[Import]:
    modules = tree_modules()
    return [i for name, path in modules.items() for i in imports_of(name, path, modules)]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The import cycles among ``edges``, each as a path around it (one per edge back into a depth-first walk's path)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, []).append(e.imported)
    found, on_path, done = [], [], set()

    def walk(module: str) -> None:
        on_path.append(module)
        for nxt in graph.get(module, []):
            if nxt in on_path:
                found.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt)
        done.add(on_path.pop())

    for module in sorted(graph):
        if module not in done:
            walk(module)
    return found


def test_no_import_cycles_in_jaxtrain():
    """Among the imports that run when a module loads (a cycle then leaves one module half-initialised, by import
    order) and those inside functions (a cycle dodged by importing late) alike."""
    assert cycles(import_graph()) == []


def test_nothing_of_the_tree_is_imported_inside_a_function_but_to_keep_jax_out():
    found = {(i.importer, i.imported): f"{i.importer}:{i.line}" for i in import_graph() if i.deferred}
    assert {k: v for k, v in found.items() if k not in DEFERRED_IMPORTS} == {}
    assert set(DEFERRED_IMPORTS) <= set(found), "an allowed deferred import that no longer exists: drop it from the list"


def test_the_cycle_finder_finds_a_cycle_and_reads_from_imports():
    """The tool itself, on a made-up tree: a -> b -> c -> a through ``from x import module`` and ``import x.y``."""
    edges = [Import("p.a", "p.b", False, 1), Import("p.b", "p.c", True, 1), Import("p.c", "p.a", False, 1), Import("p.a", "p.d", False, 2)]
    assert cycles(edges) == [["p.a", "p.b", "p.c", "p.a"]]
    modules = tree_modules()
    llama = imports_of("jaxtrain.models.llama", modules["jaxtrain.models.llama"], modules)
    assert {"jaxtrain.models.moe", "jaxtrain.models.layers", "jaxtrain.models.pipeline"} <= {i.imported for i in llama}


def test_the_cli_and_the_tokenizer_commands_modules_load_without_jax_or_ml_dtypes():
    """cli.py imports jax only after the arguments are read (XLA's environment set first), and the tokenizer commands
    never: until 2026-12-06 the PEFT reader's import of models.lora (for one naming function) loaded jax and flax with
    the CLI, 3.4 s of imports. Nor ml_dtypes (0.75 s, the Hugging Face reader's until it opens a checkpoint): a command
    that stops at a mistake in its arguments took a second."""
    code = ("import sys, jaxtrain.cli, jaxtrain.data, jaxtrain.data.token_file; "
            "print(sorted({'jax', 'flax', 'ml_dtypes'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_trainer_loads_without_matplotlib():
    """matplotlib (0.4 s of each `jaxtrain train` start) loads for a plot only: the MLflow exporter's at the run's end
    had it imported with the trainer."""
    code = "import sys, jaxtrain.train; print('matplotlib' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"
