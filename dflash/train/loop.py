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

Order of work (bad params fail before anything heavy): check the train params -> read the target's config.json
-> build and validate the drafter config -> scan the data (ids in range, no mask token) -> load the target
weights -> train. Each optimizer step takes the global batch: `train.global_batch` packed rows, or when 0
`batch_size x grad_accum_steps x world_size` (dropped at an epoch's end when incomplete); slot s of batch_size
rows goes to global rank s % world as its micro-step s // world (data.shard_step), so one process with more
micro-steps sees the same rows as several processes. The loss is normalised by the weight sum of the whole
global batch (loss.py), which makes gradients independent of that split up to float summation order.

Devices: `target_device` / `drafter_device` (auto = cuda:0 or cpu). The same GPU for both is the simple layout;
different GPUs is the split layout (target on one, drafter on another; features, the embedding and the lm_head
are copied to the drafter's GPU). With torchrun, the process of LOCAL_RANK l owns GPUs l*gpus_per_process ... of
its node (cuda:N counts from there); the global RANK decides the data and who writes (distributed.py). Mixed precision: target weights in the compute dtype (bf16 on GPU), the drafter keeps fp32 master
weights and runs under bf16 autocast; fp32 everywhere on CPU.

Determinism: the data plan and anchors are functions of (seed, epoch, document), the feature noise of
(seed, step, row of the step): nothing but model, optimizer, scheduler, RNG states and the step counter must be
saved, and a resumed run's losses equal the uninterrupted run's bit for bit on CPU (tests/unit/train/test_train.py). Resumed
on another world size (same global batch), the step, lr schedule, rows, anchors and noise are the same; only the
float summation order of the loss and gradients changes (micro-batch shapes, all-reduce order), so losses agree
to ~1e-6 relative and drift slowly (tests/integration/test_train_multinode.py).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from dflash.core.errors import UserError
from dflash.core.hf import load_target_model, target_config_dict, target_tokenizer
from dflash.core.loader import as_dict
from dflash.core.params import Params
from dflash.core.validate import check_train
from dflash.drafter.build import build_drafter
from dflash.drafter.geometry import build_drafter_config, config_dict, kind_cost
from dflash.drafter.kinds import KINDS
from dflash.drafter.masks import build_masks
from dflash.drafter.model import block_input_ids, count_parameters
from dflash.train import checkpoint, draft_vocab, parallel
from dflash.train import distributed as dist
from dflash.train.data import (
    DocIndex,
    ShardReader,
    docs_digest,
    epoch_rows,
    make_batch,
    packing_efficiency,
    scan_shards,
    shard_step,
)
from dflash.train.distributed import resolve_device
from dflash.train.features import TargetFeatures, target_identity
from dflash.train.loss import normaliser_share, slot_weights, tau_hat
from dflash.train.loss_dspark import explicit_rows, supervised_tokens, zero_rows_tied
from dflash.train.micro import MicroBatch, micro_loss

log = logging.getLogger(__name__)

# train keys that do not change the trained weights: outside the checkpoint hash (see TrainParams)
OPERATIONAL = (
    "out",
    "live_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "max_steps",
    "export_dtype",
    "target_batch_tokens",
    "compile",
    "activation_checkpointing",  # recomputes the same layers in backward: the same maths, less memory
    "target_device",
    "drafter_device",
    "gpus_per_process",
    "batch_size",
    "grad_accum_steps",
    "parallel",  # ddp | fsdp: the same maths (float summation order aside); a run resumes across modes
    "global_batch",  # these three enter the hash only as rows_per_step (the global batch)
    "pilot_warmup_steps",  # the pilot's (dflash/train/pilot.py), not the run's
    "pilot_steps",
)
HEADLINE = (  # reports/train.json, the DVC metrics (the whole summary: reports/train_details.json)
    "completed",
    "steps",
    "epochs",
    "first_loss",
    "final_loss",
    "final_tau_hat",
    "tokens_per_s",
    "packing_efficiency",
    "drafter_params",
    "wall_seconds",
    "steps_seconds",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Everything for one training run; `run()` is the loop. Built in the order of the module docstring."""

    def __init__(self, params: Params, data_dir: str | Path):
        tp, base = params.train, params.base
        self.params, self.tp = params, tp
        check_train(params)  # dflash/core/validate.py: the plan refuses the same
        self.dist = dist.from_env()
        self.rank, self.world = self.dist.rank, self.dist.world  # global: data shard, writer (never a device)
        self.target_device = resolve_device(tp.target_device, "target_device", self.dist, tp.gpus_per_process)
        self.device = resolve_device(tp.drafter_device, "drafter_device", self.dist, tp.gpus_per_process)
        on_gpu = self.device.type == "cuda"
        self.dtype = _DTYPES[tp.dtype] if tp.dtype != "auto" else (torch.bfloat16 if on_gpu else torch.float32)
        self.backend = tp.attention if tp.attention != "auto" else ("flex" if on_gpu else "sdpa")
        if self.backend == "flex" and not on_gpu:
            raise UserError("train.attention: flex_attention has no backward pass on CPU; use sdpa (or auto)")

        # 1. config only: bad drafter params fail here, before any weights are read
        target_cfg = target_config_dict(base.target_dir, base.trust_remote_code)
        tokenizer = target_tokenizer(base.target_dir, base.trust_remote_code)
        self.cfg = build_drafter_config(params.drafter, target_cfg, tokenizer)
        # 2. data: index and epoch plans (metadata only)
        self.index: DocIndex = scan_shards(data_dir, tp.max_length, self.cfg.vocab_size, self.cfg.mask_token_id)
        if not len(self.index.usable):
            raise UserError(f"{data_dir}: no document has an anchor candidate (two adjacent supervised tokens)")
        self.accum, self.rows_per_step = dist.accumulation(
            tp.batch_size, tp.grad_accum_steps, tp.global_batch, self.world
        )
        self._plan_cache: tuple[int, list] = (-1, [])
        rows_per_epoch = [len(self.rows(e)) for e in range(tp.epochs)]  # plans are cheap: metadata only
        self.packing_efficiency = packing_efficiency(self.index, self.rows(0), tp.max_tokens_per_row)
        self.steps_per_epoch = [n // self.rows_per_step for n in rows_per_epoch]
        self.total_steps = sum(self.steps_per_epoch)
        if self.steps_per_epoch[0] == 0:
            raise UserError(
                f"train.batch_size: an epoch packs {rows_per_epoch[0]} rows, fewer than one optimizer step takes "
                f"({self.rows_per_step} = batch_size x {self.accum} micro-steps x {self.world} processes)"
            )
        self.seed = base.seed
        idle_losses = {s.loss_params for s in KINDS.values() if s.loss_params and s.name != self.cfg.kind}  # others'
        key = {
            "train": {k: v for k, v in as_dict(tp).items() if k not in OPERATIONAL and k not in idle_losses},
            "rows_per_step": self.rows_per_step,
            "drafter": config_dict(self.cfg),
            "seed": base.seed,
            "compute": {"device": self.device.type, "dtype": str(self.dtype), "attention": self.backend},
            "target": target_identity(base.target_dir, target_cfg),
            "data": self.index.fingerprint(),
        }
        dist.init(self.dist, self.device)
        root = Path(tp.out) / "checkpoints"
        self.ckpt_dir = checkpoint.config_folder(root, key, write=self.dist.is_main)
        self.resumed_code_changes: list[str] = []  # files changed since a resumed checkpoint was written (rank 0)
        dist.agree(self.dist, self.ckpt_dir.name, "the training configuration hash (params, data, target)")
        self._barrier()
        dist.check_shared(self.dist, self.ckpt_dir / checkpoint.CONFIG, "train.out")
        problem = None  # a world change without train.global_batch: refused (rank 0 decides for all)
        if self.dist.is_main and checkpoint.latest(self.ckpt_dir) is None:
            try:
                checkpoint.refuse_other_batch(root, key, f"batch_size x {self.accum} micro-steps x {self.world} procs")
            except UserError as exc:
                problem = str(exc)
        problem = dist.broadcast_str(self.dist, problem)
        if problem:
            raise UserError(problem)

        # 3. the target (weights) and its shared frozen modules
        target = load_target_model(base.target_dir, self.dtype, self.target_device, base.trust_remote_code)
        self.features = TargetFeatures(
            target,
            self.cfg.target_layer_ids,
            self.cfg.num_target_layers,
            tp.target_batch_tokens,
            # the target's own predictions need its final hidden states (dspark / dflash2: always)
            final=tp.loss_target != "tokens" or kind_cost(self.cfg).target_logits,
        )
        embed = target.get_input_embeddings()
        self.embed = embed if self.target_device == self.device else copy.deepcopy(embed).to(self.device)
        # the target's frozen lm_head (exact zero-row softmax), or the drafter's own rows of a pruned vocabulary
        self.vocab = draft_vocab.setup(self.cfg, target.get_output_embeddings(), data_dir, self.device, tp.loss_target)
        self.head = self.vocab.loss_head
        self.slot_w = slot_weights(self.cfg.block_size, tp.loss_gamma).to(self.device)

        # 4. drafter (fp32 master weights), optimizer, schedule
        torch.manual_seed(base.seed)
        self.model = build_drafter(self.cfg, device=self.device, dtype=torch.float32)
        self.loss_head = self.head  # DSpark: zero lm_head rows that are labels get their own W2 row (loss_dspark.py)
        if self.model.label_row_weight() is not None and self.head.num_zero:
            self.loss_head = explicit_rows(self.head, supervised_tokens(self.index.paths, self.cfg.vocab_size))
            if not zero_rows_tied(self.loss_head, self.model.label_row_weight()):
                raise RuntimeError("DSpark markov_w2: the W2 rows of the zero lm_head rows differ (the loss ties them)")
        self.model.activation_checkpointing = tp.activation_checkpointing
        module = parallel.wrap_drafter(self.model, tp.parallel, self.device, self.world, self.dtype)  # ddp | fsdp
        self.ddp = module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else None
        self.forward = torch.compile(module, dynamic=True) if tp.compile else module
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=tp.lr, betas=tuple(tp.adam_betas), weight_decay=tp.weight_decay
        )
        self.warmup = math.ceil(tp.warmup_ratio * self.total_steps)
        total, warm, floor = self.total_steps, self.warmup, tp.min_lr_ratio
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, total, warm, floor))
        self.step = 0
        self.history: list[dict] = []
        self._reader = ShardReader(self.index)

    # ------------------------------------------------------------------------------------------- data
    def rows(self, epoch: int) -> list:
        """The epoch's packed rows (data.epoch_rows), one epoch cached."""
        if self._plan_cache[0] != epoch:
            plan = epoch_rows(self.index, self.params.base.seed, epoch, self.tp.max_tokens_per_row, self.tp.pack_window)
            self._plan_cache = (epoch, plan)
        return self._plan_cache[1]

    def locate(self, step: int) -> tuple[int, int]:
        """Global optimizer step -> (epoch, step inside the epoch)."""
        for epoch, n in enumerate(self.steps_per_epoch):
            if step < n:
                return epoch, step
            step -= n
        raise IndexError("step past the last epoch")

    def step_rows(self, step: int) -> list:
        """The global batch of an optimizer step: its packed rows (arrays of document numbers), any world size."""
        epoch, i = self.locate(step)
        return self.rows(epoch)[i * self.rows_per_step : (i + 1) * self.rows_per_step]

    def micro_batches(self, step: int) -> list:
        """This process's micro-steps of a global step: [(slot, Batch)] (data.shard_step)."""
        epoch, _ = self.locate(step)
        slots = shard_step(self.step_rows(step), self.tp.batch_size, self.accum, self.world, self.rank)
        return [(s, make_batch(r, self._reader, self.tp.num_anchors, self.seed, epoch)) for s, r in slots]

    # ------------------------------------------------------------------------------------------- step
    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce(self.dist, t)

    def _barrier(self) -> None:
        dist.barrier(self.dist)

    def _noise(self, feats: torch.Tensor, step: int, slot: int, row_tokens: list[int]) -> torch.Tensor:
        """Uniform feature noise seeded by (seed, step, row of the step): independent of the world size."""
        parts, first = [], slot * self.tp.batch_size
        for j, n in enumerate(row_tokens):
            g = torch.Generator(feats.device).manual_seed(_mix(self.seed, step, first + j))
            parts.append(torch.rand((n, feats.shape[1]), generator=g, device=feats.device, dtype=torch.float32))
        noise = torch.cat(parts)
        return feats + ((noise * 2 - 1) * self.tp.feature_noise).to(feats.dtype)

    def compute_gradients(self, step: int) -> dict:
        """Forward + backward of every micro-step of `step`; leaves the (all-reduced) gradients in the drafter."""
        c, dev = self.cfg, self.device
        inside = self.vocab.inside
        prepared = [MicroBatch.on_device(slot, b, c.block_size, dev, inside) for slot, b in self.micro_batches(step)]
        local_w = sum(normaliser_share(m.valid, self.slot_w, self.tp.position_weighting) for m in prepared)
        fed = [sum(m.batch.num_tokens for m in prepared), sum(docs_digest(m.batch.documents) for m in prepared)]
        stats = torch.tensor([local_w, *fed, sum(m.outside for m in prepared)], dtype=torch.float64, device=dev)
        global_w, tokens, digest, outside = self._reduce(stats).tolist()
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
                feats = self._noise(feats, step, m.slot, b.row_tokens)
            with torch.no_grad():
                block_ids = block_input_ids(m.input_ids, m.anchors, c.query_slots, c.mask_token_id)
                block_embeds = self.embed(block_ids)  # (N*B, H)
            sync = self.ddp is None or n == len(prepared) - 1
            with nullcontext() if sync else self.ddp.no_sync():
                # masks are built outside the (optionally compiled) drafter: one compiled BlockMask builder
                masks = build_masks(
                    c.layer_types,
                    m.anchors,
                    m.input_ids.numel(),
                    c.query_slots,
                    c.sliding_window,
                    m.doc_ids,
                    self.backend,
                )
                with autocast:
                    hidden = self.forward(
                        feats, block_embeds, m.anchors, m.doc_ids, b.position_ids.to(dev), self.backend, masks
                    )
                chunk = self.tp.logits_chunk_blocks * c.block_size
                inputs = (hidden, m, self.loss_head, self.slot_w, normaliser, chunk, self.tp, final, self.embed, feats)
                out = micro_loss(self.model, *inputs)
                out.loss.backward()
            loss_sum += out.loss.detach().double() / self.world
            correct += out.correct
            counted += out.counted
        packed = self._reduce(torch.cat([loss_sum[None], correct.double(), counted.double()]))
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
        epoch, i = self.locate(self.step) if self.step < self.total_steps else (self.tp.epochs, 0)
        return {
            "step": self.step,
            "epoch": epoch,
            "epoch_step": i,
            "total_steps": self.total_steps,
            "world_size": self.world,  # informational: a resume may use another world size (same global batch)
            "rows_per_step": self.rows_per_step,
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
        self._barrier()

    def resume(self) -> bool:
        latest = checkpoint.latest(self.ckpt_dir) if self.dist.is_main else None
        name = dist.broadcast_str(self.dist, latest.name if latest else None)  # every rank loads rank 0's pick
        if name is None:
            return False
        path = self.ckpt_dir / name
        weights, state = checkpoint.load(path, self.device)
        if state["total_steps"] != self.total_steps:
            raise RuntimeError(f"{path}: planned {state['total_steps']} steps, this run plans {self.total_steps}")
        parallel.load_full_state(self.model, self.opt, weights, state["optimizer"])  # either mode's checkpoint
        self.sched.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.history = int(state["step"]), checkpoint.unpack_history(state["history"])
        log.info(
            "resumed from %s: %s, written on %s process(es), now %d",
            path,
            checkpoint.describe(state),
            state.get("world_size", "?"),
            self.world,
        )
        if self.dist.is_main:
            self.resumed_code_changes = checkpoint.code_changes(path)
        if self.resumed_code_changes:
            finished = self.step >= self.total_steps
            log.warning(checkpoint.code_change_warning(path, self.resumed_code_changes, finished))
        return True

    # ------------------------------------------------------------------------------------------- loop
    def run(self) -> dict:
        """Train from the latest checkpoint (if any) to the end (or train.max_steps); export when done."""
        from dflash.train.log import TrainLog

        resumed = self.resume()
        end = self.total_steps if not self.tp.max_steps else min(self.total_steps, self.tp.max_steps)
        logger = TrainLog(self, enabled=self.dist.is_main, end=end)
        logger.replay(self.history)
        t0 = time.perf_counter()
        while self.step < end:
            epoch, i = self.locate(self.step)
            t = time.perf_counter()
            metrics = self.compute_gradients(self.step)
            lr = self.sched.get_last_lr()[0]
            metrics["grad_norm"] = self.optimizer_step()
            self.step += 1
            metrics.update(step=self.step, epoch=epoch, lr=lr, seconds=time.perf_counter() - t)
            self.history.append(metrics)
            logger.update(metrics)
            epoch_end = i + 1 == self.steps_per_epoch[epoch]
            every = self.tp.checkpoint_every and self.step % self.tp.checkpoint_every == 0
            if every or epoch_end or self.step == end:
                self.save()
        logger.close()
        summary = self.summary(time.perf_counter() - t0, resumed)
        if self.step == self.total_steps:
            self.export()
        return summary

    def close(self) -> None:
        dist.close(self.dist)

    def export(self) -> Path:
        from dflash.core.io import staged_folder, write_json
        from dflash.drafter.export import save_drafter

        out = Path(self.tp.out) / "drafter"
        full = parallel.unsharded(self.model, self.rank)  # a plain full-weight copy on rank 0 (fsdp: a collective)
        if self.dist.is_main:
            dtype = _DTYPES[self.tp.export_dtype] if self.tp.export_dtype != "auto" else self.dtype
            model = full.to(dtype)
            with staged_folder(out) as staging:  # eval never sees new weights beside an old config
                save_drafter(model, self.cfg, staging, self.vocab.head)
                write_json(staging / "run_info.json", checkpoint.run_info(as_dict(self.params), {"steps": self.step}))
        self._barrier()
        return out

    def summary(self, seconds: float, resumed: bool) -> dict:
        last_epoch = [h for h in self.history if h["epoch"] == self.history[-1]["epoch"]] if self.history else []
        correct = [sum(h["correct"][k] for h in last_epoch) for k in range(1, self.cfg.block_size)]
        counted = [sum(h["counted"][k] for h in last_epoch) for k in range(1, self.cfg.block_size)]
        acc = [a / n if n else 0.0 for a, n in zip(correct, counted, strict=True)]
        tail = self.history[-max(1, len(last_epoch)) :]
        run_tokens = sum(h["tokens"] for h in self.history)
        run_seconds = sum(h["seconds"] for h in self.history)
        return {
            "completed": self.step == self.total_steps,
            "resumed": resumed,
            "steps": self.step,
            "total_steps": self.total_steps,
            "epochs": self.tp.epochs,
            "world_size": self.world,
            "nodes": self.dist.nodes,
            "global_batch_rows": self.rows_per_step,
            "device": str(self.device),
            "target_device": str(self.target_device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention": self.backend,
            "documents": int(len(self.index.length)),
            "documents_used": int(len(self.index.usable)),
            "train_tokens_per_epoch": int(self.index.length[self.index.usable].sum()),
            "packing_efficiency": self.packing_efficiency,
            "rows_per_step": self.rows_per_step,
            "drafter_params": count_parameters(self.model),
            "lm_head_zero_rows": self.head.num_zero,
            "first_loss": self.history[0]["loss"] if self.history else None,
            "final_loss": sum(h["loss"] for h in tail) / len(tail) if tail else None,
            "final_accuracy_by_position": acc,
            "final_tau_hat": tau_hat(acc),
            "tokens_per_s": run_tokens / run_seconds if run_seconds else None,
            "wall_seconds": seconds,  # this invocation's loop (a resumed run: only the steps it ran)
            "steps_seconds": run_seconds,  # every optimizer step of the run, resumed invocations included
            "checkpoint_dir": str(self.ckpt_dir),
            "resumed_code_changes": self.resumed_code_changes,  # the code files changed since (checkpoint.code_changes)
            **self.vocab.summary(self.history),  # draft_vocab_size, _coverage, _outside_slots, _outside_frac
        }


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (stable across runs and processes)."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p) + 1) % (1 << 63)
    return h


def train(params: Params, data_dir: str | Path) -> dict:
    """Build a Trainer, run it, return the summary (module docstring)."""
    trainer = Trainer(params, data_dir)
    try:
        return trainer.run()
    finally:
        trainer.close()


__all__ = ["OPERATIONAL", "Trainer", "lr_factor", "resolve_device", "train"]
