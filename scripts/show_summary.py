"""Print the headline figures of a run's summary.json: `python scripts/show_summary.py runs/demo/summary.json`."""
import json
import sys

FIELDS = [
    ("world_size", "ranks", "{}"),
    ("controller", "controller", "{}"),
    ("device", "device", "{}"),
    ("epochs", "epochs", "{}"),
    ("global_batch_size", "global batch", "{}"),
    ("lr", "learning rate (scaled)", "{:g}"),
    ("best_val_acc1", "best validation top-1", "{:.2f}%"),
    ("final_val_acc1", "final validation top-1", "{:.2f}%"),
    ("train_samples_per_sec", "training throughput", "{:.0f} samples/s"),
    ("wall_seconds", "wall time", "{:.1f} s"),
    ("params_in_sync", "ranks hold identical weights", "{}"),
]


def main(path):
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"show_summary.py: cannot read {path}: {e}")
    print(f"\nSummary ({path})")
    for key, label, fmt in FIELDS:
        if key in summary:
            print(f"  {label:<30} {fmt.format(summary[key])}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
