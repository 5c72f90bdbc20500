"""Compile Triton kernels for a Hopper GPU (sm_90) on a machine without one: triton's own
compiler and the ptxas it ships, no driver. Run as a script, without TRITON_INTERPRET
(under the interpreter @triton.jit gives functions the compiler cannot take); prints one
line per kernel, `ok <name>` or `FAIL <name>: <error>`, and exits 1 on any failure.
The interpreter runs a kernel's Python, not its compilation, so a kernel can pass every
CPU test and still fail to compile: this catches that before a GPU does."""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specserve.kernels import argmax, filters, filters_spread, gumbel, invariant_mm, walk

HOPPER = GPUTarget("cuda", 90, 32)
CHUNKS = {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i64", "temp_ptr": "*fp32", "greedy_ptr": "*i1",
          "seed_ptr": "*i64", "counter_ptr": "*i64", "floor_ptr": "*fp32", "V": "i32", "stride_x": "i32", "C": "i32",
          "PER_REQ": "i32"}
FLOORS = {"x_ptr": "*fp32", "out_ptr": "*fp32", "buf_ptr": "*fp32", "temp_ptr": "*fp32", "topk_ptr": "*i64",
          "topp_ptr": "*fp32", "minp_ptr": "*fp32", "V": "i32", "stride_x": "i32", "PER_REQ": "i32"}
_SPREAD = {"temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32", "minp_ptr": "*fp32", "V": "i32",
           "stride_x": "i32", "PER_REQ": "i32", "C": "i32"}
SPREAD_STATS = {"x_ptr": "*fp32", "stats_ptr": "*fp32", **_SPREAD}
SPREAD_ROUND = {"x_ptr": "*fp32", **{f"{b}_ptr": "*fp32" for b in ("stats", "state", "cuts", "part", "slot", "slot_n")},
                **_SPREAD}
SPREAD_FINAL = {"x_ptr": "*fp32", **{f"{b}_ptr": "*fp32" for b in ("out", "state", "cuts", "part", "slot", "slot_n",
                                                                    "buf")}, **_SPREAD}
_S = filters_spread
_FINAL = {"ROUNDS": _S.ROUNDS, "CUTS": _S.CUTS, "CAP": _S.CAP, "SLOT": _S.SLOT, "BLOCK": filters.BLOCK, "BLOCK_C": 64,
          "VALUE_PASSES": filters.VALUE_PASSES}
INVARIANT_MM = {**{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr")},
                **{p: "*fp32" for p in ("s_ptr", "ss_in", "ss_out", "part_ptr")}, "count_ptr": "*i32",
                **{a: "i32" for a in ("M", "N", "K", "sx", "sw", "ssc", "sy", "sr", "n_ss")}, "eps": "fp32",
                "zero": "fp32"}
_INV = {"swk": 1, "SCALE": 0, "GROUP": 1, "HAS_BIAS": False, "NORM": True, "S_IN": 32, "PREC": "tf32", "BLOCK_M": 16,
        "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": False, "SPLITS": 1, "PREFETCH": 64, "LATE": False, "USE_PDL": True}
# (name, kernel, signature of its runtime arguments, its constexprs, text its PTX must hold)
KERNELS = [
    (f"argmax chunks tempered={t} floored={f} pdl={p}", argmax._chunks_kernel, CHUNKS,
     {"BLOCK": 4096, "TEMPERED": t, "FLOORED": f and t, "USE_PDL": p}, "div.rn.f32" if t else "")
    for t in (True, False) for f in (True, False) for p in (True, False) if t or not f
] + [
    ("argmax chunks bf16 logits", argmax._chunks_kernel, {**CHUNKS, "x_ptr": "*bf16"},
     {"BLOCK": 4096, "TEMPERED": True, "FLOORED": True, "USE_PDL": True}, "div.rn.f32"),
    ("sampling floors", filters._floors_kernel, FLOORS,
     {"BLOCK": filters.BLOCK, "CAP": filters.CAP, "VALUE_PASSES": filters.VALUE_PASSES, "USE_PDL": True}, ""),
    ("sampling floors, bf16 logits", filters._floors_kernel, {**FLOORS, "x_ptr": "*bf16"},
     {"BLOCK": filters.BLOCK, "CAP": filters.CAP, "VALUE_PASSES": filters.VALUE_PASSES, "USE_PDL": False}, ""),
    ("spread floors: stats", _S._stats_kernel, SPREAD_STATS, {"CHUNK": _S.CHUNK, "USE_PDL": True}, ""),
    ("spread floors: stats, bf16 logits", _S._stats_kernel, {**SPREAD_STATS, "x_ptr": "*bf16"},
     {"CHUNK": _S.CHUNK, "USE_PDL": False}, ""),
] + [
    (f"spread floors: round {i}", _S._round_kernel, SPREAD_ROUND,
     {"ROUND": i, "ROUNDS": _S.ROUNDS, "CHUNK": _S.CHUNK, "SUB": _S.SUB, "CUTS": _S.CUTS, "CAP": _S.CAP,
      "SLOT": _S.SLOT, "BLOCK_C": 64, "USE_PDL": True}, "")
    for i in range(_S.ROUNDS)
] + [
    ("spread floors: last program", _S._final_kernel, SPREAD_FINAL, {**_FINAL, "USE_PDL": True}, ""),
    ("spread floors: last program, bf16 logits", _S._final_kernel, {**SPREAD_FINAL, "x_ptr": "*bf16"},
     {**_FINAL, "USE_PDL": False}, ""),
    ("argmax pick", argmax._pick_kernel, {"val_ptr": "*fp32", "idx_ptr": "*i64", "out_ptr": "*i64", "R": "i32",
                                          "C": "i32"}, {"BLOCK_R": 16, "BLOCK_C": 16, "USE_PDL": True}, ""),
    ("greedy walk", walk._walk_kernel, {"tok_ptr": "*i64", "par_ptr": "*i64", "valid_ptr": "*i1", "mask_ptr": "*u8",
                                        "val_ptr": "*fp32", "idx_ptr": "*i64", "out_ptr": "*i64", "N": "i32",
                                        "C": "i32"}, {"BLOCK": 32, "BLOCK_C": 16, "USE_PDL": True}, ""),
    ("invariant product, L2 prefetch, residual", invariant_mm._invariant_mm_kernel, INVARIANT_MM,
     {**_INV, "GATED": False, "RES": True, "SS_OUT": True}, "prefetch.global.L2"),
    ("invariant product, L2 prefetch, gated", invariant_mm._invariant_mm_kernel, INVARIANT_MM,
     {**_INV, "GATED": True, "RES": False, "SS_OUT": False}, "prefetch.global.L2"),
    ("invariant product, released after the K loop", invariant_mm._invariant_mm_kernel, INVARIANT_MM,
     {**_INV, "GATED": True, "RES": False, "SS_OUT": False, "PREFETCH": 0, "LATE": True, "BLOCK_N": 64,
      "BLOCK_K": 256}, "griddepcontrol.launch_dependents"),
    ("gumbel noise", gumbel._gumbel_kernel, {"seed_ptr": "*i64", "counter_ptr": "*i64", "out_ptr": "*fp32",
                                             "V": "i32"}, {"BLOCK": 4096, "USE_PDL": True}, ""),
]


def compile_for_hopper(fn, signature: dict, constexprs: dict) -> str:
    """The PTX of `fn` specialised to `signature` and `constexprs`, for sm_90."""
    full = {**signature, **{k: "constexpr" for k in constexprs}}
    keys = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=keys), target=HOPPER).asm["ptx"]


def main() -> int:
    failed = 0
    for name, fn, signature, constexprs, must_hold in KERNELS:
        try:
            ptx = compile_for_hopper(fn, signature, constexprs)
            assert must_hold in ptx, f"its PTX lacks {must_hold!r}"
            print(f"ok {name}")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:1500]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
