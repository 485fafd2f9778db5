#!/usr/bin/env bash
# Run a command in the GPU image with this checkout mounted: make repro-gpu, make gpu-shell, make gpu-run.
#
#   docker/run.sh IMAGE COMMAND [ARGS...]        (from the repo root)
#
# - all GPUs (GPUS=... overrides docker's --gpus value, e.g. GPUS=2 or GPUS=device=0), host IPC for
#   vLLM / NCCL shared memory;
# - the checkout at /workspace, run as YOUR uid:gid so everything written into it (DVC outputs and cache,
#   dvc.lock, reports) belongs to you. It must be an ordinary clone: a `git worktree` keeps its .git
#   outside the checkout, where the container cannot see it;
# - a host cache folder (GPU_CACHE, default ~/.cache/dflash-gpu) at /home/dflash/.cache: model downloads
#   and vLLM / Triton / torch.compile caches survive between runs;
# - credentials are passed through by NAME only (`-e AWS_SECRET_ACCESS_KEY`, never `-e NAME=value`), so
#   no value appears in a command line, `ps` or a log; ~/.aws is mounted read-only when it exists.
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: docker/run.sh IMAGE COMMAND [ARGS...]" >&2
    exit 2
fi
image=$1
shift
cache=${GPU_CACHE:-$HOME/.cache/dflash-gpu}
mkdir -p "$cache"
args=(--rm --gpus "${GPUS:-all}" --ipc=host --user "$(id -u):$(id -g)"
      -v "$PWD:/workspace" -v "$cache:/home/dflash/.cache" -w /workspace)
for name in AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_PROFILE AWS_REGION AWS_DEFAULT_REGION \
            AWS_ENDPOINT_URL HF_TOKEN HF_HUB_OFFLINE VLLM_USE_V2_MODEL_RUNNER VLLM_LOGGING_LEVEL; do
    if [[ -n "${!name:-}" ]]; then
        args+=(-e "$name")
    fi
done
if [[ -d "$HOME/.aws" ]]; then
    args+=(-v "$HOME/.aws:/home/dflash/.aws:ro")
fi
if [[ -t 0 && -t 1 ]]; then
    args+=(-it)
fi
exec docker run "${args[@]}" "$image" "$@"
