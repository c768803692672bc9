"""Integrations with torch serving stacks. Nothing here is imported by `import mtp_cupy`; each submodule imports
its framework (torch, transformers) itself.

* `mtp_cupy.integrations.transformers`: `generate`, a `custom_generate` callable for transformers'
  `model.generate` that drafts with an mtp_cupy proposer and verifies with the HF target model."""
