#!/usr/bin/env bash
# What the README's install (torch, then `pip install .`, no extras) must do on its own, with no network: download a
# model with `mtune download` from a local hub-compatible server (tests/_helpers/hub_server.py, standard library
# only) serving the built-in tiny model, then run a few steps of the README's first command on what was downloaded.
# Everything it writes goes to a temporary directory, removed at exit. CI runs this before installing test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
repo_dir="$PWD"
work="$(mktemp -d)"
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

repo_id=tiny-org/tiny-model
python3 tests/_helpers/hub_server.py --repo-id "$repo_id" --from-dir mtune/assets/tiny/model \
    --endpoint-file "$work/endpoint" >/dev/null &
server_pid=$!
for _ in $(seq 100); do [[ -s "$work/endpoint" ]] && break; sleep 0.1; done
[[ -s "$work/endpoint" ]] || { echo "smoke: the hub server did not start" >&2; exit 1; }

# From the temporary directory, so that `mtune` is the installed package, not this checkout's source.
cd "$work"
echo "smoke: mtune download $repo_id (from $(cat "$work/endpoint"))"
env -u HF_TOKEN -u http_proxy -u https_proxy -u all_proxy -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY \
    HF_ENDPOINT="$(cat "$work/endpoint")" HF_HOME="$work/hf_home" HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
    mtune download "$repo_id" --output-dir "$work/tiny-model"
for file in "$repo_dir"/mtune/assets/tiny/model/*; do
    cmp "$file" "$work/tiny-model/$(basename "$file")"
done

echo "smoke: a few steps of the README's first command, on the downloaded model"
mtune run lora_single_device --config tiny/lora_single_device model.checkpoint_dir="$work/tiny-model" \
    epochs=1 max_steps_per_epoch=3 task_eval.max_samples=4 output_dir="$work/run"
test -s "$work/run/metrics.jsonl"
test -s "$work/run/final/adapter/adapter_model.safetensors"
echo "smoke: ok"
