"""Generation backends for rollouts: TRL's transformers path made fast, and TRL's vLLM path kept in step with phases.

Modules: `compiled` (static KV cache + compiled decode step on TRL's `generate` call), `gqa_attention` (grouped-query
decode attention for long static caches), `vllm_sync` (phase sampling settings and weight pushes on TRL's vLLM
path). Nothing here imports the trainer: functions take the trainer (or the objects TRL built) as arguments.
"""
