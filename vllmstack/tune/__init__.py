"""Tuned Triton kernel configs (`invoke tune`): the shapes a profile makes vLLM look up, the search
space, the numeric gate and the keep rule, the GPU-side measuring script, and the files it writes
into fused_moe_configs/ and fp8_configs/ with their sidecars.

  shapes.py        the (E, N) / (N, K) shapes and file names exactly as vLLM keys its lookup
  space.py         the explicit, pruned search space per batch size (and the scale-group rule)
  verdict.py       the numeric gate, the keep rule, the budget: pure logic, tested on the CPU
  kernel_bench.py  runs where the engine runs (python -m vllmstack.tune.kernel_bench): imports
                   vLLM's Triton kernels, gates and times candidates, prints one JSON result
  tuning.py        `invoke tune`: the spec, the command through the Runner, the files it writes
"""
