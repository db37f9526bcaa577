"""Regeneration: the target's own answers to the data's prompts, cached per data spec. In-process (engine hf,
`target_model/generate.py`) or from serving engines (engine openai: `client.py`, `phase.py`)."""
