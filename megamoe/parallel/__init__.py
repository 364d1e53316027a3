"""Parallel primitives: the mesh and its process groups, autograd-aware collectives,
tensor-parallel layers and their RNG (what the model, MoE and training layers build on)."""
