"""Write docs/settings.md from the typed configuration, so the page cannot drift from the code.

    python scripts/settings_doc.py            # rewrite docs/settings.md
    python scripts/settings_doc.py --check    # exit 1 if docs/settings.md is not what the code says (tests run it)
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PAGE = os.path.join(ROOT, "docs", "settings.md")

INTRO = """# Settings

Generated from the typed configuration (`hvd_train/config/`) by `python scripts/settings_doc.py`; a test fails when
this page and the code differ. `python train_hvd.py --help` shows the same, grouped the same way.

Every setting has a default, so a bare `python train_hvd.py` trains. Values come from the defaults, then an optional
YAML recipe (`--config configs/NAME.yaml`: one mapping per section below), then the command line. Each setting is
`--section.field VALUE` on the command line (`--optim.weight_decay 5e-4`), and the settings people reach for first
have short flags too (`--lr`). A bad value, an unknown recipe key or a wrong YAML type stops every rank before
training, with one message from rank 0 naming the setting, and exit code 2. A recipe is data: it cannot name code
(an import path, a `pipe:` shard command) unless the command line says `--trust-code`; its `run.output_dir` is left
out and a `run.overwrite` that is on refused, as they move or replace a run (docs/reliability.md: What is code and
what is data).
"""


def render():
    from hvd_train.config import settings_rows

    out = [INTRO]
    section = None
    for row in settings_rows():
        if row["section"] != section:
            section = row["section"]
            out.append(f"\n## {section}\n\n| setting | short flags | default | meaning |\n|---|---|---|---|")
        flags = ", ".join(f"`--{f}`" for f in row["flags"])
        default = f"`{row['default']}`" if row["default"] != "" else "(empty)"
        meaning = row["help"].replace("|", "\\|")
        out.append(f"| `--{row['setting']}` | {flags} | {default} | {meaning} |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args()
    text = render()
    if args.check:
        with open(PAGE) as f:
            if f.read() != text:
                sys.exit("docs/settings.md is out of date: run python scripts/settings_doc.py")
        return
    with open(PAGE, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
