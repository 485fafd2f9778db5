"""Engine-code parity: the reference's drafting (dflash/eval/reference.py over dflash/drafter/) against vLLM 0.32's
own speculator code, its Triton kernels run on CPU by Triton's interpreter (tests/integration/test_engine_parity.py).

triton_env.py   Triton 3.9 in its own folder (build/triton, installed from PyPI when missing) and the interpreter set-up
                that lets vLLM's kernels load and run on CPU tensors;
harness.py      the runnable comparison (one subprocess per kind, Triton on its path only there): vLLM's
                DFlash2Speculator / DSparkSpeculator methods over vLLM's model classes loaded from our export, against
                the reference decode, as JSON.

May import dflash, tests.helpers, tests.integration.test_vllm_kinds (vLLM's module classes on our export), torch,
vllm, and triton (harness.py only, inside its subprocess).
"""
