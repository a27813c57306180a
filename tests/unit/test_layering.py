"""The floor plan as a contract (docs/architecture.md): its figures, read from the source by scripts/floor_plan.py,
and import-linter's contracts (setup.cfg [importlinter], run by `make lint`), which a cycle added to the package
breaks."""
import importlib.util
import shutil
import subprocess
import sys

from conftest import ROOT


def floor_plan(root=ROOT):
    spec = importlib.util.spec_from_file_location("floor_plan", root / "scripts" / "floor_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_its_floor_plan():
    plan = floor_plan().measure()
    assert len(plan.modules) <= 70, plan.modules
    assert len(plan.flat) <= 12, plan.flat
    assert plan.cycles == []
    assert len(plan.chain) <= 9, plan.chain
    assert len(plan.torch_io) <= 2, plan.torch_io
    assert plan.annotated >= 0.6 * plan.public, (plan.annotated, plan.public)


def copy_of_the_package(tmp_path):
    for folder in ("hvd_train", "hvd_utils", "data", "models", "hostfiles"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "scripts").mkdir()
    for script in ("check_layers.py", "floor_plan.py"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts" / script)
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    return tmp_path


def lint_imports(root):
    return subprocess.run([sys.executable, str(root / "scripts" / "check_layers.py"), "--imports"],
                          capture_output=True, text=True)


def test_an_import_cycle_even_inside_a_function_breaks_the_lint(tmp_path):
    root = copy_of_the_package(tmp_path)
    kept = lint_imports(root)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    # The lowest room reaches back up to the trainer, from inside a function (as the old cycles hid themselves).
    with open(root / "hvd_train" / "errors.py", "a") as f:
        f.write("\n\ndef _reach_back():\n    from hvd_train import trainer\n\n    return trainer\n")
    broken = lint_imports(root)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "No import cycle between modules or packages at any depth" in broken.stdout
    assert "BROKEN" in broken.stdout and "hvd_train.errors" in broken.stdout
    assert any("hvd_train.errors" in cycle for cycle in floor_plan(root).measure().cycles)


def test_the_app_trains_without_torchvision(tmp_path):
    """torchvision is optional (image folders, timm's policies, torchvision's models need it): the training path
    imports it nowhere at module level, so a merge of modules cannot make it required unnoticed."""
    code = ("import sys\nsys.modules['torchvision'] = None\nimport train_hvd\n"
            f"sys.exit(train_hvd.main(['--epochs', '1', '--output-dir', {str(tmp_path / 'run')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
