"""Online DFlash training: target features in-process, per-document anchors, decayed chunked loss, exact resume.

Inputs: `${tokenize.out}/train/shard-*.arrow` (data.py has the contract), the target in `${base.target_dir}`,
params `train`, `drafter`, `base`. Outputs: `${train.out}/drafter/` (z-lab export: config.json +
model.safetensors, plus run_info.json), `${train.out}/checkpoints/<hash>/step-*/` (checkpoint.py), dvclive
metrics and plots in `${train.live_dir}` and a summary dict (the stage writes `${base.reports_dir}/train.json`, its
HEADLINE, and `train_details.json`).

    python -m stages.train --params params.yaml                       # one process (CPU, or one GPU)
    torchrun --nproc_per_node 4 -m stages.train --params params.yaml  # data parallel (DDP; gloo on CPU)
    torchrun --nnodes 2 --node-rank R --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        -m stages.train --params params.yaml                          # on each node (distributed.py)

Order of work (bad params fail before anything heavy), one named set-up step each (`Trainer._set_*`, their parts in
dflash/train/parts.py, which also says how the devices are chosen): check the train params -> the devices -> read the
target's config.json, build and validate the drafter config -> scan the data (ids in range, no mask token) into its
plan (dflash/train/data_plan.py: which packed rows each optimizer step takes, this process's micro-steps of them) ->
the checkpoint folder of the configuration -> load the target weights -> the drafter, optimizer, schedule -> train.
The loss is normalised by the weight sum of the whole global batch (loss.py), which makes gradients independent of
how a step is split over processes and micro-steps, up to float summation order.

Determinism: the data plan and anchors are functions of (seed, epoch, document), the feature noise of
(seed, step, row of the step): nothing but model, optimizer, scheduler, RNG states and the step counter must be
saved, and a resumed run's losses equal the uninterrupted run's bit for bit on CPU (tests/unit/train/test_train.py).
Resumed on another world size (same global batch), the step, lr schedule, rows, anchors and noise are the same; only the
float summation order of the loss and gradients changes (micro-batch shapes, all-reduce order), so losses agree
to ~1e-6 relative and drift slowly (tests/integration/test_train_multinode.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dflash.core.errors import UserError
from dflash.core.hf import target_config_dict, target_tokenizer
from dflash.core.loader import as_dict
from dflash.core.params import Params, TrainParams
from dflash.core.validate import check_train
from dflash.drafter.geometry import DrafterConfig, build_drafter_config
from dflash.drafter.model import block_input_ids, count_parameters
from dflash.train import checkpoint, parallel, parts
from dflash.train import distributed as dist
from dflash.train.data import DocIndex, docs_digest, scan_shards
from dflash.train.data_plan import DataPlan
from dflash.train.draft_vocab import DraftVocabRun
from dflash.train.features import TargetFeatures
from dflash.train.loss import LMHead, normaliser_share
from dflash.train.micro import MicroBatch, feature_noise, micro_loss
from dflash.train.summary import HistoryFigures, TrainSummary

log = logging.getLogger(__name__)


class Trainer:
    """Everything for one training run; `run()` is the loop. Built in the order of the module docstring."""

    params: Params
    tp: TrainParams
    dist: dist.Dist
    rank: int  # global: data shard, writer (never a device)
    world: int
    target_device: torch.device
    device: torch.device  # the drafter's
    dtype: torch.dtype  # compute dtype (the drafter's master weights stay fp32)
    backend: str  # attention: sdpa | flex
    cfg: DrafterConfig
    index: DocIndex
    data: DataPlan  # which rows each step takes (the pilot replaces it: dflash/train/pilot.py)
    packing_efficiency: float
    seed: int
    ckpt_dir: Path
    resumed_code_changes: list[str]  # files changed since a resumed checkpoint was written (rank 0)
    features: TargetFeatures
    embed: torch.nn.Module
    vocab: DraftVocabRun
    head: LMHead  # the loss head: the target's lm_head (zero rows folded) or the pruned vocabulary's
    slot_w: torch.Tensor
    model: torch.nn.Module
    loss_head: LMHead
    ddp: torch.nn.parallel.DistributedDataParallel | None
    forward: Any  # the module a step runs (ddp / fsdp wrapped, compiled when train.compile)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    warmup: int
    step: int  # optimizer steps done
    history: list[dict]  # one dict per optimizer step (compute_gradients + step, lr, seconds, grad_norm)

    def __init__(self, params: Params, data_dir: str | Path):
        self.params, self.tp, self.seed = params, params.train, params.base.seed
        check_train(params)  # dflash/core/validate.py: the plan refuses the same
        self.dist = dist.from_env()
        self.rank, self.world = self.dist.rank, self.dist.world
        self._set_devices()
        target_config = self._set_drafter_config()  # config only: bad drafter params fail here, before any weights
        self._set_data(data_dir)  # metadata only
        self._set_checkpoint_folder(target_config)
        self._set_target(data_dir)
        self._set_drafter()
        self.step, self.history = 0, []

    # ------------------------------------------------------------------------------------------- set-up
    def _set_devices(self) -> None:
        devices = parts.resolve_devices(self.tp, self.dist)
        self.target_device, self.device = devices.target, devices.drafter
        self.dtype, self.backend = devices.dtype, devices.attention

    def _devices(self) -> parts.Devices:
        return parts.Devices(target=self.target_device, drafter=self.device, dtype=self.dtype, attention=self.backend)

    def _set_drafter_config(self) -> dict[str, Any]:
        """The drafter config from params + the target's config.json and tokenizer; returns that config."""
        base = self.params.base
        target_config = target_config_dict(base.target_dir, base.trust_remote_code)
        tokenizer = target_tokenizer(base.target_dir, base.trust_remote_code)
        self.cfg = build_drafter_config(self.params.drafter, target_config, tokenizer)
        return target_config

    def _set_data(self, data_dir: str | Path) -> None:
        self.index = scan_shards(data_dir, self.tp.max_length, self.cfg.vocab_size, self.cfg.mask_token_id)
        if not len(self.index.usable):
            raise UserError(f"{data_dir}: no document has an anchor candidate (two adjacent supervised tokens)")
        self.data = DataPlan.build(self.index, self.tp, self.seed, self.dist)
        self.packing_efficiency = self.data.packing_efficiency()

    def _set_checkpoint_folder(self, target_config: dict[str, Any]) -> None:
        key = parts.checkpoint_key(
            self.params,
            self.cfg,
            rows_per_step=self.data.rows_per_step,
            devices=self._devices(),
            target_config=target_config,
            index=self.index,
        )
        dist.init(self.dist, self.device)
        self.ckpt_dir = parts.open_checkpoint_folder(self.dist, self.tp.out, key, accum=self.data.accum)
        self.resumed_code_changes = []

    def _set_target(self, data_dir: str | Path) -> None:
        target = parts.load_target(self.params, self.cfg, self._devices(), data_dir)
        self.features, self.embed, self.vocab, self.slot_w = target.features, target.embed, target.vocab, target.slot_w
        self.head = self.vocab.loss_head

    def _set_drafter(self) -> None:
        drafter = parts.build_training(
            self.params,
            self.cfg,
            self._devices(),
            head=self.head,
            index=self.index,
            total_steps=self.data.total_steps,
            world=self.world,
        )
        self.model, self.loss_head, self.ddp = drafter.model, drafter.loss_head, drafter.ddp
        self.forward, self.opt, self.sched, self.warmup = drafter.forward, drafter.opt, drafter.sched, drafter.warmup

    # ------------------------------------------------------------------------------------------- step
    def compute_gradients(self, step: int) -> dict:
        """Forward + backward of every micro-step of `step`; leaves the (all-reduced) gradients in the drafter."""
        c, dev = self.cfg, self.device
        inside = self.vocab.inside
        batches = self.data.micro_batches(step)
        prepared = [MicroBatch.on_device(slot, b, c.block_size, dev, inside) for slot, b in batches]
        local_w = sum(normaliser_share(m.valid, self.slot_w, self.tp.position_weighting) for m in prepared)
        fed = [sum(m.batch.num_tokens for m in prepared), sum(docs_digest(m.batch.documents) for m in prepared)]
        stats = torch.tensor([local_w, *fed, sum(m.outside for m in prepared)], dtype=torch.float64, device=dev)
        global_w, tokens, digest, outside = dist.all_reduce(self.dist, stats).tolist()
        normaliser = global_w / self.world  # DDP averages gradients over processes: undo it
        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        correct = torch.zeros(c.block_size, dtype=torch.long, device=dev)
        counted = torch.zeros_like(correct)
        autocast = torch.autocast(dev.type, dtype=self.dtype) if self.dtype != torch.float32 else nullcontext()
        for n, m in enumerate(prepared):
            b = m.batch
            feats = self.features(b.input_ids, b.doc_starts, b.doc_lengths)  # (S, K*H) [, final (S, H)]
            final = None
            if isinstance(feats, tuple):
                feats, final = feats[0], feats[1].to(dev, non_blocking=True)
            feats = feats.to(dev, non_blocking=True)
            if self.tp.feature_noise > 0:
                first_row = m.slot * self.tp.batch_size  # the noise follows the row's place in the step
                feats = feature_noise(
                    feats, self.tp.feature_noise, seed=self.seed, step=step, first_row=first_row, rows=b.row_tokens
                )
            with torch.no_grad():
                block_ids = block_input_ids(m.input_ids, m.anchors, c.query_slots, c.mask_token_id)
                block_embeds = self.embed(block_ids)  # (N*B, H)
            sync = self.ddp is None or n == len(prepared) - 1
            with nullcontext() if sync else self.ddp.no_sync():
                masks = m.masks(c, self.backend)
                with autocast:
                    hidden = self.forward(
                        feats, block_embeds, m.anchors, m.doc_ids, b.position_ids.to(dev), self.backend, masks
                    )
                out = micro_loss(
                    self.model,
                    hidden,
                    m,
                    head=self.loss_head,
                    slot_w=self.slot_w,
                    normaliser=normaliser,
                    chunk_rows=self.tp.logits_chunk_blocks * c.block_size,
                    tp=self.tp,
                    final=final,
                    embed=self.embed,
                    features=feats,
                )
                out.loss.backward()
            loss_sum += out.loss.detach().double() / self.world
            correct += out.correct
            counted += out.counted
        packed = dist.all_reduce(self.dist, torch.cat([loss_sum[None], correct.double(), counted.double()]))
        return {
            "loss": float(packed[0]),
            "correct": [int(x) for x in packed[1 : 1 + c.block_size]],
            "counted": [int(x) for x in packed[1 + c.block_size :]],
            "tokens": int(tokens),
            "weight": global_w,
            "docs_digest": int(digest),  # the multiset of documents the step fed, over all ranks (tests)
            "outside": int(outside),  # valid slots masked: label outside the draft vocabulary
        }

    def optimizer_step(self) -> float:
        clip = self.tp.grad_clip if self.tp.grad_clip > 0 else float("inf")
        norm = parallel.clip_grad_norm(self.model, clip)  # the global norm, also over fsdp shards
        self.opt.step()
        self.sched.step()
        return float(norm)

    # ------------------------------------------------------------------------------------------- state
    def state(self) -> dict:
        total = self.data.total_steps
        epoch, i = self.data.locate(self.step) if self.step < total else (self.tp.epochs, 0)
        return {
            "step": self.step,
            "epoch": epoch,
            "epoch_step": i,
            "total_steps": total,
            "world_size": self.world,  # informational: a resume may use another world size (same global batch)
            "rows_per_step": self.data.rows_per_step,
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": checkpoint.rng_state(),
            "history": checkpoint.pack_history(self.history),
        }

    def save(self) -> None:
        weights, optim = parallel.full_state(self.model, self.opt)  # full tensors on rank 0 (fsdp: a collective)
        if self.dist.is_main:  # global rank 0 only; the barrier keeps every rank behind a complete checkpoint
            writer = {"world_size": self.world, "nodes": self.dist.nodes, "rank": self.rank, "host": self.dist.host}
            info = checkpoint.run_info(as_dict(self.params), {**writer, "step": self.step})
            path = checkpoint.save(
                self.ckpt_dir, self.step, weights, {**self.state(), "optimizer": optim}, info, self.tp.keep_checkpoints
            )
            log.info("checkpoint %s", path)
        dist.barrier(self.dist)

    def resume(self) -> bool:
        latest = checkpoint.latest(self.ckpt_dir) if self.dist.is_main else None
        name = dist.broadcast_str(self.dist, latest.name if latest else None)  # every rank loads rank 0's pick
        if name is None:
            return False
        path, total = self.ckpt_dir / name, self.data.total_steps
        weights, state = checkpoint.load(path, self.device)
        if state["total_steps"] != total:
            raise RuntimeError(f"{path}: planned {state['total_steps']} steps, this run plans {total}")
        parallel.load_full_state(self.model, self.opt, weights, state["optimizer"])  # either mode's checkpoint
        self.sched.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.history = int(state["step"]), checkpoint.unpack_history(state["history"])
        written_on = state.get("world_size", "?")
        log.info(
            "resumed from %s: %s, written on %s process(es), now %d",
            path,
            checkpoint.describe(state),
            written_on,
            self.world,
        )
        if self.dist.is_main:
            self.resumed_code_changes = checkpoint.code_changes(path)
        if self.resumed_code_changes:
            finished = self.step >= total
            log.warning(checkpoint.code_change_warning(path, self.resumed_code_changes, finished))
        return True

    # ------------------------------------------------------------------------------------------- loop
    def run(self) -> dict:
        """Train from the latest checkpoint (if any) to the end (or train.max_steps); export when done. Returns the
        summary's JSON (summary.py: train_details.json)."""
        from dflash.train.log import TrainLog

        resumed = self.resume()
        total = self.data.total_steps
        end = total if not self.tp.max_steps else min(total, self.tp.max_steps)
        logger = TrainLog(self, enabled=self.dist.is_main, end=end)
        logger.replay(self.history)
        t0 = time.perf_counter()
        while self.step < end:
            epoch, i = self.data.locate(self.step)
            t = time.perf_counter()
            metrics = self.compute_gradients(self.step)
            lr = self.sched.get_last_lr()[0]
            metrics["grad_norm"] = self.optimizer_step()
            self.step += 1
            metrics.update(step=self.step, epoch=epoch, lr=lr, seconds=time.perf_counter() - t)
            self.history.append(metrics)
            logger.update(metrics)
            epoch_end = i + 1 == self.data.steps_per_epoch[epoch]
            every = self.tp.checkpoint_every and self.step % self.tp.checkpoint_every == 0
            if every or epoch_end or self.step == end:
                self.save()
        logger.close()
        summary = self.summary(time.perf_counter() - t0, resumed)
        if self.step == total:
            self.export()
        return summary.as_json()

    def close(self) -> None:
        dist.close(self.dist)

    def export(self) -> Path:
        from dflash.core.io import staged_folder, write_json
        from dflash.drafter.export import save_drafter

        out = Path(self.tp.out) / "drafter"
        full = parallel.unsharded(self.model, self.rank)  # a plain full-weight copy on rank 0 (fsdp: a collective)
        if self.dist.is_main:
            dtype = parts.DTYPES[self.tp.export_dtype] if self.tp.export_dtype != "auto" else self.dtype
            model = full.to(dtype)
            with staged_folder(out) as staging:  # eval never sees new weights beside an old config
                save_drafter(model, self.cfg, staging, self.vocab.head)
                write_json(staging / "run_info.json", checkpoint.run_info(as_dict(self.params), {"steps": self.step}))
        dist.barrier(self.dist)
        return out

    def summary(self, seconds: float, resumed: bool) -> TrainSummary:
        """The run so far (summary.py); `seconds`: this invocation's loop."""
        figures = HistoryFigures.of(self.history, self.cfg.block_size)
        return TrainSummary(
            completed=self.step == self.data.total_steps,
            resumed=resumed,
            steps=self.step,
            total_steps=self.data.total_steps,
            epochs=self.tp.epochs,
            world_size=self.world,
            nodes=self.dist.nodes,
            global_batch_rows=self.data.rows_per_step,
            device=str(self.device),
            target_device=str(self.target_device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention=self.backend,
            documents=int(len(self.index.length)),
            documents_used=int(len(self.index.usable)),
            train_tokens_per_epoch=int(self.index.length[self.index.usable].sum()),
            packing_efficiency=self.packing_efficiency,
            drafter_params=count_parameters(self.model),
            lm_head_zero_rows=self.head.num_zero,
            first_loss=figures.first_loss,
            final_loss=figures.final_loss,
            final_accuracy_by_position=figures.final_accuracy_by_position,
            final_tau_hat=figures.final_tau_hat,
            tokens_per_s=figures.tokens_per_s,
            wall_seconds=seconds,
            steps_seconds=figures.steps_seconds,
            checkpoint_dir=str(self.ckpt_dir),
            resumed_code_changes=self.resumed_code_changes,
            draft_vocab=self.vocab.summary(self.history),
        )


def train(params: Params, data_dir: str | Path) -> dict:
    """Build a Trainer, run it, return the summary's JSON (module docstring)."""
    trainer = Trainer(params, data_dir)
    try:
        return trainer.run()
    finally:
        trainer.close()


__all__ = ["Trainer", "train"]
