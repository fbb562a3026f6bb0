"""Low-level intrinsics of the embedding kernels: software prefetch, 64-byte non-temporal row stores, a store
fence, and the prefetch distances the kernels use.

Random accesses into the table are software-prefetched ``PF`` (probes), ``PD`` (dedup's scratch-table probes),
``PR`` or ``PL`` (rows) items ahead (``llvm.prefetch``): the probes of independent IDs and the row gathers then
overlap their cache misses instead of waiting for each in turn (the technique of FBGEMM's embedding kernels and
of "group prefetching" for hash joins, Chen et al., ICDE 2004). Prefetches are hints only: they never change a
result.

The intrinsics exist only inside numba-compiled code (``numba.extending.intrinsic``); called from Python they
raise ``NotImplementedError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

PF = 128  # prefetch distance of hash probes, items
PR = 32  # prefetch distance of row accesses (optimizer steps, recency-queue compaction), items
PD = 16  # prefetch distance of dedup's scratch-table probes, items (the best tried)
PL = 128  # prefetch distance of a lookup's recency-and-copy pass and of row gathers, items (the best tried)
PB = 8  # prefetch distance of pooling, examples ahead (the first row of a bag; the best tried: 1-16)
PG = 16  # prefetch distance of bag_grads' per-ID gradient rows, IDs ahead


def kernel_intrinsic(typing_fn: Callable[..., Any]) -> Callable[..., None]:
    """``numba.extending.intrinsic(typing_fn)``, typed as compiled code calls the result.

    numba's stubs give an intrinsic the signature of its typing function, ``typingctx`` first, but compiled code
    calls it without ``typingctx``; typed so, every call site would be a type error. The intrinsics here return
    nothing."""
    return intrinsic(typing_fn)


@kernel_intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the CPU to fetch ``arr[idx]`` (the first element of row ``idx`` for a 2-D array) into cache.

    ``idx`` must be in range (the address is computed without bounds checks; nothing is read)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i = context.cast(builder, args[1], idxty, types.intp)
        zero = ir.Constant(ir.IntType(64), 0)
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [i] + [zero] * (aryty.ndim - 1), wraparound=False, boundscheck=False
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@kernel_intrinsic
def stream64(typingctx, dst, i, src, r, c):
    """``dst[i, 16c:16c+16] = src[r, 16c:16c+16]`` (float32) with one 64-byte non-temporal store.

    ``dst[i, 16c]`` must be 64-byte aligned and all indices in range (no bounds checks). Non-temporal stores are
    weakly ordered: end a pass of them with ``store_fence``."""
    if dst.dtype != types.float32 or src.dtype != types.float32 or dst.ndim != 2 or src.ndim != 2:
        raise TypingError("stream64 copies between 2-D float32 arrays only")
    sig = types.void(dst, i, src, r, c)

    def codegen(context, builder, signature, args):
        dty, ity, sty, rty, cty = signature.args
        d = context.make_array(dty)(context, builder, args[0])
        s = context.make_array(sty)(context, builder, args[2])
        col = builder.mul(context.cast(builder, args[4], cty, types.intp), ir.Constant(ir.IntType(64), 16))
        ii = context.cast(builder, args[1], ity, types.intp)
        rr = context.cast(builder, args[3], rty, types.intp)
        dp = cgutils.get_item_pointer(context, builder, dty, d, [ii, col], wraparound=False, boundscheck=False)
        sp = cgutils.get_item_pointer(context, builder, sty, s, [rr, col], wraparound=False, boundscheck=False)
        vt = ir.VectorType(ir.FloatType(), 16)
        v = builder.load(builder.bitcast(sp, vt.as_pointer()), align=4)
        st = builder.store(v, builder.bitcast(dp, vt.as_pointer()), align=64)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@kernel_intrinsic
def store_fence(typingctx):
    """A full memory fence (orders earlier non-temporal stores before anything after it)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen
