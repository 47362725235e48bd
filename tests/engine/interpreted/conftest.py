"""Triton 3.6's interpreter turns a scalar into a Python int with int() of a one-element 1-d
array, which NumPy 2 refuses; a kernel loop whose bounds are loaded at run time (both paged
attention kernels) needs that conversion. The interpreter's tensor patch is wrapped to index
the one element first. Only this folder runs under the interpreter."""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime import interpreter
    except ImportError:
        interpreter = None
    if interpreter is not None and hasattr(interpreter, "_patch_lang_tensor"):
        _patch_lang_tensor = interpreter._patch_lang_tensor

        def _scalar_index(self: Any) -> int:
            return int(self.handle.data.reshape(-1)[0])

        def _patched(tensor: Any, scope: Any) -> None:
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", _scalar_index)

        interpreter._patch_lang_tensor = _patched
