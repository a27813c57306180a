"""The package as a user's own code meets it: hvd_train.train() whatever was imported before it, the app's data/ and
models/ found through the package (never a user's folders of those names), one recipe module, no links in the tree."""
import configparser
import importlib
import pkgutil
import subprocess
import sys

import hvd_train
from conftest import ROOT, job_env

PUBLIC = ("train", "load_trained")


def all_modules():
    """Every module of the app's packages, data/ and models/ included (hostfiles/ holds scripts, run as files)."""
    names = ["hvd_train.hostfiles"]
    for package in ("hvd_train", "hvd_utils", "hvd_train.data", "hvd_train.models"):
        module = importlib.import_module(package)
        names += [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]
    return names


def test_the_api_is_callable_after_every_submodule_was_imported():
    for name in all_modules():
        importlib.import_module(name)
    for name in PUBLIC:
        assert callable(getattr(hvd_train, name)) and not hasattr(getattr(hvd_train, name), "__path__"), name
        assert f"hvd_train.{name}" not in sys.modules, f"hvd_train.{name} is also a module: the function is hidden"


def test_the_folders_beside_the_package_are_its_subpackages_from_the_checkout():
    for name in hvd_train.BESIDE:
        module = importlib.import_module(f"hvd_train.{name}")
        assert module.__file__ == str(ROOT / name / "__init__.py")
    assert importlib.import_module("hvd_train.data.catalog").__file__ == str(ROOT / "data" / "catalog.py")


def test_setup_cfg_lists_every_package_and_maps_the_folders_beside_it():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {"hvd_train", "hvd_utils", *(f"hvd_train.{name}" for name in hvd_train.BESIDE)}
    for top in ("hvd_train", "hvd_utils"):
        found |= {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found
    mapped = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
    assert mapped == {f"hvd_train.{name}": name for name in hvd_train.BESIDE}


def test_the_tree_holds_no_symbolic_link():
    entries = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert not [line for line in entries.splitlines() if line.startswith("120000")]


def shadowing_project(root):
    """A user's folder whose data/, models/ and train_hvd.py fail loudly if anything imports them."""
    for name in ("data", "models", "hostfiles"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('the project\\'s own {name} was imported')\n")
    (root / "train_hvd.py").write_text("raise ImportError('the project\\'s own train_hvd was imported')\n")
    return root


def run_in(project, *args):
    proc = subprocess.run([sys.executable, *args], cwd=project, env=job_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_projects_own_folders_and_recipe_never_shadow_the_apps(tmp_path):
    project = shadowing_project(tmp_path / "project")
    # python -c puts the working directory first on the module search path; the second is what hvd-train runs.
    shown = run_in(project, "-c", "import hvd_train.data, hvd_train.models, hvd_train.hostfiles.validate, json; "
                   "print(json.dumps([hvd_train.data.__file__, hvd_train.models.__file__]))")
    assert str(ROOT / "data") in shown and str(ROOT / "models") in shown
    cli = "import sys; sys.argv = ['hvd-train', '--help']; import hvd_train.app; hvd_train.app.cli()"
    assert "--batch-size" in run_in(project, "-c", cli)
    # A user's script beside its own train_hvd.py: hvd_train.train() runs the app's recipe, as one module.
    (project / "mine.py").write_text(
        "import sys, hvd_train, hvd_train.app\n"
        "main = hvd_train.app.recipe_main()\n"
        "import train_hvd\n"
        "assert train_hvd.main is main and train_hvd.__file__ == str(hvd_train.app.RECIPE), train_hvd.__file__\n"
        "sys.exit(hvd_train.train(argv=['--help']))\n")
    project.joinpath("train_hvd.py").unlink()
    assert "--batch-size" in run_in(project, "mine.py")
    # A user's own train_hvd, imported first, keeps its name and its code; the app's recipe runs beside it.
    (project / "train_hvd.py").write_text("MINE = True\n")
    (project / "first.py").write_text(
        "import sys, train_hvd, hvd_train, hvd_train.app\n"
        "main = hvd_train.app.recipe_main()\n"
        "assert main is hvd_train.app.recipe_main() and sys.modules['train_hvd'].MINE\n"
        "assert sys.modules['hvd_train._recipe'].__file__ == str(hvd_train.app.RECIPE)\n"
        "sys.exit(hvd_train.train(argv=['--help']))\n")
    assert "--batch-size" in run_in(project, "first.py")
    shadowing_project(tmp_path / "other")
    (tmp_path / "other" / "mine.py").write_text(
        "import sys, hvd_train\nsys.exit(hvd_train.train(argv=['--help']))\n")
    assert "--batch-size" in run_in(tmp_path / "other", "mine.py")
