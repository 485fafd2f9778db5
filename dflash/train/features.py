"""Online target features: load the target once, run it without grad, keep only the layers the drafter reads.

The target is any transformers causal LM (`AutoModelForCausalLM`; Qwen3, and the Qwen3.5/3.6 hybrids whose
config nests the text model under `text_config`: transformers loads their text part). Eval mode, no grad,
bf16 on GPU / fp32 on CPU (dflash/train/loop.py chooses). Forward hooks on the decoder layers named in target_layer_ids
keep each one's output (= HF `hidden_states[id + 1]`, docs/design/drafter.md); the hook on the deepest needed
layer then stops the forward, so the remaining layers, the final norm and the lm_head never run. The loss targets
that learn the target's own predictions (`train.loss_target: target_argmax | target_kl`) also need the final
hidden state (the last layer after the final norm): then the whole decoder runs (never its lm_head: the loss makes
target logits only for the rows the blocks need, dflash/train/loss.py). The
embedding and the lm_head are the target's own modules (get_input_embeddings / get_output_embeddings),
shared frozen with the drafter.

Each document runs as its own sequence (positions from 0, as at inference; linear-attention state never
leaks between packed documents). Documents are sorted by length and batched right-padded up to
`batch_tokens` padded tokens per forward: right padding leaves the real tokens' states untouched in both
softmax and linear-attention layers.

Also here: the target's identity for the checkpoint hash. Loading the target (its config, tokenizer and
weights) is dflash/core/hf.py's job.

Legend: S tokens of a micro-step (concatenated documents), K features, H hidden size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.core.errors import UserError
from dflash.core.io import file_sha256
from dflash.core.target_config import resolve

log = logging.getLogger(__name__)


class _Stop(Exception):
    """Raised by the deepest hook: the rest of the target is not needed."""


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The text decoder's layer list: the ModuleList of `num_layers` whose name ends in `layers` (not a vision tower)."""
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == num_layers
        and name.split(".")[-1] == "layers"
        and not any(p in name for p in ("visual", "vision", "mtp"))
    ]
    if len(found) != 1:
        names = [n for n, _ in found]
        raise UserError(
            f"cannot find the target's {num_layers} decoder layers (candidates: {names}); this architecture is "
            "not supported by the online feature hooks"
        )
    return found[0][1]


def target_identity(target_dir: str, config: Any) -> dict:
    """What identifies the target's weights for the checkpoint hash: target.json, config, weight files
    (sha256 when they total <= 2 GB, e.g. the demo's tiny target; names and sizes beyond)."""
    info = resolve(target_dir)
    cfg = config if isinstance(config, dict) else config.to_dict()
    ident: dict[str, Any] = {"target": {k: v for k, v in info.items() if k != "model"}, "config": cfg}
    folder = Path(info["model"])
    if folder.is_dir():
        files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
        small = sum(f.stat().st_size for f in files) <= 2 << 30
        ident["weights"] = [[f.name, file_sha256(f) if small else f.stat().st_size] for f in files]
    else:
        ident["model"] = info["model"]
    return ident


class TargetFeatures:
    """Callable: (input_ids (S,), doc_starts, doc_lengths) -> features (S, K*H) on the target's device, and with
    `final` also the final hidden states (S, H)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], num_layers: int, batch_tokens: int, final: bool = False):
        self.model, self.layer_ids, self.batch_tokens, self.final = model, list(layer_ids), batch_tokens, final
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self.device = next(model.parameters()).device
        self._out: dict[int, torch.Tensor] = {}
        self._active = False  # hooks act only inside run(): other callers see the plain model
        layers = decoder_layers(model, num_layers)
        deepest = max(self.layer_ids)
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._hook(i, stop=i == deepest and not final))

    def _hook(self, i: int, stop: bool) -> Callable:
        def hook(_module: torch.nn.Module, _args: tuple, output: Any) -> Any:
            if not self._active:
                return
            self._out[i] = output[0] if isinstance(output, tuple) else output
            if stop:
                raise _Stop

        return hook

    @torch.no_grad()
    def run(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(b, T) ids -> features (b, T, K*H), layers in target_layer_ids order, and the final hidden states
        (b, T, H) when `final` (else None)."""
        self._out.clear()
        self._active = True
        last = None
        try:
            out = self.decoder(input_ids=ids, attention_mask=attention_mask, use_cache=False)
            last = out.last_hidden_state if self.final else None
        except _Stop:
            pass
        finally:
            self._active = False
        if len(self._out) != len(self.layer_ids) or (self.final and last is None):  # pragma: no cover
            raise RuntimeError("the target's forward never reached its deepest feature layer")
        return torch.cat([self._out[i] for i in self.layer_ids], dim=-1), last

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, doc_starts: list[int], doc_lengths: list[int]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ids = input_ids.to(self.device)
        out = final = None
        order = sorted(range(len(doc_lengths)), key=lambda d: (-doc_lengths[d], d))
        i = 0
        while i < len(order):
            longest = doc_lengths[order[i]]  # documents come longest first: the group's padded width
            group = order[i : i + max(1, self.batch_tokens // max(1, longest))]
            i += len(group)
            batch = torch.zeros(len(group), longest, dtype=torch.long, device=self.device)
            mask = torch.zeros(len(group), longest, dtype=torch.long, device=self.device)
            for r, d in enumerate(group):
                s, n = doc_starts[d], doc_lengths[d]
                batch[r, :n] = ids[s : s + n]
                mask[r, :n] = 1
            feats, last = self.run(batch, None if len(group) == 1 else mask)  # (b, T, K*H), (b, T, H) | None
            if out is None:
                out = feats.new_empty(ids.shape[0], feats.shape[-1])
                final = last.new_empty(ids.shape[0], last.shape[-1]) if last is not None else None
            for r, d in enumerate(group):
                s, n = doc_starts[d], doc_lengths[d]
                out[s : s + n] = feats[r, :n]
                if final is not None:
                    final[s : s + n] = last[r, :n]
        assert out is not None, "a micro-step has at least one document"
        return (out, final) if self.final else out
