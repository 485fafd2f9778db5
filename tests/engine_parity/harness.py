"""Engine-code parity harness: the reference's drafting against vLLM 0.32's own speculator code, on CPU.

Purpose: decode the same prompts twice with dflash.eval.reference.reference_decode, once proposing with the
reference's `propose` (dflash/drafter/dflash2.py selector_walk, dflash/drafter/dspark.py markov_walk,
dflash/drafter/lilicorr.py lattice_walk) and once with vLLM's speculator object (DFlash2Speculator._generate_draft
with CandidateSampler's Triton walk and cache kernels; DSparkSpeculator._generate_draft with its Markov loop and
gumbel_sample kernel; LiLiCorrSpeculator._generate_draft, DFlash2's walk over its correlator's scores, after its
prepare_context_anchor) over vLLM's model classes loaded from our export, and report both runs' drafted tokens per
cycle, accepted lengths and committed tokens.
What is shared: the target, the drafter's backbone hidden states (our DraftSession stands in for vLLM's
`_run_model`, the attention forward the V2 runner would run on a GPU) and the verification. What is vLLM's: the
heads as vLLM's classes hold them, the candidate walk, the Markov loop, LiLiCorr's anchor (its fc and hidden_norm of
the verify pass's last kept row), the sampling and the draft-logit cache.
At temperature > 0 the reference's draws are keyed by vLLM's Gumbel noise (noise.py: same seed, same position,
same noise per token id), so a drafted token can be compared with vLLM's one for one; the reference's own
rejection sampling then verifies both runs' drafts against their draft logits (equal draft logits and drafts
give equal accepted lengths; different ones do not).
Mutation check: `mutate` changes one drafted token of the reference's run (cycle, slot); the comparison must fail.

Inputs: --kind (one or more of dflash2, dspark, lilicorr: all in one process, vLLM imported and the target built
once), --out JSON path. Drafters: "random" (every weight N(0, 0.5), as tests/integration/test_vllm_kinds.py builds
them) and "trained" (the backbone fitted to the target's greedy continuations, the kind's heads perturbed so they
still change drafts; LiLiCorr's correlator then fitted by its own loss, kinds.py).
Output: JSON {"seconds", "interpreter_mask_bug", "kinds": {kind: {"seconds", "runs": [{drafter, temperature, seed,
reference, engine, mutated, max_draft_logit_diff, not_argmax}]}}} where reference / engine / mutated hold per prompt
the cycles' drafts, accepted lengths, accepted_per_pos, tokens.
Command (what tests/integration/test_engine_parity.py runs; Triton in build/triton, see triton_env.py):
    PYTHONPATH=build/triton:. TRITON_INTERPRET=1 .venv/bin/python -m tests.engine_parity.harness \
        --kind dflash2 dspark lilicorr --out /tmp/parity.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from tests.engine_parity import mask_repro
from tests.engine_parity.triton_env import enable_interpreter

MASK_BUG = mask_repro.run()  # before the fix: the interpreter's own behaviour, reported as found
enable_interpreter()

import torch  # noqa: E402

from dflash.eval import reference  # noqa: E402
from tests.engine_parity.kinds import ENGINE_KINDS  # noqa: E402
from tests.engine_parity.noise import draft_noise  # noqa: E402
from tests.engine_parity.verify import recording_blocks, vllm_greedy_accepted  # noqa: E402

TEMPERATURES = (0.0, 1.0)
SEED = 7
MAX_TOKENS = 24
PROMPTS = 3  # the trained drafter is fitted on the first two: full accepts there, rejections on the third


@dataclass
class Decode:
    """One prompt's decode as the comparison reads it."""

    cycles: list[list[int]] = field(default_factory=list)  # the drafted tokens of each verification cycle
    accepted_per_pos: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # each cycle's accepted length by the reference's verification
    vllm_accepted: list[int] | None = None  # engine run, T 0: the same cycles' by vLLM's rejection_sample


@dataclass
class Run:
    drafter: str
    temperature: float
    seed: int
    reference: list[Decode]
    engine: list[Decode]
    mutated: list[Decode]
    max_draft_logit_diff: float | None  # T > 0: the largest |reference - vLLM| over the finite draft logits
    not_argmax: int  # cycles whose vLLM drafts differ from each slot's lm_head argmax (the kind's head at work)


class EngineProposer:
    """vLLM's speculator object for one request, its buffers laid out as the V2 runner fills them
    (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py DFlashSpeculator.__init__ / prepare inputs; int64
    sample_pos and idx_mapping, int32 input ids, float32 temperature, int64 seeds, a float32 -inf draft-logit cache
    when sampling), `_run_model` answering with our backbone's hidden states. Persistent across cycles, as in
    the engine (DFlash2's cache kernel clears the previous cycle's candidates)."""

    def __init__(self, kind: str, model, cfg, temperature: float, seed: int):
        spec = ENGINE_KINDS[kind]
        n = cfg.block_size - 1
        cls = spec.speculator_class()
        s = cls.__new__(cls)  # no __init__: it builds the V2 runner's GPU state; the fields _generate_draft reads:
        s.model, s.num_speculative_steps, s.vocab_size = model, n, cfg.vocab_size
        s.temperature = torch.tensor([temperature], dtype=torch.float32)
        s.seeds = torch.tensor([seed], dtype=torch.int64)
        s.sample_idx_mapping = torch.zeros(n, dtype=torch.int64)
        s.draft_tokens = torch.zeros(1, n, dtype=torch.int64)
        s.draft_logits = None if temperature == 0 else torch.full((1, n, cfg.vocab_size), float("-inf"))
        s.use_fp64_gumbel, s.enable_adaptive_verification = False, False
        s.acceptance_estimator, s.draft_watermarker = None, None
        s.num_query_per_req = 1 + n if spec.fill_in else n  # [bonus, mask x N] | [anchor, mask x N-1]
        s.sample_indices = torch.arange(s.num_query_per_req)[spec.sampled_rows]
        s.input_buffers = SimpleNamespace(input_ids=torch.zeros(s.num_query_per_req, dtype=torch.int32))
        spec.setup(s, cfg, n)
        self.spec, self.s, self.n, self.mask = spec, s, n, cfg.mask_token_id
        self.not_argmax = 0

    def __call__(self, session, bonus: int, start: int, lm_head, choose, verified):
        """reference.propose's arguments, and `verified` (verify.Blocks): the target's latest pass."""
        s = self.s
        hidden = session.draft_hidden(bonus, start)
        s.input_buffers.input_ids.fill_(self.mask)
        s.input_buffers.input_ids[0] = bonus
        s.sample_pos = torch.arange(start + 1, start + 1 + self.n, dtype=torch.int64)  # the predicted positions
        s._run_model = lambda *args, **kwargs: hidden
        with torch.no_grad():
            if self.spec.before_draft is not None:
                self.spec.before_draft(s, verified)
            s._generate_draft(1, hidden.shape[0], None, None, None)
        drafts = s.draft_tokens[0].tolist()
        self.not_argmax += drafts != lm_head(hidden[self.spec.sampled_rows]).argmax(-1).tolist()
        return drafts, (None if s.draft_logits is None else s.draft_logits[0].clone())


def keyed_choose(temperature: float, seed: int, start: int, keys: torch.Tensor):
    """The reference's `choose` at temperature > 0, drawing by vLLM's Gumbel noise: slot j's draw is keyed by
    position start + j (the predicted token's position - 1) and by the token ids keys[j] its row scores."""
    t = torch.tensor(temperature, dtype=torch.float32)
    noise = draft_noise(seed, torch.arange(start, start + keys.shape[0]), keys)

    def choose(row: torch.Tensor, j: int) -> int:
        return int((row.float() / t + noise[j]).argmax())

    return choose


def reference_proposer(kind: str, cfg, temperature: float, seed: int):
    """The reference's own `propose`, its draws keyed as vLLM keys them (module docstring)."""
    original = reference.propose

    def propose(session, bonus, start, lm_head, choose, _verified=None):
        if choose is None:
            return original(session, bonus, start, lm_head, None)
        spec = ENGINE_KINDS[kind]
        if spec.candidate_top_k is not None:  # the walk scores slot j's top-K candidates: their ids key the noise
            logits = lm_head(session.draft_hidden(bonus, start)[spec.sampled_rows]).float()
            keys = torch.topk(logits, spec.candidate_top_k(cfg), dim=-1).indices
        else:  # full-vocabulary rows
            keys = torch.arange(cfg.vocab_size).expand(cfg.block_size - 1, -1)
        return original(session, bonus, start, lm_head, keyed_choose(temperature, seed, start, keys))

    return propose


def _decode(target, drafter, prompts, temperature: float, propose, mutate=None, vllm_verify=False):
    """reference_decode of every prompt with `propose` in place of the reference's -> (a Decode per prompt, every
    cycle's draft logits (None at temperature 0)); `mutate` (cycle, slot): that drafted token + 1 (mod V) in every
    prompt, the mutation check; `vllm_verify`: also each cycle's accepted length by vLLM's greedy rejection
    sampling (verify.py)."""
    decodes, draft_logits = [], []
    for p, prompt in enumerate(prompts):
        record = Decode()

        def recording(*args, record=record):
            drafts, q = propose(*args, blocks)
            if mutate is not None and len(record.cycles) == mutate[0]:
                drafts = list(drafts)
                drafts[mutate[1]] = (drafts[mutate[1]] + 1) % drafter.config.vocab_size
            record.cycles.append(list(drafts))
            draft_logits.append(q)
            return drafts, q

        reference.propose = recording
        try:
            with recording_blocks() as blocks:
                r = reference.reference_decode(
                    target, drafter, prompt, MAX_TOKENS, temperature=temperature, seed=SEED + p
                )
        finally:
            reference.propose = ORIGINAL_PROPOSE
        record.accepted_per_pos, record.tokens = r.accepted_per_pos, r.tokens
        record.accepted = [k - 1 for k in blocks.kept]
        if vllm_verify:
            record.vllm_accepted = vllm_greedy_accepted(blocks, SEED + p)
        decodes.append(record)
    return decodes, draft_logits


ORIGINAL_PROPOSE = reference.propose


def _max_diff(a: list, b: list) -> float | None:
    """The largest |a - b| over the finite draft logits of the same cycles (inf where their supports differ); when
    the runs diverge, over the cycles both made (the drafts' comparison reports the divergence)."""
    diffs = []
    for qa, qb in zip(a, b, strict=False):
        if qa is None or qb is None:
            continue
        finite = torch.isfinite(qa)
        if not torch.equal(finite, torch.isfinite(qb)):
            return float("inf")
        diffs.append(float((qa[finite] - qb[finite]).abs().max()) if finite.any() else 0.0)
    return max(diffs) if diffs else None


def compare(kind: str, label: str, cfg, target, ours, vllm_model, prompts) -> list[Run]:
    runs = []
    for temperature in TEMPERATURES:
        ref, ref_q = _decode(target, ours, prompts, temperature, reference_proposer(kind, cfg, temperature, SEED))
        engine = EngineProposer(kind, vllm_model, cfg, temperature, SEED)
        eng, eng_q = _decode(target, ours, prompts, temperature, engine, vllm_verify=temperature == 0)
        mutated, _ = _decode(
            target, ours, prompts, temperature, reference_proposer(kind, cfg, temperature, SEED), (1, 1)
        )
        diff = None if temperature == 0 else _max_diff(ref_q, eng_q)
        runs.append(Run(label, temperature, SEED, ref, eng, mutated, diff, engine.not_argmax))
    return runs


# ------------------------------------------------------------------------------------------ the drafters


def _target(folder: Path):
    """The small Qwen3 target test_vllm_kinds.py builds (saved for vLLM's ModelConfig), and vLLM's one-process
    distributed state (its linear layers ask for the tensor-parallel group)."""
    from transformers import Qwen3ForCausalLM
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from tests.helpers.models import small_qwen3_config
    from tests.helpers.train import free_port
    from tests.integration.test_vllm_kinds import HIDDEN, VOCAB

    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    torch.manual_seed(0)
    config = small_qwen3_config(4, vocab=VOCAB, hidden=HIDDEN, max_position_embeddings=512, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(config).eval()
    target.save_pretrained(folder)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0, backend="gloo"
        )
        parallel_state.initialize_model_parallel(1, 1)
    return target


@dataclass
class Fitting:
    """One prompt's fitting data: the target's greedy continuation of it and what the drafter's losses read."""

    ids: torch.Tensor  # (S,) the prompt + the target's greedy continuation
    features: torch.Tensor  # (S, K*H) the target's features
    final: torch.Tensor  # (S, H) the target's last hidden states (after its norm: lm_head gives its logits)
    anchors: torch.Tensor  # (N,) every anchor whose block lies inside the continuation
    blocks: torch.Tensor  # (N * slots, H) the blocks' input embeddings
    labels: torch.Tensor  # (N, slots) the tokens the blocks' query slots draft


def fitting_data(kind: str, cfg, target, prompts) -> list[Fitting]:
    """Slot rows of every anchor against the tokens they draft (dspark: query slot j after anchor a drafts a+1+j;
    dflash2, lilicorr: slot j >= 1 drafts a+j), on the target's greedy continuations."""
    from dflash.drafter.model import block_input_ids, context_features

    embed = target.get_input_embeddings()
    first = 0 if ENGINE_KINDS[kind].fill_in else 1  # the label of query slot 0
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor(prompt + reference.greedy_decode(target, prompt, MAX_TOKENS + 8))
            states = target(ids[None], output_hidden_states=True).hidden_states
            feats = context_features(states, cfg.target_layer_ids)[0]
            anchors = torch.arange(len(prompt) - 1, len(ids) - cfg.block_size)
            blocks = embed(block_input_ids(ids, anchors, cfg.query_slots, cfg.mask_token_id))
            labels = torch.stack([ids[a + first : a + first + cfg.query_slots] for a in anchors])
            out.append(Fitting(ids, feats, states[-1][0], anchors, blocks, labels))
    return out


def _fit_backbone(kind: str, cfg, model, target, data: list[Fitting]) -> None:
    """A few Adam steps (the kind's backbone_steps) of cross-entropy on the target's greedy continuations
    (fitting_data)."""
    head = target.get_output_embeddings()
    keep = ENGINE_KINDS[kind].sampled_rows
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(ENGINE_KINDS[kind].backbone_steps):
        loss = 0.0
        for d in data:
            hidden = model(d.features, d.blocks, d.anchors).view(len(d.anchors), cfg.query_slots, -1)[:, keep]
            loss = loss + torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), d.labels[:, keep].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def drafters(kind: str, target, prompts, work: Path):
    """(label, cfg, our drafter, vLLM's module class loaded from its export) for the random and trained drafter."""
    from dflash.drafter.export import save_drafter
    from tests.integration.test_vllm_kinds import _load, _ours, _vllm

    spec = ENGINE_KINDS[kind]
    out = []
    for label in ("random", "trained"):
        cfg, ours = _ours(kind, **spec.drafter_changes)
        if label == "trained":
            torch.manual_seed(2)
            for p in ours.parameters():
                p.data.normal_(0, 0.05)
            data = fitting_data(kind, cfg, target, prompts[:2])
            _fit_backbone(kind, cfg, ours, target, data)
            heads = getattr(ours, spec.head)
            with torch.no_grad():  # the kind's heads matter (a zero Markov bias would leave DSpark's walk argmax)
                for p in heads.parameters():
                    p.normal_(0, 0.25)
            if spec.fit_head is not None:
                spec.fit_head(cfg, ours, target, data)
        folder = save_drafter(ours, cfg, work / f"{kind}-{label}")
        num_steps = cfg.block_size - 1 if spec.fill_in else None  # DSpark: vLLM reads it from our config
        model, _ = _vllm(work / "target", folder, spec.method, num_steps)
        _load(model, folder)
        with torch.no_grad():  # vLLM shares the target's lm_head and embedding at load time
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
            model.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        out.append((label, cfg, ours.eval(), model.eval()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", nargs="+", choices=sorted(ENGINE_KINDS), required=True, help="one or more kinds")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: beside --out)")
    args = ap.parse_args(argv)
    began = time.monotonic()
    work = args.work or args.out.parent / "parity"
    (work / "target").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    target = _target(work / "target")  # one process for every kind: vLLM's import and the target once
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(5, 9))] for _ in range(PROMPTS)]
    kinds = {}
    for kind in args.kind:
        kind_began, runs = time.monotonic(), []
        for label, cfg, ours, model in drafters(kind, target, prompts, work):
            runs += compare(kind, label, cfg, target, ours, model, prompts)
        kinds[kind] = {"seconds": round(time.monotonic() - kind_began, 1), "runs": [asdict(r) for r in runs]}
    report = {"seconds": round(time.monotonic() - began, 1), "interpreter_mask_bug": MASK_BUG, "kinds": kinds}
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
