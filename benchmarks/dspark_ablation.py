"""Experiment: what DSpark's loss terms and the Markov head's gradient routes do at a training budget, beside the
other kinds trained the same way (docs/results/successors.md, "DSpark ablation" and "Four kinds").

Every point trains one drafter with the project's own Trainer (dflash.train.loop, params.yaml plus the point's
`-S`-style overrides, its own out folder) on a tokenized dataset against a target, then measures:
  acc 1..B-1   teacher-forced accuracy per draft position over the last training epoch (the trainer's summary;
               DSpark's Markov predecessor is the true token) and the tau_hat they imply
  head         the Markov head alone (the argmax of W2 W1[prev] over the whole vocabulary) predicting the next
               completion token from the true previous one, on the train and on the held-out completions
  tau T=0 / 1  the PyTorch reference evaluator (dflash/eval/reference.py) on the held-out prompts (the dataset's
               eval split, eval.num_prompts / eval.max_tokens of params.yaml): greedy verification, and
               rejection sampling at temperature 1 (seed base.seed + prompt index) with its expected tau
and, once per dataset, what a table of previous-token counts knows: for each previous token the most frequent
next token among the train completions' adjacent supervised pairs, scored on those pairs (train) and on the
held-out completions' pairs (eval). The head columns are the same pairs scored by the head.

Matched: every point trains over the whole vocabulary (drafter.draft_vocab_size 0: only dflash has a pruned path),
with params.yaml's loss target, slot weighting, block, steps and seed; only the point's overrides differ.
Budgets: `1x` is params.yaml's train.epochs (on the demo's data 174 optimizer steps), `4x` four times the epochs
(the cosine schedule stretched to match). A point that already ran (OUT/BUDGET-POINT/result.json) is read back;
a killed training resumes from its checkpoints. Points run one after another, in the order of --points.

Inputs: --target (a target folder, base.target_dir; the demo's artifacts/target), --data (tokenize's output with
train/ and eval/ shards; the demo's artifacts/tokenize), --params (default params.yaml).
Outputs: OUT/BUDGET-POINT/ (train out: drafter/, checkpoints/, live/; result.json), OUT/count_table.json, the table
printed and written as markdown to --report.

    python benchmarks/dspark_ablation.py --target artifacts/target --data artifacts/tokenize \
        --out artifacts/dspark-ablation --report reports/dspark-ablation.md              # every point, both budgets
    python benchmarks/dspark_ablation.py --target artifacts/target --data artifacts/tokenize \
        --out artifacts/dspark-ablation --budgets 1x --points dflash-baseline paper ce    # a slice
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DSPARK = ["drafter.kind=dspark", "drafter.dspark.markov_init=zeros"]  # the paper's init; ce-counts: counts


def _loss(ce: float, l1: float, confidence: float, to_markov: bool = True) -> list[str]:
    keys = {"ce": ce, "l1": l1, "confidence": confidence, "confidence_to_markov": str(to_markov).lower()}
    return [f"train.dspark_loss.{k}={v}" for k, v in keys.items()]


PAPER = _loss(0.1, 0.9, 1.0)
# name -> (overrides, what it tests); every DSpark point sets every key a point varies (the loss, the head's
# gradient routes), so each reads alone whatever params.yaml's defaults are
POINTS: dict[str, tuple[list[str], str]] = {
    "dflash-baseline": (["drafter.kind=dflash"], "DFlash, z-lab 1+N layout, CE"),
    "paper": ([*DSPARK, *PAPER], "the paper: 0.1 CE + 0.9 L1 + 1.0 confidence, its gradient into W1"),
    "paper-w1": ([*DSPARK, *_loss(0.1, 0.9, 1.0, False)], "the paper's weights, W1[prev] detached in the BCE"),
    "ce": ([*DSPARK, *_loss(1.0, 0.0, 0.0)], "CE only"),
    "ce+l1": ([*DSPARK, *_loss(0.1, 0.9, 0.0)], "+ L1 (the paper's weights, no confidence)"),
    "ce+conf": ([*DSPARK, *_loss(1.0, 0.0, 1.0)], "CE + confidence, its gradient into W1"),
    "ce1+l1": ([*DSPARK, *_loss(1.0, 0.9, 1.0, False)], "CE weight 1 beside the paper's L1 and confidence"),
    "ce.5+l1.5": ([*DSPARK, *_loss(0.5, 0.5, 1.0, False)], "CE 0.5, L1 0.5, confidence 1"),
    "ce-r8": ([*DSPARK, *_loss(1.0, 0.0, 0.0), "drafter.dspark.markov_rank=8"], "CE only, Markov rank 8"),
    "ce-r256": ([*DSPARK, *_loss(1.0, 0.0, 0.0), "drafter.dspark.markov_rank=256"], "CE only, Markov rank 256 (paper)"),
    "ce-counts": (
        ["drafter.kind=dspark", "drafter.dspark.markov_init=counts", *_loss(1.0, 0.0, 0.0)],
        "CE only, the Markov head initialised from the count table (dflash/train/loss_dspark.py)",
    ),
    "kind-dflash2": (["drafter.kind=dflash2"], "DFlash2 at params.yaml's selector loss"),
    "kind-lilicorr": (["drafter.kind=lilicorr"], "LiLiCorr at params.yaml's transition loss"),
}
MATCHED = ["drafter.draft_vocab_size=0"]
COUNT_TABLE = "count_table.json"


# ------------------------------------------------------------------------------------------ data


def completion_pairs(folder: Path) -> tuple[list[int], list[int]]:
    """(previous, next) over every pair of adjacent supervised tokens (loss_mask 1 on both) of the shards."""
    from dflash.core.io import iter_arrow_batches, list_shards

    prev, nxt = [], []
    for shard in list_shards(folder, "shard-*.arrow"):
        for batch in iter_arrow_batches(shard):
            names = batch.schema.names
            ids_col = batch.column(names.index("input_ids")).to_pylist()
            mask_col = batch.column(names.index("loss_mask")).to_pylist()
            for ids, mask in zip(ids_col, mask_col, strict=True):
                for t in range(1, len(ids)):
                    if mask[t] and mask[t - 1]:
                        prev.append(ids[t - 1])
                        nxt.append(ids[t])
    return prev, nxt


def count_table(data: Path) -> dict:
    """The previous-token count table's accuracy on the train and held-out completions (module docstring)."""
    train, held = completion_pairs(data / "train"), completion_pairs(data / "eval")
    counts: dict[int, Counter] = defaultdict(Counter)
    for p, n in zip(*train, strict=True):
        counts[p][n] += 1
    best = {p: c.most_common(1)[0][0] for p, c in counts.items()}

    def acc(pairs: tuple[list[int], list[int]]) -> float:
        return sum(best.get(p) == n for p, n in zip(*pairs, strict=True)) / max(1, len(pairs[0]))

    return {"train": acc(train), "eval": acc(held), "train_pairs": len(train[0]), "eval_pairs": len(held[0])}


def head_accuracy(drafter, pairs: tuple[list[int], list[int]], chunk: int = 64) -> float | None:
    """The Markov head alone: argmax over the vocabulary of W2 W1[prev] against the next token (None: no head)."""
    import torch

    head = getattr(drafter, "markov_head", None)
    if head is None or not pairs[0]:
        return None
    prev, nxt = torch.tensor(pairs[0]), torch.tensor(pairs[1])
    uniq, inverse = torch.unique(prev, return_inverse=True)
    with torch.no_grad():
        best = torch.cat([head.bias(head.embed(uniq[s : s + chunk])).argmax(1) for s in range(0, len(uniq), chunk)])
    return float((best[inverse] == nxt).double().mean())


def teacher_forced(params_file: str, overrides: list[str], drafter, data: Path, out: Path) -> dict:
    """Teacher-forced accuracy per draft position on the held-out completions: the project's Trainer built over the
    eval split (anchors as in training, every epoch's), its gradients computed and thrown away, the trained weights
    loaded; for a drafter with a Markov head also with W2 = 0 (the backbone's logits alone)."""
    import torch

    from dflash.core.loader import load_params
    from dflash.train.loop import Trainer

    same = [o for o in overrides if not o.startswith("train.epochs=")]  # every budget: params.yaml's epochs of anchors
    trainer = Trainer(load_params(params_file, [*same, f"train.out={out}"]), data / "eval")
    try:
        trainer.model.load_state_dict(drafter.state_dict(), strict=True)

        def accuracy() -> list[float]:
            correct = counted = 0
            for step in range(trainer.data.total_steps):
                m = trainer.compute_gradients(step)
                correct = correct + torch.tensor(m["correct"][1:], dtype=torch.float64)
                counted = counted + torch.tensor(m["counted"][1:], dtype=torch.float64)
            return (correct / counted.clamp(min=1)).tolist()

        result = {"tf_eval": accuracy(), "tf_eval_base": None}
        head = getattr(trainer.model, "markov_head", None)
        if head is not None:
            with torch.no_grad():
                head.markov_w2.weight.zero_()
            result["tf_eval_base"] = accuracy()
        return result
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------ one point


def point_overrides(args, budget: str, name: str, out: Path) -> list[str]:
    """The point's -S overrides: the data, its own out folder, its kind and loss; 4x: four times the epochs."""
    from dflash.core.loader import load_params

    overrides = [
        f"base.target_dir={args.target}",
        f"tokenize.out={args.data}",
        f"train.out={out}",
        f"train.live_dir={out / 'live'}",
        *MATCHED,
        *POINTS[name][0],
    ]
    if budget == "4x":
        overrides.append(f"train.epochs={4 * load_params(args.params, overrides).train.epochs}")
    return overrides


def reference_tau(params, drafter_dir: Path, temperatures: list[float]) -> dict:
    """The reference evaluator on the held-out prompts at each temperature: tau, expected tau, acceptance."""
    import torch

    from dflash.core.hf import load_target_model, load_tokenizer
    from dflash.core.target_config import resolve
    from dflash.drafter.export import load_drafter
    from dflash.eval.reference import reference_decode, summarize
    from dflash.eval.stage import load_prompts, split_by_length, stop_token_ids

    e = params.eval
    info = resolve(params.base.target_dir)
    tokenizer = load_tokenizer(info["model"], params.base.trust_remote_code, info.get("revision"))
    target = load_target_model(params.base.target_dir, torch.float32, "cpu", params.base.trust_remote_code)
    drafter, cfg = load_drafter(str(drafter_dir), target_config=target.config, device="cpu", dtype=torch.float32)
    drafter.eval()
    prompts, _ = split_by_length(load_prompts(Path(params.tokenize.out) / "eval", e.num_prompts), e, cfg.block_size)
    stops = stop_token_ids(info["model"], tokenizer)
    out = {}
    for temp in temperatures:
        results = [
            reference_decode(
                target, drafter, p["prompt_ids"], e.max_tokens, stops, temperature=temp, seed=params.base.seed + i
            )
            for i, p in enumerate(prompts)
        ]
        out[f"{temp:g}"] = summarize(results, cfg.block_size)
    return {"by_temperature": out, "num_prompts": len(prompts), "drafter": drafter}


def run_point(args, budget: str, name: str) -> dict:
    from dflash.core.loader import load_params
    from dflash.train.loop import train

    out = Path(args.out) / f"{budget}-{name}"
    done = out / "result.json"
    overrides = point_overrides(args, budget, name, out)
    if done.exists():
        print(f"{budget}-{name}: already ran (read back)", flush=True)
        result = json.loads(done.read_text())
        if "tf_eval" not in result:  # a point that ran before this measurement existed: add it
            from dflash.drafter.export import load_drafter

            t0 = time.time()
            drafter, _ = load_drafter(str(out / "drafter"))
            result.update(teacher_forced(args.params, overrides, drafter, Path(args.data), out / "tf-eval"))
            result["tf_eval_seconds"] = time.time() - t0
            done.write_text(json.dumps(result, indent=1))
        return result
    params = load_params(args.params, overrides)
    print(f"{budget}-{name}: training ({POINTS[name][1]})", flush=True)
    summary = train(params, Path(args.data) / "train")
    train_s = summary["steps_seconds"]  # every optimizer step of the run, a resumed one's earlier steps included
    if not summary["completed"]:
        raise SystemExit(f"{budget}-{name}: training stopped at step {summary['steps']} of {summary['total_steps']}")
    t0 = time.time()
    ref = reference_tau(params, out / "drafter", args.temperatures)
    eval_s = time.time() - t0
    drafter = ref.pop("drafter")
    t0 = time.time()
    tf = teacher_forced(args.params, overrides, drafter, Path(args.data), out / "tf-eval")
    tf_s = time.time() - t0
    result = {
        "budget": budget,
        "point": name,
        "overrides": POINTS[name][0],
        "steps": summary["steps"],
        "final_loss": summary["final_loss"],
        "acc_by_position": summary["final_accuracy_by_position"],
        "tau_hat": summary["final_tau_hat"],
        "drafter_params": summary["drafter_params"],
        "head_acc_train": head_accuracy(drafter, completion_pairs(Path(args.data) / "train")),
        "head_acc_eval": head_accuracy(drafter, completion_pairs(Path(args.data) / "eval")),
        **tf,
        **ref,
        "train_seconds": train_s,
        "tf_eval_seconds": tf_s,
        "eval_seconds": eval_s,
    }
    done.write_text(json.dumps(result, indent=1))
    print(f"{budget}-{name}: train {train_s:.0f} s, eval {eval_s:.0f} s", flush=True)
    return result


# ------------------------------------------------------------------------------------------ table


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(results: list[dict], counts: dict) -> str:
    lines = [
        f"Previous-token count table: train {counts['train']:.3f} ({counts['train_pairs']} pairs), held-out "
        f"{counts['eval']:.3f} ({counts['eval_pairs']} pairs).",
        "",
        "| budget | point | steps | tau T=0 | tau T=1 | exp. tau T=1 | tau_hat | acc 1..B-1 (teacher-forced) "
        "| head acc train / held-out | train s | eval s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t0, t1 = r["by_temperature"].get("0", {}), r["by_temperature"].get("1", {})
        acc = " ".join(f"{a:.2f}" for a in r["acc_by_position"])
        lines.append(
            f"| {r['budget']} | {r['point']} | {r['steps']} | {_f(t0.get('tau'))} | {_f(t1.get('tau'))} "
            f"| {_f(t1.get('expected_tau'))} | {_f(r['tau_hat'])} | {acc} "
            f"| {_f(r['head_acc_train'])} / {_f(r['head_acc_eval'])} | {r['train_seconds']:.0f} "
            f"| {r['eval_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target folder (base.target_dir)")
    parser.add_argument("--data", required=True, help="tokenize's output folder (train/ and eval/ shards)")
    parser.add_argument("--out", default="artifacts/dspark-ablation", help="one folder per point under it")
    parser.add_argument("--params", default=str(REPO / "params.yaml"))
    parser.add_argument("--budgets", nargs="+", default=["1x", "4x"], choices=["1x", "4x"])
    parser.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    parser.add_argument("--points-4x", nargs="+", default=None, help="points at 4x (default: --points)")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--report", default=None, help="write the table as markdown here")
    args = parser.parse_args(argv)
    args.target, args.data = str(Path(args.target).resolve()), str(Path(args.data).resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    counts_path = Path(args.out) / COUNT_TABLE
    if not counts_path.exists():
        counts_path.write_text(json.dumps(count_table(Path(args.data)), indent=1))
    counts = json.loads(counts_path.read_text())
    results = []
    for budget in args.budgets:
        names = args.points_4x if budget == "4x" and args.points_4x else args.points
        results += [run_point(args, budget, name) for name in names]
    text = table(results, counts)
    print(text)
    if args.report:
        Path(args.report).write_text(text)


if __name__ == "__main__":
    main()
