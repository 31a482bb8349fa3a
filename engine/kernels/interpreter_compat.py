"""Lets kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1).
Compiled kernels are unaffected. Three interpreter gaps are filled:
- it holds a program id as a 1-element array, and NumPy 2 refuses `int()` of
  that, so a loop whose bounds derive from a program id fails ("only
  0-dimensional arrays can be converted");
- it stores bfloat16 as raw uint16 and `tl.dot` multiplies those integers:
  bf16 operands are widened to float32 first here;
- Triton 3.9's interpreter can hand its load/store a mask held as int32 (an
  int1 tensor combined with a broadcast scalar condition), which its C loader
  refuses ("mask has unsupported dtype"): masks are made boolean first here.
"""

from __future__ import annotations

import os


def patch_interpreter_scalars() -> None:
    """Makes the interpreter read 1-element arrays as Python ints; a no-op
    when the interpreter is off or has no such hook (another Triton version)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pdserve_patched", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._pdserve_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor

    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_bf16

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), tl.int1)

    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return masked_load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        return masked_store(self, ptrs, value, as_bool(mask), cache_policy)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
