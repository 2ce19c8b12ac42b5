"""qeval: quantization evaluation for LLMs.

Measures each serving tier (BF16, INT8, FP8 weight-only, GPTQ/AWQ W4A16, GGUF Q4_K_M, each
optionally with an int8 KV cache) for memory, prefill and decode speed across context depths and
quality against the BF16 reference, then writes a Pareto table, a release-gate verdict
and a fallback ladder. Entry point: ``qeval run RECIPE`` (:mod:`qeval.cli`).
"""
__version__ = "0.1.0"
