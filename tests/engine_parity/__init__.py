"""Engine-code parity: the reference's drafting (dflash/eval/reference.py over dflash/drafter/) against vLLM 0.32's
own speculator code, its Triton kernels run on CPU by Triton's interpreter (tests/integration/test_engine_parity.py).

triton_env.py   Triton 3.9 in its own folder (build/triton, installed from PyPI when missing) and the interpreter set-up
                that lets vLLM's kernels load and run on CPU tensors;
kinds.py        per kind: vLLM's speculator class, query layout, method, our head, the speculator fields to set, what
                runs before each draft (LiLiCorr: vLLM's prepare_context_anchor), how the trained head is fitted;
noise.py        vLLM's drafting Gumbel noise through vLLM's own Triton helpers (keys the reference's draws at T > 0);
verify.py       vLLM's greedy rejection_sample on the blocks the engine run verified (accepted lengths at T 0), and
                the target's latest pass (what LiLiCorr's anchor is made from);
mask_repro.py   the minimal reproduction of the interpreter's mask bug;
harness.py      the runnable comparison (one subprocess for the kinds, Triton on its path only there): vLLM's
                DFlash2Speculator / DSparkSpeculator / LiLiCorrSpeculator methods over vLLM's model classes loaded
                from our export, against the reference decode, as JSON.

May import dflash (kinds.py also dflash.train's LiLiCorr loss, to fit the trained correlator), tests.helpers,
tests.integration.test_vllm_kinds (vLLM's module classes on our export), torch, vllm, and triton (harness.py,
noise.py, verify.py, mask_repro.py: inside the harness subprocess only).
"""
