"""train_hvd.py with "{rank}" in its arguments replaced by this process's rank as the launcher announced it: each
rank reads a recipe of its own, as ranks on hosts whose copies of a recipe differ (or where it is missing) do.

    recipe_per_rank.py TRAIN_HVD_ARGS...    (e.g. --config recipe{rank}.yaml)
"""
import sys

import hvd_utils
import train_hvd


def main():
    rank = str(hvd_utils.launcher_rank())
    sys.argv = [sys.argv[0]] + [a.replace("{rank}", rank) for a in sys.argv[1:]]
    train_hvd.cli()


if __name__ == "__main__":
    main()
