#!/usr/bin/env bash
# The README's picture of a run in MLflow's UI, made the way a user gets there: a 2-rank run of the digits with
# --mlflow, `mlflow ui` on the store it wrote, and a screenshot of the run's page by headless Chromium.
#
#   scripts/mlflow_screenshot.sh [OUT.png] [PAGE]     (default docs/mlflow-run.png; PAGE: overview or model-metrics)
#
# Needs the venv (make setup) and Chromium (apt-get install chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-docs/mlflow-run.png}")
page=${2:-overview}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "mlflow_screenshot.sh: no Chromium found; apt-get install chromium" >&2; exit 2; }
py=.venv/bin/python
work=$(mktemp -d)
ui=""
trap '[ -n "$ui" ] && kill "$ui" 2>/dev/null; rm -rf "$work"' EXIT

.venv/bin/horovodrun -np 2 -H localhost:2 --gloo "$py" train_hvd.py --epochs 8 --lr-schedule cosine \
    --output-dir "$work/run" --run.name digits-2-ranks --mlflow --logging.progress false
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
store="sqlite:///$work/run/mlflow.db"
.venv/bin/mlflow ui --backend-store-uri "$store" --host 127.0.0.1 --port "$port" > "$work/ui.log" 2>&1 &
ui=$!
for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$ui" 2> /dev/null || { cat "$work/ui.log" >&2; exit 1; }
    sleep 1
done
read -r experiment run < <("$py" -c "
from mlflow.tracking import MlflowClient
c = MlflowClient('$store')
e = c.get_experiment_by_name('hvd-train')
print(e.experiment_id, c.search_runs([e.experiment_id])[0].info.run_id)")
url="http://127.0.0.1:$port/#/experiments/$experiment/runs/$run"
[ "$page" = overview ] || url="$url/$page"
mkdir -p "$(dirname "$out")"
# The UI renders in the page's scripts: virtual time lets them finish before the picture is taken.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1440,1000 \
    --virtual-time-budget=30000 --screenshot="$out" "$url" 2> "$work/browser.log"
[ -s "$out" ] || { cat "$work/browser.log" >&2; exit 1; }
echo "wrote $out: $url"
