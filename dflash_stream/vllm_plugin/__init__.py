"""Code that runs inside vLLM's own environment (`python -m vllm...`), not in dflash-stream's: it imports only
vLLM, torch, safetensors and the standard library, never another dflash_stream module (vLLM's environment pins
an older transformers). The server finds the connector through PYTHONPATH=<this folder> (`dflash-stream
serve-command`); `eval --engine vllm` runs `stacked_norm_probe.py` with vLLM's python."""
