"""The seam to SGLang: the plugin entry point, CLI flags, hooks and CPU compatibility.

Importing this package imports nothing from SGLang; each hook module imports what it wraps when it is installed.
`frontend.py` is the client side of the seam: SGLang's frontend DSL (`sglang.lang`) with an adapter per call.
"""
