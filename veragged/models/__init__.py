"""The example models our examples, benchmarks and tests train: a small Llama (`llama`: `Llama`,
`LlamaConfig`, `parallelize` for TP, `muon_param_groups`) and its MoE variant with fused expert
stacks (`moe`: `MoE`, `MoEConfig`, `expert_parallel`)."""
