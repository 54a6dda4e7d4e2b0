"""Checks before boot (`invoke check`): every problem found without starting the engine.

Where things live (a new check goes in the module of its concern, then into RULES):
  registry.py       RULES (the order of the report), run_checks, check_profile, the report
  context.py        CheckContext: what every rule reads (settings, schema, model facts, the
                    host's detected GPUs filling in what the platform does not pin)
  profile.py        the profile itself: bad values, required keys, serve argv, platform, .env
  files.py          paths a setting names: model, tokenizer, chat template, mounts
  inputs.py         what settings become outside the stack: compose.env values, mount paths,
                    published binds, ENGINE_ENV words
  scheduler.py      speculative decoding and the seqs / batched-tokens / model-length limits
  capacity.py       the detected GPUs vs the platform, tensor parallel vs GPUs and heads,
                    weights + KV cache vs GPU memory
  tuned_configs.py  the tuned Triton kernel configs (fused_moe_configs/, fp8_configs/)
  kv_scales.py      fp8 KV scales of a calibrated copy (invoke calibrate-kv): usable, not stale
  rocm.py           vendor runtime settings: HSA override, AITER, ROCm variables on NVIDIA
  pins.py           build pins that move together, and overlays locked to a vLLM ref
  llamacpp.py       ENGINE=llamacpp: llama-server's argv, the GGUF file, its architecture, the
                    context against the trained one, the memory projection (RULE_ENGINES)
  gguf.py           a GGUF header's facts; llamacpp-archs.txt: the architectures the pinned
                    llama.cpp loads
  gguf_header.py    the bounded GGUF header parser gguf.py reads through (limits on sizes,
                    counts and types; non-regular files refused; GgufError names the file)
  deep.py           `check --deep`: the argv through the pinned vLLM's own parser
  parser_pins.py    reads parser-requirements.txt: the pinned packages of deep.py's parser
                    environment, one `[VERSION]` section per vLLM release (edit the .txt)
"""
