"""The codec's codings, one module each: its constants, its numpy encoder and decoder, the numba
kernels compiled where they are defined, and the text of its errors (docs/patch-format.md).

Positions: `gaps16` (GAPS16), `gap_codes` (GAP_CODES; its length codes also code EXP_CODES'
values), `class_masks` (CLASS_MASKS). Values: `values` (RAW, DELTA, XOR and byte planes),
`small_codes` (DELTA and XOR as 2-bit codes), `value_codes` (EXP_CODES), `history` (HISTORY
records against their reference, PREDICTED_CODES' prediction). `status` holds what every
position decoder's kernel may return. The batch kernel (`codec.batch`) and the encoder's streams
kernel (`codec.streams`) span codings and live above them.
"""
