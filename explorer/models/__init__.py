"""The models wing (bottom floor, beside ``trace``): loading a draft/target pair (``loading``: the embedded GGUF pair,
any two Hugging Face folders, hub ids or GGUF files, dtype per machine, int8 draft quantization), the loaded pair
(``pair.ModelPair``), tiny random pairs for tests (``tiny``), float32 weights packed for oneDNN (``packed_weights``),
norms, MLPs and rotary embedding compiled into fused kernels (``fused_kernels``) and the target's own first layers
seen as a draft model (``early_exit``) and the cache folder (``cache``). Imports no other wing."""
