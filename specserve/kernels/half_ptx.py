"""Inline PTX that turns packed integers into half values for a tensor-core dot
(kernels/blocks_tc.py): a q4 byte's nibbles, or a q8 byte, four at a time.

A nibble u goes into the low mantissa bits of a half value whose exponent makes it
MAGIC + u exactly (bf16 0x4300 | u = 128 + u, fp16 0x6400 | u = 1024 + u): a `prmt`
spreads two bytes over a word's halves and one `lop3` masks them and ors in the exponent,
two values at once. The scaled forms go on, in half pairs: u = (MAGIC + u) * 1 - MAGIC
exactly (an fma, so sm_80 builds it too), then one fma with the block's scale and offset,
which arrive as half pairs (s, s) in a word, one a value ($3-$6 and $7-$10 for the four).
bf16 holds no MAGIC + byte exactly, so q8's u = q + 128 (the sign bit flipped) splits
into its nibbles, and q = 16 (hi - 8) + lo is exact; fp16 holds 1024 + u. Each string
takes four bytes in $2 and gives four half values in $0 (bytes 0, 1) and $1 (bytes 2, 3),
for `tl.inline_asm_elementwise(..., pack=4)`.
"""
from __future__ import annotations

import torch

# The low (shift 0) or high (shift 4) nibbles of four bytes as four half values MAGIC + u:
# bytes 0 and 1 spread over a word's two halves (prmt), masked and or-ed with the exponent
# bits in one lop3 (0xEA: (a & b) | c); the same for bytes 2 and 3.
_NIBBLE = """{{
.reg .b32 t, a, b, zero;
mov.b32 zero, 0;
shr.b32 t, $2, {shift};
prmt.b32 a, t, zero, 0x4140;
prmt.b32 b, t, zero, 0x4342;
lop3.b32 $0, a, 0x000F000F, {bits}, 0xEA;
lop3.b32 $1, b, 0x000F000F, {bits}, 0xEA;
}}"""
# The same as half values u s + o, one scale and offset a block: u = (MAGIC + u) * 1 - MAGIC
# exactly, then one fma a pair; the scales and offsets come as half pairs (s, s) in a word,
# one a value ($3-$6, $7-$10 for the four), and a byte pair shares its block's.
_SCALED = """{{
.reg .b32 t, a, b, zero, one, neg;
mov.b32 zero, 0;
mov.b32 one, {one};
mov.b32 neg, {neg};
shr.b32 t, $2, {shift};
prmt.b32 a, t, zero, 0x4140;
prmt.b32 b, t, zero, 0x4342;
lop3.b32 a, a, 0x000F000F, {bits}, 0xEA;
lop3.b32 b, b, 0x000F000F, {bits}, 0xEA;
fma.rn.{kind} a, a, one, neg;
fma.rn.{kind} b, b, one, neg;
fma.rn.{kind} $0, a, $3, $7;
fma.rn.{kind} $1, b, $5, $9;
}}"""
# q8's signed bytes as half values q s + o, four a call ($2), pairs as in _SCALED. bf16 holds
# no MAGIC + byte exactly, so u = q + 128 splits into its nibbles, each MAGIC + nibble, and
# q = 16 (hi - 8) + lo exactly; fp16 holds 1024 + u, and q = (1024 + u) - 1152.
_Q8_BYTES = """xor.b32 t, $2, 0x80808080;
prmt.b32 a, t, zero, 0x4140;
prmt.b32 b, t, zero, 0x4342;
"""  # u = q + 128 of bytes 0, 1 (a) and 2, 3 (b), one to each 16-bit half
_Q8 = {torch.bfloat16: """{
.reg .b32 t, a, b, h, l, zero, m, one, n136, n128, sixteen;
mov.b32 zero, 0;
mov.b32 m, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 n136, 0xC308C308;
mov.b32 n128, 0xC300C300;
mov.b32 sixteen, 0x41804180;
""" + _Q8_BYTES + "".join(f"""shr.b32 h, {src}, 4;
lop3.b32 h, h, 0x000F000F, m, 0xEA;
lop3.b32 l, {src}, 0x000F000F, m, 0xEA;
fma.rn.bf16x2 h, h, one, n136;
fma.rn.bf16x2 l, l, one, n128;
fma.rn.bf16x2 h, h, sixteen, l;
fma.rn.bf16x2 {out}, h, {s}, {o};
""" for src, out, s, o in (("a", "$0", "$3", "$7"), ("b", "$1", "$5", "$9"))) + "}", torch.float16: """{
.reg .b32 t, a, b, zero, one, neg;
mov.b32 zero, 0;
mov.b32 one, 0x3C003C00;
mov.b32 neg, 0xE480E480;
""" + _Q8_BYTES + """lop3.b32 a, a, 0x00FF00FF, 0x64006400, 0xEA;
lop3.b32 b, b, 0x00FF00FF, 0x64006400, 0xEA;
fma.rn.f16x2 a, a, one, neg;
fma.rn.f16x2 b, b, one, neg;
fma.rn.f16x2 $0, a, $3, $7;
fma.rn.f16x2 $1, b, $5, $9;
}"""}

MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # the half value whose mantissa takes a nibble
_BITS = {torch.bfloat16: "0x43004300", torch.float16: "0x64006400"}  # MAGIC's bits, twice
_PAIRS = {torch.bfloat16: dict(kind="bf16x2", one="0x3F803F80", neg="0xC300C300"),
          torch.float16: dict(kind="f16x2", one="0x3C003C00", neg="0xE400E400")}


def nibble_values(dtype: torch.dtype, scaled: bool) -> tuple[str, str]:
    """The PTX of the low and of the high nibbles as half values of `dtype`: MAGIC + u, or
    (`scaled`) u s + o."""
    template, pairs = (_SCALED, _PAIRS[dtype]) if scaled else (_NIBBLE, {})
    lo, hi = (template.format(shift=shift, bits=_BITS[dtype], **pairs) for shift in (0, 4))
    return lo, hi


def q8_values(dtype: torch.dtype) -> str:
    """The PTX of q8's signed bytes as half values q s + o of `dtype`."""
    return _Q8[dtype]
