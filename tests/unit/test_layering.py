"""The folders' layering, read from the source: the data sets (data/, imported as hvd_train.data) sit below the run
directory (hvd_train/run/), which builds its model card from them; what both write goes through hvd_train/files.py."""
import ast

from conftest import ROOT


def imported_modules(path):
    """Every module an import statement in the file at `path` names (anywhere in it: a function's own imports
    too); `from package import name` counts as package.name, since name may be a module."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def test_no_module_under_data_imports_the_run_directory():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "data").rglob("*.py"))
                 for name in imported_modules(path) if name == "hvd_train.run" or name.startswith("hvd_train.run.")]
    assert not offenders, offenders


def test_the_check_sees_an_import_of_the_run_directory(tmp_path):
    for line in ("from hvd_train.run.directory import atomic_write", "from hvd_train import run",
                 "import hvd_train.run.checkpoint", "def f():\n    from hvd_train.run import resume"):
        path = tmp_path / "m.py"
        path.write_text(line + "\n")
        assert any(n == "hvd_train.run" or n.startswith("hvd_train.run.") for n in imported_modules(path)), line
