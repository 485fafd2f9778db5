"""Check: vLLM serves our DSpark and DFlash2 exports (CUDA, its V2 model runner) and accepts what the reference
evaluator accepts. One step of benchmarks/gpu_check.sh (`serve`).

For each kind (default dspark and dflash2): a tiny random Qwen3 target (saved without a tokenizer: prompts are
token ids), its own greedy continuations of a few random prompts, a 1-layer drafter of that kind over-fitted on
them with the kind's training loss (dflash/train/loss_dspark.py / loss_dflash2.py, the trainer's), exported in
vLLM's format. Then, on the same prompts at temperature 0 with the same output budget:
  reference   dflash/eval/reference.py (the kind's walk as vLLM drafts it), in the engine's dtype
  vllm        LLM(speculative_config={"method": "dspark" | "dflash", ...}) with VLLM_USE_V2_MODEL_RUNNER=1, each
              kind's engine in its own spawned process (both at once), counters diffed around the run
Figures per kind: tau and drafts / accepted per position of both, the relative gap, whether the counts are equal,
and the share of outputs equal to the target's greedy decode. The check passes when every kind's vLLM tau is
within --max-gap of the reference's (bf16 on a GPU: near-tied logits may flip a token, so equality is not
demanded) and every output equals greedy. Without CUDA (or with --smoke) the engine part is skipped and the rest
runs small: the code path of everything but vLLM.

    python benchmarks/successors_serve.py --device cuda --json OUT/serve.json
    python benchmarks/successors_serve.py --device cpu --smoke --json /tmp/serve.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash.drafter.kinds import KINDS  # noqa: E402

VOCAB, HIDDEN, LAYERS = 1024, 256, 4


def _target(folder: Path, device: str, dtype):
    """A tiny random Qwen3 saved to `folder` (what vLLM loads) and loaded back for the reference."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def _sequences(target, prompts: list[list[int]], length: int) -> list[tuple]:
    """(ids (S,), prompt length) with the target's own argmax continuation (what greedy speculation must keep)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            seq = torch.tensor(p, device=target.device)
            for _ in range(length):
                seq = torch.cat([seq, target(seq[None]).logits[0, -1].argmax().view(1)])
            out.append((seq, len(p)))
    return out


def _overfit(cfg, target, sequences, steps: int):
    """The kind's training loss (the trainer's: dflash/train/micro.py micro_loss) on every completion anchor."""
    import torch

    from dflash.core.loader import load_params
    from dflash.drafter.build import build_drafter
    from dflash.drafter.model import block_input_ids, block_labels
    from dflash.train.loss import LMHead, normaliser_share, slot_weights
    from dflash.train.loss_dspark import explicit_rows
    from dflash.train.micro import MicroBatch, micro_loss

    tp = load_params(REPO / "params.yaml").train
    dev = target.device
    torch.manual_seed(0)
    model = build_drafter(cfg, device=dev)
    head = LMHead.from_linear(target.get_output_embeddings(), dev)
    slot_w = slot_weights(cfg.block_size, tp.loss_gamma).to(dev)
    batches = []
    with torch.no_grad():
        for ids, n in sequences:
            out = target(ids[None], output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1][0] for i in cfg.target_layer_ids], -1).float()
            final = target.model(ids[None]).last_hidden_state[0].float()
            mask = torch.arange(len(ids), device=dev) >= n
            anchors = torch.arange(n - 1, len(ids) - 1, device=dev)
            labels, valid = block_labels(ids, mask, anchors, cfg.block_size)
            embeds = target.get_input_embeddings()(block_input_ids(ids, anchors, cfg.query_slots, cfg.mask_token_id))
            m = MicroBatch(0, None, ids, torch.zeros_like(ids), anchors, labels, valid)
            batches.append((feats, embeds.float(), m, final))
    if model.label_row_weight() is not None:  # DSpark: zero lm_head rows that are labels get their own W2 row
        head = explicit_rows(head, torch.cat([b[2].labels for b in batches]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        for feats, embeds, m, final in batches:
            hidden = model(feats, embeds, m.anchors)
            norm = normaliser_share(m.valid, slot_w)
            out = micro_loss(
                model,
                hidden,
                m,
                head=head,
                slot_w=slot_w,
                normaliser=norm,
                chunk_rows=4096,
                tp=tp,
                final=final,
                embed=target.get_input_embeddings(),  # embed + features: lilicorr
                features=feats,
            )
            out.loss.backward()
        opt.step()
    return model.eval()


def _engine(target_dir: str, drafter_dir: str, method: str, spec_tokens: int, dtype: str, prompts, max_tokens, queue):
    """In a spawned process: one vLLM engine serving the drafter; puts counters and tokens on `queue`."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # DSpark and DFlash2 exist only in the V2 model runner
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from dflash.eval.engines import acceptance, read_counters

        llm = LLM(
            model=target_dir,
            skip_tokenizer_init=True,
            speculative_config={"method": method, "model": drafter_dir, "num_speculative_tokens": spec_tokens},
            dtype=dtype,
            enforce_eager=True,
            max_model_len=512,
            gpu_memory_utilization=0.2,
            kv_cache_memory_bytes=1 << 30,
            disable_log_stats=False,
            seed=0,
        )
        before = read_counters(llm.get_metrics())
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling)
        counters = acceptance(before, read_counters(llm.get_metrics()))
        queue.put(("ok", {"counters": counters, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
    except BaseException as exc:  # reported in the JSON, the other kinds still run
        queue.put(("error", f"{type(exc).__name__}: {exc}"[:400]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    v2_only = [name for name, spec in KINDS.items() if not spec.v1_runner]  # dspark, dflash2: what this checks
    ap.add_argument("--kinds", nargs="+", default=v2_only, choices=list(KINDS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=300, help="over-fitting steps per drafter")
    ap.add_argument("--max-gap", type=float, default=0.05, help="largest |tau_vllm / tau_reference - 1| that passes")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and no engine: the code path on CPU")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    import torch

    from dflash.core.loader import load_params
    from dflash.drafter.export import save_drafter
    from dflash.drafter.geometry import build_drafter_config
    from dflash.eval.reference import greedy_decode, reference_decode, summarize

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    serve = cuda and not args.smoke
    if args.smoke:
        args.prompts, args.max_tokens, args.steps = 2, 12, 20
    dtype_name = "bfloat16" if cuda else "float32"
    dtype = getattr(torch, dtype_name)
    device = args.device if cuda else "cpu"
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="successors-serve-"))
    target = _target(root / "target", device, torch.float32)  # trained against in fp32, served in dtype
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()]
    prompts += [torch.randint(0, VOCAB - 1, (10,), generator=g).tolist() for _ in range(args.prompts - 1)]
    sequences = _sequences(target, prompts, args.max_tokens + 4)
    base = load_params(REPO / "params.yaml").drafter
    result: dict = {"device": device, "dtype": dtype_name, "served": serve, "kinds": {}}
    folders = {}
    for kind in args.kinds:
        d = dataclasses.replace(
            base,
            kind=kind,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            block_size=4,
            mask_token_id=VOCAB - 1,
            target_layer_ids=[0, 2],
            max_position_embeddings=1024,
            draft_vocab_size=0,  # the whole vocabulary: the V2-only kinds have no pruned path
            dspark=dataclasses.replace(base.dspark, markov_rank=16),
            dflash2=dataclasses.replace(base.dflash2, selector_rank=16, selector_top_k=8),
        )
        cfg = build_drafter_config(d, target.config)
        drafter = _overfit(cfg, target, sequences, args.steps)
        folders[kind] = str(save_drafter(drafter.to(dtype), cfg, root / kind))
        served_target = target.to(dtype)
        refs = [reference_decode(served_target, drafter, p, args.max_tokens) for p in prompts]
        greedy = [greedy_decode(served_target, p, args.max_tokens) for p in prompts]
        target = target.float()
        result["kinds"][kind] = {
            "reference": summarize(refs, cfg.block_size),
            "reference_equals_greedy": [r.tokens for r in refs] == greedy,
            "greedy": greedy,
        }
    if serve:  # every kind's engine at once, each in its own process
        ctx = mp.get_context("spawn")
        queues, procs = {}, {}
        for kind in args.kinds:
            queues[kind] = ctx.Queue()
            method = KINDS[kind].vllm_method
            a = (str(root / "target"), folders[kind], method, 3, dtype_name, prompts, args.max_tokens, queues[kind])
            procs[kind] = ctx.Process(target=_engine, args=a)
            procs[kind].start()
        for kind in args.kinds:
            status, payload = queues[kind].get(timeout=600)
            procs[kind].join(timeout=60)
            row = result["kinds"][kind]
            if status != "ok":
                row["vllm_error"] = payload
                continue
            ref, c = row["reference"], payload["counters"]
            row["vllm"] = c
            row["gap"] = (c["tau"] / ref["tau"] - 1) if c["tau"] and ref["tau"] else None
            row["counts_equal"] = (c["num_drafts"], c["num_accepted_tokens_per_pos"]) == (
                ref["num_drafts"],
                ref["num_accepted_tokens_per_pos"],
            )
            row["vllm_greedy_identical_frac"] = sum(
                a == b for a, b in zip(payload["tokens"], row["greedy"], strict=True)
            ) / len(prompts)
    for row in result["kinds"].values():
        del row["greedy"]
    rows = result["kinds"].values()
    if serve:
        result["ok"] = all(
            "vllm" in r
            and r["gap"] is not None
            and abs(r["gap"]) <= args.max_gap
            and r["vllm_greedy_identical_frac"] == 1
            for r in rows
        )
    else:
        result["ok"] = all(r["reference_equals_greedy"] for r in rows)
    result["max_gap"] = args.max_gap
    result["seconds"] = time.time() - t0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for kind, r in result["kinds"].items():
        v = r.get("vllm") or {}
        print(
            f"{kind}: reference tau {r['reference']['tau']:.3f}, vLLM tau "
            f"{v.get('tau') if v else r.get('vllm_error', 'not served here')}, counts equal {r.get('counts_equal')}"
        )
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
