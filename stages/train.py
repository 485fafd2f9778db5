"""Stage `train`: train the DFlash drafter online against the target, then export it in the z-lab format; with
`--pilot`, stage `train_pilot`: a few measured steps on the worst and on ordinary rows before the long run.

Inputs: `${tokenize.out}/train/shard-*.arrow`, the target in `${base.target_dir}`, params `train`, `drafter`, `base`.
Outputs: `${train.out}/drafter/` (config.json + model.safetensors + run_info.json: what eval serves),
`${train.out}/checkpoints/<config hash>/` (persisted: a killed run resumes where its last checkpoint left off),
dvclive metrics and plots in `${train.live_dir}/`, metrics `${base.reports_dir}/train.json` (+ `train_details.json`).
With `--pilot` (dflash/train/pilot.py): `${base.reports_dir}/train_pilot.json` (+ `train_pilot_details.json`): step
time, tokens/s, peak memory, MFU, feature norms; exit 1 on an out-of-memory or unusable target features.

    python -m stages.train --params params.yaml
    python -m stages.train --params params.yaml --pilot
    torchrun --nproc_per_node 2 -m stages.train --params params.yaml --overlay params/gpu-qwen3.6-27b.yaml
    torchrun --nnodes N --node-rank R --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        -m stages.train --params params.yaml     # on every node; train.out on a shared filesystem
"""

from pathlib import Path

from dflash.core import cli
from dflash.core.errors import UserError

SHOWN = ("steps", "total_steps", "first_loss", "final_loss", "final_tau_hat", "tokens_per_s", "packing_efficiency")
PILOT_SHOWN = ("verdict", "step_seconds", "tokens_per_s", "peak_memory_gb", "peak_phase", "mfu", "first_loss")


def add_args(parser):
    parser.add_argument(
        "--pilot",
        action="store_true",
        help="pilot: measured steps on the worst and ordinary rows, reports/train_pilot.json",
    )


def pilot(params):
    from dflash.core.metrics import write_metrics
    from dflash.train.pilot import PILOT_HEADLINE, run_pilot

    report = run_pilot(params, Path(params.tokenize.out) / "train")
    if report is None:  # not global rank 0: rank 0 writes and judges
        return
    write_metrics(params.base.reports_dir, "train_pilot", report, PILOT_HEADLINE)
    print({k: report[k] for k in PILOT_SHOWN})
    if report["verdict"] != "ok":
        raise UserError(report["problem"])


def main(params, args=None):
    """Train (or with `--pilot`, args.pilot, the training pilot only); `args` None = a plain training run."""
    from dflash.core.metrics import write_metrics
    from dflash.train.loop import Trainer
    from dflash.train.summary import HEADLINE

    if args is not None and args.pilot:
        return pilot(params)
    trainer = Trainer(params, Path(params.tokenize.out) / "train")  # what a user can get wrong fails here
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    if trainer.dist.is_main:  # global rank 0 (never LOCAL_RANK: one writer over all nodes)
        write_metrics(params.base.reports_dir, "train", summary, HEADLINE)
        print({k: summary[k] for k in SHOWN})
    if not summary["completed"]:
        raise UserError(
            f"train: stopped at step {summary['steps']} of {summary['total_steps']} (train.max_steps); "
            f"rerun with train.max_steps=0 to resume from {summary['checkpoint_dir']} and export"
        )


if __name__ == "__main__":
    cli.run(main, __doc__.split("\n\n")[0], add_args=add_args)
