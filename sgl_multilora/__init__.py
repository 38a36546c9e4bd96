"""sgl_multilora: multi-LoRA serving for SGLang (LoRA-aware radix tree, aLoRA prefix sharing, unified pool).

This package is the engine-agnostic core: it never imports SGLang's server. The seam to SGLang is
`sgl_multilora.patches` (installed from `patches/`), and the kernels are `sgl_multilora.triton_kernels` (this
package's own subfolder, never a top-level `triton_kernels`). One client-side exception: `frontend.py` extends
SGLang's frontend DSL (`sglang.lang`).
"""

__version__ = "0.1.0"
