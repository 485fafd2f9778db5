"""The DFlash drafter, from its geometry to the checkpoint that serving engines load.

  geometry.py   DrafterConfig from params + the target, the one validator, parameter counts (torch-free)
  flops.py      FLOPs of training on one document: target forward + drafter + frozen lm_head (torch-free)
  layers.py     RMSNorm, full-head RoPE, KV-injection attention (sdpa | flex), SwiGLU, decoder layer
  masks.py      the anchor-block attention rule: flex BlockMask, dense SDPA mask, naive reference
  model.py      DFlashDrafter (training forward), block inputs and labels, target feature concat
  session.py    DraftSession: cached context K/V and one drafter pass per block (inference)
  export.py     z-lab native checkpoint save / load (config.json + body-only safetensors)
  dspark.py     DSparkDrafter: Markov head + confidence head on the DFlash backbone, the Markov walk
  dflash2.py    DFlash2Drafter: grouped causal convs + candidate selector, the selector walk
  lilicorr.py   LiLiCorrDrafter: candidate-lattice correlator (+ optional convs), the lattice walk
  lilicorr_spec.py  LiLiCorr's geometry checks, counts and export keys / tensor names (torch-free)
  kinds.py      the registry: one KindSpec per drafter.kind, the one place that names the kinds (torch-free)
  build.py      build_drafter for every drafter.kind (imports every kind's module)
  vocab.py      the pruned draft vocabulary: build rule, d2t / t2d tables, coverage (torch-free)
  draft_head.py DraftHead: the drafter's own lm_head over that vocabulary (training, export, reference)

May import: dflash.core. geometry.py, kinds.py, lilicorr_spec.py, vocab.py and flops.py import no torch (the plan stage uses them).
"""
