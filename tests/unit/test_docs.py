"""The README and docs/ as a reader meets them: every link leads somewhere, the blocks marked runnable run as they
are written, the settings page is the configuration's, and the README's copy of the recipe is train_hvd.py's."""
import re
import subprocess
import textwrap

import pytest

from conftest import BIN, ROOT, job_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docker" / "README.md",
         *sorted((ROOT / "examples").glob("*/README.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)```", re.DOTALL)


def anchors(page):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_page_leads_to_a_file_or_heading_that_exists(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code is not a link
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not fetched here (no network), and not the project's to keep
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_docs_hold_runnable_blocks_and_each_runs_as_written(tmp_path):
    """Every block marked `<!-- runnable -->` runs in the repository with bash -e, in order, page by page."""
    blocks = [(page, block) for page in PAGES for block in RUNNABLE.findall(page.read_text())]
    assert len(blocks) >= 2, "the README's first run and the cluster page's hostfile check are marked runnable"
    env = {**job_env(), "HOME": str(tmp_path)}
    try:
        for page, block in blocks:
            proc = subprocess.run(["bash", "-e", "-c", block], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=900)
            assert proc.returncode == 0, f"{page.relative_to(ROOT)}:\n{block}\n{proc.stdout[-3000:]}\n{proc.stderr}"
    finally:
        subprocess.run(["rm", "-rf", str(ROOT / "runs" / "first")])


def test_the_settings_page_is_generated_from_the_configuration():
    proc = subprocess.run([str(BIN / "python"), "scripts/settings_doc.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, env=job_env())
    assert proc.returncode == 0, proc.stderr
    from hvd_train.config import ALIASES

    page = (ROOT / "docs" / "settings.md").read_text()
    assert all(f"`--{flag}`" in page and f"`--{dest}`" in page for flag, dest in ALIASES.items())


def test_the_readme_shows_the_recipe_as_train_hvd_py_has_it():
    source = (ROOT / "train_hvd.py").read_text()
    body = source[source.index("    cfg = app.configure"):source.index("\n\n\ndef cli")]
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"```python\n(cfg = app\.configure.*?)```", readme, re.DOTALL).group(1)
    assert shown.strip() == textwrap.dedent(body).strip()
    # The five steps, each one visible call with its comment.
    for call in ("hvd_utils.start(", "hvd_utils.pin_to_local_rank(", "hvd_utils.shard_sampler(",
                 "hvd_utils.distributed_optimizer(", "hvd_utils.broadcast_state("):
        assert call in body
    assert len(re.findall(r"# Horovod: [1-5]\.", body)) == 5


def test_the_package_never_imports_the_script_and_the_script_stays_short():
    """No module of hvd_train or hvd_utils imports train_hvd (a user's own train_hvd.py would be imported instead);
    hvd_utils imports nothing of the app."""
    offenders = []
    for path in [*(ROOT / "hvd_train").rglob("*.py"), *(ROOT / "hvd_utils").rglob("*.py")]:
        text = path.read_text()
        if re.search(r"^\s*(import train_hvd|from train_hvd import)", text, re.MULTILINE):
            offenders.append(str(path.relative_to(ROOT)))
        if path.parts[-2] == "hvd_utils" and re.search(r"^\s*(from|import) hvd_train", text, re.MULTILINE):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
    assert len((ROOT / "train_hvd.py").read_text().splitlines()) <= 120
