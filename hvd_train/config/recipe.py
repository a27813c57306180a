"""YAML recipes (--config): read as data, bounded, with every key and type checked."""
import os

from hvd_train.errors import ConfigError
from hvd_train.config.fields import RECIPE_MAX_BYTES
from hvd_train.gate import settings


def _read_text(path):
    """The recipe's text, or a ConfigError saying why it cannot be read."""
    if os.path.isdir(path):
        raise ConfigError(f"--config {path}: is a directory; expected a YAML file such as configs/digits_cnn.yaml")
    try:
        with open(path, "rb") as fh:
            data = fh.read(RECIPE_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file (recipes live in configs/)")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror or e})")
    if len(data) > RECIPE_MAX_BYTES:
        raise ConfigError(f"--config {path}: larger than {RECIPE_MAX_BYTES // 1024} KB, which no recipe needs; give a "
                          f"YAML recipe such as configs/digits_cnn.yaml")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {data[e.start]:#04x} on line {line}); "
                          f"save it as UTF-8")


def _repeated_key(mapping, prefix=""):
    """(dotted key, first line, second line) of a key written twice in this YAML mapping node, else None.

    Keys pulled in by a merge (`<<: *base`) are left out: YAML lets a mapping's own keys override those."""
    first = {}
    for key, _ in mapping.value:
        if key.id != "scalar" or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in first:
            return prefix + key.value, first[key.tag, key.value], line
        first[key.tag, key.value] = line
    return None


def _refuse_repeats(root, path):
    """A section written twice, or a key written twice within one: PyYAML would keep the last without a word."""
    if root is None or root.id != "mapping":
        return  # load_recipe refuses a recipe that is not a mapping of sections
    repeated = _repeated_key(root)
    if repeated:
        raise ConfigError(f"--config {path}: section {repeated[0]} appears twice, on lines {repeated[1]} and "
                          f"{repeated[2]}; merge them into one")
    for key, value in root.value:
        repeated = _repeated_key(value, f"{key.value}.") if key.id == "scalar" and value.id == "mapping" else None
        if repeated:
            raise ConfigError(f"--config {path}: {repeated[0]} appears twice, on lines {repeated[1]} and "
                              f"{repeated[2]}; keep one")


def _refuse_aliases(root, path):
    """A YAML alias (*name) repeats a node wherever it is used; nested, a few hundred bytes expand to gigabytes
    (the "billion laughs"). Recipes are short enough to write out, so aliases are refused where they are used."""
    seen, stack = set(), [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            raise ConfigError(f"--config {path}: the value anchored on line {node.start_mark.line + 1} is used "
                              f"again through an alias (*name); aliases are refused in recipes (they can expand "
                              f"without bound): write the values out")
        seen.add(id(node))
        if node.id == "mapping":
            stack += [n for pair in node.value for n in pair]
        elif node.id == "sequence":
            stack += node.value


def _parse_yaml(text, path):
    """yaml.safe_load, step by step: the document's nodes are checked for repeated keys before they become dicts."""
    import yaml

    loader = yaml.SafeLoader(text)
    loader.name = path  # PyYAML's own messages then name the file, as they do when given an open file
    try:
        root = loader.get_single_node()
        _refuse_aliases(root, path)
        _refuse_repeats(root, path)
        return None if root is None else loader.construct_document(root)
    finally:
        loader.dispose()


def load_recipe(path, known_only=False):
    """Read a YAML recipe into {section: {field: value}} through the gate (hvd_train/gate.py settings): unknown
    sections, unknown keys, wrong types and the settings a file never chooses refused (known_only: a run's
    config.json, perhaps of another version: those left out instead)."""
    import yaml

    text = _read_text(path)
    try:
        raw = _parse_yaml(text, path)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}")
    except RecursionError:  # PyYAML composes nested values recursively
        raise ConfigError(f"--config {path}: its values nest hundreds of levels deep; a recipe is sections of "
                          f"settings (configs/digits_cnn.yaml)") from None
    except ConfigError:  # a key or section written twice, an alias: already one line naming the file
        raise
    except ValueError as e:  # a value YAML cannot build: an integer past Python's 4300 digits
        why = "an integer of more than 4300 digits, far past any setting" if "digits" in str(e) else \
            str(e).splitlines()[0][:200]
        raise ConfigError(f"--config {path}: a value cannot be read ({why})") from None
    if raw is None or raw == {}:
        raise ConfigError(f"--config {path}: holds no settings; write sections as in configs/digits_cnn.yaml, "
                          f"or leave out --config")
    return settings(raw, f"--config {path}", recorded=known_only)
