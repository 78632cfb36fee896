"""Generation backends for rollouts: TRL's transformers path made fast, and TRL's vLLM path kept in step with phases.

Modules: `engine` (the rollout engine: our own decode loop captured as CUDA graphs), with `decoder` (prefill and the
one-token step through the model's modules), `sampler` (transformers' sampling without a sort or host sync),
`decode_attention` / `decode_attention_triton` (split-K grouped-query attention over the live cache) and
`trl_generation` (the engine on TRL's transformers path); `compiled` (static KV cache + compiled decode step on TRL's
`generate` call), `gqa_attention` (grouped-query decode attention for long static caches), `vllm_sync` (phase
sampling settings and weight pushes on TRL's vLLM path). Nothing here imports the trainer: functions take the trainer
(or the objects TRL built) as arguments.
"""
