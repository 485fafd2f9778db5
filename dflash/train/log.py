"""Training metrics: dvclive files for `dvc plots` / `dvc metrics`, and a progress bar with tokens/s and ETA.

Every `train.log_every` optimizer steps (and at the end) the steps since the last point are aggregated into one
dvclive step numbered by the optimizer step:
  train/loss, train/grad_norm   means over the interval      train/lr          at the interval's last step
  train/tokens_per_s            real tokens / wall seconds   train/epoch       epoch of the last step
  acc/pos_k (k = 1..B-1)        valid slot-k labels equal to the full-vocabulary argmax / valid slot-k labels
  train/tau_hat                 1 + sum_k prod_{j<=k} acc_j (dflash/train/loss.py)
At the end, plots/custom/accuracy_by_position.json holds acc_k of the last epoch. A resumed run starts the
dvclive folder afresh and replays the checkpoint's history first, so the files never hold steps that the
checkpoint does not (a killed run may have logged past its last checkpoint). `train.live_dir: ""` turns
dvclive off (tests). Only process 0 logs.
"""

from __future__ import annotations

from typing import Any

from dflash.train.loss import tau_hat


class TrainLog:
    def __init__(self, trainer: Any, enabled: bool, end: int):
        from tqdm import tqdm

        self.every = trainer.tp.log_every
        self.block = trainer.cfg.block_size
        self.live = None
        if enabled and trainer.tp.live_dir:
            from dvclive import Live

            self.live = Live(trainer.tp.live_dir, resume=False, save_dvc_exp=False, dvcyaml=None, report=None)
        self.bar = tqdm(
            total=end, initial=trainer.step, unit="step", disable=not enabled, dynamic_ncols=True, mininterval=2.0
        )
        self.pending: list[dict] = []
        self.last_epoch: list[dict] = []

    def _aggregate(self, items: list[dict]) -> dict[str, float]:
        correct = [sum(h["correct"][k] for h in items) for k in range(1, self.block)]
        counted = [sum(h["counted"][k] for h in items) for k in range(1, self.block)]
        acc = [a / n if n else 0.0 for a, n in zip(correct, counted, strict=True)]
        seconds = sum(h["seconds"] for h in items)
        out = {
            "train/loss": sum(h["loss"] for h in items) / len(items),
            "train/grad_norm": sum(h["grad_norm"] for h in items) / len(items),
            "train/lr": items[-1]["lr"],
            "train/tokens_per_s": sum(h["tokens"] for h in items) / seconds if seconds else 0.0,
            "train/epoch": items[-1]["epoch"],
            "train/tau_hat": tau_hat(acc),
        }
        out.update({f"acc/pos_{k}": a for k, a in enumerate(acc, start=1)})
        return out

    def _flush(self) -> None:
        if not self.pending:
            return
        values = self._aggregate(self.pending)
        if self.live is not None:
            self.live.step = self.pending[-1]["step"]
            for name, value in values.items():
                self.live.log_metric(name, value)
            self.live.make_summary()
        self.bar.set_postfix(
            loss=f"{values['train/loss']:.3f}",
            acc1=f"{values['acc/pos_1']:.2f}",
            tau=f"{values['train/tau_hat']:.2f}",
            tok_s=f"{values['train/tokens_per_s']:.0f}",
            refresh=False,
        )
        self.pending = []

    def _add(self, h: dict) -> None:
        if self.last_epoch and self.last_epoch[-1]["epoch"] != h["epoch"]:
            self.last_epoch = []
        self.last_epoch.append(h)
        self.pending.append(h)
        if h["step"] % self.every == 0:
            self._flush()

    def replay(self, history: list[dict]) -> None:
        for h in history:
            self._add(h)

    def update(self, h: dict) -> None:
        self._add(h)
        self.bar.update(1)

    def close(self) -> None:
        self._flush()
        self.bar.close()
        if self.live is not None:
            if self.last_epoch:
                acc = self._aggregate(self.last_epoch)
                points = [{"position": k, "accuracy": acc[f"acc/pos_{k}"]} for k in range(1, self.block)]
                self.live.log_plot(
                    "accuracy_by_position",
                    points,
                    x="position",
                    y="accuracy",
                    title="Accuracy by block position (last epoch)",
                )
            self.live.end()


__all__ = ["TrainLog"]
