"""Horovod's sources as this project builds them: PyPI's sdist, the patch series in patches/, and the header
shm_allreduce.h.

patches/series lists the patches in the order they apply (quilt's format: one file name a line, '#' comments).
Each patch is a unified diff against the sdist's tree as the patches before it leave it (a/ and b/ prefixes, what
`git diff` writes), after a header of plain text: its first line says what it changes, the rest why.

The series is applied by GNU patch, each patch checked (--dry-run) and then applied, with no fuzz: a different
sdist stops the build instead of building something half-patched. The whole series is first applied to a scratch
copy of the files it edits; the tree is written only once every patch applied there.
"""
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from buildutil import die, log

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"
# The shared-memory allreduce (0023-shm-allreduce.patch calls it), copied into the tree as a file of its own:
# bench/mpi_allreduce.c compiles the same header.
SHM_ALLREDUCE_HEADER = HERE / "shm_allreduce.h"
SHM_ALLREDUCE_FILE = "horovod/common/ops/hvdt_shm_allreduce.h"
# Exactly where the hunks say, or not at all: no fuzz, no reversed patches, no backup or reject files.
PATCH = ("patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-")
OFF_TARGET = re.compile(r"\(offset -?\d+ lines?\)|with fuzz")


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    header: str     # the text before the first diff
    files: tuple    # the paths in the tree it edits

    @property
    def subject(self):
        return self.header.strip().splitlines()[0]


def series_paths(patch_dir=PATCH_DIR):
    """The patch files patches/series lists, in order."""
    series = Path(patch_dir) / "series"
    if not series.is_file():
        die(f"{series} is missing: it lists Horovod's patches in the order they apply")
    names = [line.split("#")[0].strip() for line in series.read_text().splitlines()]
    paths = [Path(patch_dir) / name for name in names if name]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        die(f"{series} lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not in {patch_dir}")
    return paths


def read_patch(path):
    """The patch in `path`: its header and the files it edits (each a plain edit of a file the sdist has)."""
    lines = Path(path).read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("diff --git ")), len(lines))
    header = "\n".join(lines[:first])
    files = []
    for at in range(first, len(lines)):
        if lines[at].startswith("diff --git "):
            below = lines[at + 1:at + 3]  # an index line may come before the '--- a/PATH' one
            below = below[1:] if below[:1] and below[0].startswith("index ") else below
            old = below[0] if below else ""
            if not old.startswith("--- a/"):
                die(f"{path}: line {at + 1}: expected '--- a/PATH' in the diff of {lines[at][11:]!r}. A patch here "
                    "edits files the sdist has, as `git diff` writes it (no new, deleted, renamed or binary files)")
            files.append(old[6:])
    if not files or not header.strip():
        die(f"{path}: a patch is a header (what it changes, then why), then `git diff`'s output; this one has "
            f"{'no diff' if not files else 'no header'}")
    return Patch(Path(path).name, Path(path), header, tuple(dict.fromkeys(files)))


@functools.lru_cache(maxsize=None)
def patch_command():
    version = subprocess.run(["patch", "--version"], capture_output=True, text=True) if shutil.which("patch") else None
    if version is None or "GNU patch" not in version.stdout:
        die("GNU patch is needed to apply Horovod's patches (Debian and Ubuntu: apt-get install patch; it comes "
            "with build-essential)")
    return PATCH


def apply_one(src_dir, patch):
    """`patch` checks, then applies `patch` in `src_dir`; its first failure stops here, naming the patch."""
    for flags in (("--dry-run",), ()):
        proc = subprocess.run([*patch_command(), *flags, "-d", str(src_dir), "-i", str(patch.path)],
                              capture_output=True, text=True)
        told = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0 or OFF_TARGET.search(told):  # patch takes a hunk found lines away: not here
            die(f"patch {patch.name} does not apply to {', '.join(patch.files)}:\n{told}\nNothing was changed. "
                "The series is made against PyPI's sdist as the patches before it leave it; a different tree needs "
                "its own.")


def check_series(src_dir, patches):
    """The series applied to a scratch copy of the files it edits: {path: bytes as the series leaves them},
    reading but never writing `src_dir`; the first patch that does not apply stops here."""
    src = Path(src_dir)
    edited = dict.fromkeys(rel for patch in patches for rel in patch.files)
    with tempfile.TemporaryDirectory(prefix="hvd-train-patches-") as scratch:
        for rel in edited:
            if not (src / rel).is_file():
                owner = next(p.name for p in patches if rel in p.files)
                die(f"patch {owner} does not apply: {rel} is not in {src}. Nothing was changed.")
            (Path(scratch) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, Path(scratch) / rel)
        for patch in patches:
            apply_one(scratch, patch)
        return {rel: (Path(scratch) / rel).read_bytes() for rel in edited}


def apply_series(src_dir, patch_dir=PATCH_DIR):
    """Patches the sdist tree in `src_dir` with the whole series, or leaves it untouched, and adds the header."""
    patches = [read_patch(path) for path in series_paths(patch_dir)]
    for rel, text in check_series(src_dir, patches).items():
        (Path(src_dir) / rel).write_bytes(text)
    for patch in patches:
        log(f"  applied {patch.name}: {patch.subject}")
    shutil.copyfile(SHM_ALLREDUCE_HEADER, Path(src_dir) / SHM_ALLREDUCE_FILE)
    log(f"  added {SHM_ALLREDUCE_FILE}: {SHM_ALLREDUCE_HEADER.name}, the allreduce 0023-shm-allreduce.patch calls")
    return patches


def series_summary(patch_dir=PATCH_DIR):
    """What --plan says of the sources: each patch (read, so a malformed one fails the plan too), the files they
    edit, and the file added."""
    patches = [read_patch(path) for path in series_paths(patch_dir)]
    edited = dict.fromkeys(rel for patch in patches for rel in patch.files)
    return ([f"patches {len(edited)} of Horovod's files with the {len(patches)} patches of patches/series:"]
            + [f"  {patch.name}: {patch.subject}" for patch in patches]
            + [f"  editing {', '.join(edited)}",
               f"adds {SHM_ALLREDUCE_FILE} ({SHM_ALLREDUCE_HEADER.stat().st_size} bytes: {SHM_ALLREDUCE_HEADER.name})"])


def patch_fingerprint(patch_dir=PATCH_DIR):
    """Changes whenever the series, a patch in it or the added header changes, so the cache never serves a wheel
    built from other sources."""
    digest = hashlib.sha256()
    for path in [Path(patch_dir) / "series", *series_paths(patch_dir), SHM_ALLREDUCE_HEADER]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:10]
