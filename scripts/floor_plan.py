"""The package's floor plan in figures, read from the source (nothing is imported or run).

    python scripts/floor_plan.py            # the table
    python scripts/floor_plan.py --cycles   # and every import cycle, every chain of the longest length

Product modules are the .py files of hvd_train/, hvd_utils/, data/, models/ and hostfiles/ (data/, models/ and
hostfiles/ are imported as hvd_train.data, hvd_train.models and hvd_train.hostfiles). An import names the module it
imports (`from a.b import c` names a.b.c where that is a module, else a.b), as import-linter's graph does; imports
under `if TYPE_CHECKING:` run nothing and are not counted. A cycle counts every import, those inside functions too;
the longest chain counts the imports that run when a module is loaded (its top level) and is measured in modules.
A public function (a module's function, or a method of a module's class, whose name has no leading underscore) is
annotated when its return and every parameter but self and cls carry an annotation.
"""
import argparse
import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"hvd_train": "hvd_train", "hvd_utils": "hvd_utils", "data": "hvd_train.data",
            "models": "hvd_train.models", "hostfiles": "hvd_train.hostfiles"}


def product_modules():
    """{module name: path} for every product module."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _type_checking(node):
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(tree, modules):
    """[(imported module, at the top level?)] for every import of a product module in `tree`."""
    found = []

    def visit(node, top):
        if isinstance(node, ast.If) and _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((full if full in modules else node.module, top))
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return [(name, top) for name, top in found if name in modules]


def graph(modules):
    """{module: {imported: at the top level anywhere?}}"""
    edges = {}
    for name, path in modules.items():
        targets = {}
        for target, top in imports(ast.parse(path.read_text(), filename=str(path)), modules):
            if target != name:
                targets[target] = targets.get(target, False) or top
        edges[name] = targets
    return edges


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def longest_chain(edges):
    """The longest chain of top-level imports, as a list of modules (over the top-level graph's cycles, if any, a
    module is visited once per chain)."""
    top = {name: [t for t, at_top in targets.items() if at_top] for name, targets in edges.items()}
    memo = {}

    def longest(node, seen):
        if node in memo:
            return memo[node]
        best = [node]
        for child in top[node]:
            if child not in seen:
                chain = [node, *longest(child, seen | {child})]
                if len(chain) > len(best):
                    best = chain
        if not any(child in seen for child in top[node]):
            memo[node] = best
        return best

    return max((longest(name, {name}) for name in top), key=len)


def public_functions(modules):
    """(annotated, all) counts of public functions."""
    annotated = total = 0

    def typed(fn, method):
        args = fn.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if method and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        params += [a for a in (args.vararg, args.kwarg) if a is not None]
        return fn.returns is not None and all(p.annotation is not None for p in params)

    for path in modules.values():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                total += 1
                annotated += typed(node, False)
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        total += 1
                        annotated += typed(item, True)
    return annotated, total


def torch_io(modules):
    """Modules outside tools/ that call torch.save or torch.load."""
    found = []
    for name, path in modules.items():
        if name.startswith("hvd_train.tools"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("save", "load") and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"):
                found.append(name)
                break
    return found


@dataclasses.dataclass
class Plan:
    """The floor plan's figures (the lists behind them, for messages)."""
    modules: list
    flat: list
    cycles: list
    chain: list
    torch_io: list
    annotated: int
    public: int


def measure():
    """The figures of the checkout this script is in."""
    modules = product_modules()
    edges = graph(modules)
    flat = [m for m, p in modules.items() if p.parent == ROOT / "hvd_train" and p.name != "__init__.py"]
    annotated, public = public_functions(modules)
    return Plan(sorted(modules), flat, cycles(edges), longest_chain(edges), torch_io(modules), annotated, public)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", action="store_true", help="list every cycle and the longest chain")
    args = parser.parse_args(argv)
    plan = measure()
    rows = [("product modules", len(plan.modules)),
            ("flat modules at the top of hvd_train/", len(plan.flat)),
            ("import cycles (imports inside functions included)", len(plan.cycles)),
            ("longest chain of top-level imports (modules)", len(plan.chain)),
            ("modules outside tools/ that call torch.save or torch.load",
             f"{len(plan.torch_io)} ({', '.join(plan.torch_io)})"),
            ("annotated public functions",
             f"{plan.annotated} of {plan.public} ({100 * plan.annotated / max(plan.public, 1):.0f}%)")]
    for label, value in rows:
        print(f"{label:60} {value}")
    if args.cycles:
        for component in plan.cycles:
            print("cycle:", " ".join(component))
        print("longest chain:", " -> ".join(plan.chain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
