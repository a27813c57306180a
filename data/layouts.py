"""Finding a data set on disk in any of the layouts it is published in, and saying what is there when none fits."""
import os
from dataclasses import dataclass

from hvd_train.data.errors import DataError

SHOWN = 8  # entries of a directory named in a "not found" message


@dataclass(frozen=True)
class Layout:
    """One published layout: files in a folder under --data-dir ("" for --data-dir itself)."""
    folder: str
    files: tuple
    origin: str            # where users get this layout, for the message when nothing fits
    gzip_ok: bool = False  # file.gz counts for file (torchvision leaves MNIST's files gzipped)

    def path(self, data_dir, name):
        """The file on disk for `name`, or None."""
        plain = os.path.join(data_dir, self.folder, name)
        for candidate in (plain, plain + ".gz") if self.gzip_ok else (plain,):
            if os.path.isfile(candidate):
                return candidate
        return None

    def describe(self):
        where = f"{self.folder}/" if self.folder else ""
        files = f"{{{','.join(self.files)}}}" if len(self.files) > 1 else self.files[0]
        return f"{where}{files}{' (.gz or not)' if self.gzip_ok else ''} ({self.origin})"


def locate(title, data_dir, layouts, how_to_get):
    """{file name: path} for the first layout in `layouts` whose files are all under data_dir; else a DataError that
    says what data_dir holds, what is missing where a layout is partly there, and every layout that is accepted."""
    for layout in layouts:
        paths = {name: layout.path(data_dir, name) for name in layout.files}
        if all(paths.values()):
            return paths
    raise DataError(f"{title} not found in {data_dir}: {contents(data_dir)}{partial(data_dir, layouts)}. Accepted "
                    f"layouts under --data-dir: {'; '.join(layout.describe() for layout in layouts)}. {how_to_get}")


def contents(directory):
    """'it does not exist' or 'it holds a/, b.txt, ...', for messages."""
    if not os.path.isdir(directory):
        return "it does not exist" if not os.path.exists(directory) else "it is a file, not a directory"
    entries = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(directory))
    if not entries:
        return "it is empty"
    more = f" and {len(entries) - SHOWN} more" if len(entries) > SHOWN else ""
    return f"it holds {', '.join(entries[:SHOWN])}{more}"


def partial(data_dir, layouts):
    """'; cifar-10-batches-py/ lacks test_batch' for each layout whose folder is there but not all of its files."""
    notes = []
    for layout in layouts:
        if layout.folder and os.path.isdir(os.path.join(data_dir, layout.folder)):
            lacking = [name for name in layout.files if layout.path(data_dir, name) is None]
            notes.append(f"; {layout.folder}/ lacks {', '.join(lacking)}")
    return "".join(notes)
