"""jaxtrain installed from its wheel, not run from the checkout: the wheel holds every file of the packages (the
named experiments, meshes and rule sets are data the commands look up at run time), and an installed copy finds
them from a directory of the user's own."""

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from jaxtrain import config, partitioning

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = [pattern.rstrip("*") for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (an in-tree build leaves build/ and *.egg-info in the checkout)."""
    pytest.importorskip("setuptools", minversion="68")  # pyproject.toml's build requirement
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True)
    (built,) = (tmp / "dist").glob("jaxtrain-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_packages(wheel):
    """A package-data pattern that misses a file (a new mesh folder, a YAML beside the code) or a folder without its
    __init__.py leaves it out of the wheel without a word: the checkout runs and the installed command does not."""
    in_source = {p.relative_to(REPO).as_posix() for name in PACKAGES for p in (REPO / name).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert in_source - in_wheel == set()
    looked_up = (config.MESHES_DIR / "cpu8.yaml", partitioning.RULES_DIR / "fsdp_tp.yaml", config.EXPERIMENTS_DIR / "tiny.py")
    assert {p.relative_to(REPO).as_posix() for p in looked_up} <= in_wheel
    entry_points = next(n for n in in_wheel if n.endswith(".dist-info/entry_points.txt"))
    assert "jaxtrain = jaxtrain.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_an_installed_copy_finds_its_experiments_meshes_and_rule_sets_from_the_users_directory(wheel, tmp_path):
    site, user = tmp_path / "site", tmp_path / "project"
    user.mkdir()
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel's install, less pip's start-up
    probe = """
import json, sys
from jaxtrain import config, partitioning
cfg = config.load_experiment("tiny")
print(json.dumps({"experiments": str(config.EXPERIMENTS_DIR), "meshes": str(config.MESHES_DIR),
                  "rules": str(partitioning.RULES_DIR), "tiny_rules": cfg.rules, "tiny_mesh": config.to_dict(cfg)["mesh"],
                  "rule_sets": sorted(p.stem for p in partitioning.RULES_DIR.glob("*.yaml")),
                  "fsdp_tp": {k: list(v) if v else v for k, v in partitioning.load_rules("fsdp_tp").items()}}))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for key in ("experiments", "meshes", "rules"):
        assert Path(found[key]).is_relative_to(site), (key, found[key])
    assert found["tiny_rules"] == "fsdp_tp" and found["tiny_mesh"]["ici"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1}
    assert found["rule_sets"] == sorted(p.stem for p in partitioning.RULES_DIR.glob("*.yaml"))
    assert found["fsdp_tp"]["embed"] == ["fsdp"]


def test_a_users_own_models_experiments_and_sharding_rules_packages_are_theirs(wheel, tmp_path):
    """The wheel claims the top-level name jaxtrain alone. It installed top-level models, experiments and
    sharding_rules packages: a user's project with its own models/ package or models.py (Django's layout), run as
    `python -m jaxtrain`, from a notebook or with the project on PYTHONPATH, broke jaxtrain's imports ("No module named
    'models.config'", a traceback), the user's own `import models` got jaxtrain's once jaxtrain was imported, and pip
    wrote over another distribution's files of those names."""
    assert {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name} == {"jaxtrain"}
    site, user = tmp_path / "site", tmp_path / "project"
    zipfile.ZipFile(wheel).extractall(site)
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("OWNER = 'user'\n")
    (user / "experiments.py").write_text("OWNER = 'user'\n")
    (user / "sharding_rules").mkdir()
    (user / "sharding_rules" / "__init__.py").write_text("OWNER = 'user'\n")
    probe = """
from jaxtrain import config, partitioning
assert config.load_experiment("tiny").rules == "fsdp_tp" and partitioning.load_rules("fsdp_tp")["embed"] == ("fsdp",)
import models, experiments, sharding_rules
print(models.OWNER, experiments.OWNER, sharding_rules.OWNER)
"""
    # `python -c` puts the working directory first on sys.path, as `python -m jaxtrain` and a notebook do
    result = subprocess.run([sys.executable, "-c", probe], cwd=user, env={**os.environ, "PYTHONPATH": str(site)},
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "user user user\n"), result.stderr[-2000:]
