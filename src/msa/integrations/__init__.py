"""Drop-ins for serving engines' call conventions, on top of msa's public API:
`msa.integrations.sglang` (SGLang's Hopper MiniMax-M3 decode entry) and `msa.integrations.vllm`
(vLLM's MiniMax-M3 Triton decode function). Each module documents the engine's contract it keeps
and what it refuses."""
