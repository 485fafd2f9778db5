#!/bin/bash
# pipeline.sh: the whole pipeline on a Slurm cluster, as jobs chained with --dependency=afterok, the artifacts
# pushed to the DVC remote at the end.
#
#   1. prepare   (CPU)  dvc repro audit                       target, audit_input, audit
#   2. servers   (GPU)  slurm/generate-servers.sbatch         after 1; cancelled when 3 ends
#   3. generate  (CPU)  slurm/generate.sbatch with STAGE=dvc  after 1: dvc repro generate, a client of 2
#   4. tokenize  (CPU)  dvc repro tokenize                    after 3
#   5. train     (GPU)  slurm/train.sbatch, then dvc commit   after 4 (torchrun on every node)
#   6. finish    (GPU)  dvc repro report; dvc push --run-cache   after 5 (eval, plan, report; the remote)
#
# dvc repro reads params.yaml only: write the overlay into it first (python -m dflash.core.overlay
# params/gpu-qwen3.6-27b.yaml, as make repro-gpu does) and set there generate.backend: servers and
# generate.server_registry: a folder every node sees (the REGISTRY below). The DVC remote must be configured
# (make remote ...). Run from the repository checkout on a login node:
#     ACCOUNT=my-account GPU_PARTITION=gpu CPU_PARTITION=cpu slurm/pipeline.sh
# Every job's sbatch script keeps its own EDIT lines; ACCOUNT / *_PARTITION here override them per submission.
set -euo pipefail
cd "$(dirname "$0")/.."
DVC=${DVC:-.venv/bin/dvc}
REGISTRY=${REGISTRY:-$PWD/artifacts/server-registry}
acct=(${ACCOUNT:+--account "$ACCOUNT"})
cpu=("${acct[@]}" ${CPU_PARTITION:+--partition "$CPU_PARTITION"})
gpu=("${acct[@]}" ${GPU_PARTITION:+--partition "$GPU_PARTITION"})
submit() { sbatch --parsable "$@" | cut -d ';' -f 1; }

prepare=$(submit "${cpu[@]}" --job-name dflash-prepare --wrap "$DVC repro audit")
servers=$(submit "${gpu[@]}" --dependency "afterok:$prepare" --export "ALL,REGISTRY=$REGISTRY" \
    slurm/generate-servers.sbatch)
generate=$(submit "${cpu[@]}" --dependency "afterok:$prepare" --export "ALL,REGISTRY=$REGISTRY,STAGE=dvc" \
    slurm/generate.sbatch)
submit "${cpu[@]}" --dependency "afterany:$generate" --job-name dflash-servers-stop --wrap "scancel $servers" >/dev/null
tokenize=$(submit "${cpu[@]}" --dependency "afterok:$generate" --job-name dflash-tokenize --wrap "$DVC repro tokenize")
train=$(submit "${gpu[@]}" --dependency "afterok:$tokenize" slurm/train.sbatch)
commit=$(submit "${cpu[@]}" --dependency "afterok:$train" --job-name dflash-train-commit --wrap "$DVC commit -f train")
finish=$(submit "${gpu[@]}" --dependency "afterok:$commit" --gpus-per-node 1 --job-name dflash-finish \
    --wrap "$DVC repro report && $DVC push --run-cache")
echo "submitted: prepare $prepare, servers $servers, generate $generate, tokenize $tokenize, train $train," \
    "commit $commit, finish $finish (squeue -u $USER)"
