"""sgl_multilora: multi-LoRA serving for SGLang (LoRA-aware radix tree, aLoRA prefix sharing, unified pool).

This package is the engine-agnostic core: no module of it imports SGLang (tests/unit/test_import_layers.py holds
that). The seam to SGLang is `sgl_multilora.patches` (installed from `patches/`), the client-side frontend DSL
extension included (`sgl_multilora.patches.frontend`), and the kernels are `sgl_multilora.triton_kernels` (this
package's own subfolder, never a top-level `triton_kernels`).
"""

__version__ = "0.1.0"
