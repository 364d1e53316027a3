"""Transformer Engine as the implementation of megamoe's layers (--transformer-impl
transformer_engine): the import guard (loader.py), the FP8 recipe objects of the --fp8-*
flags (recipe.py), the engines that run a layer's GEMMs, fused norms, grouped expert GEMMs
and core attention on TE's modules with the layer's own parameters (linears.py,
experts.py, attention.py), TE's checkpoint extra state (extra_state.py), and the step that
installs them on a model (apply.py). docs/transformer-engine.md says what is verified
where."""
