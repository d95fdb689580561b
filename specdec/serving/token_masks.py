"""The wire codec of structured output's masks: VerifyRequest.token_masks (little-endian bitmasks, bit
t % 8 of byte t / 8 = token t allowed) -> a bool tensor [K + 1, V] for the engine. Checked on arrival,
each failure an INVALID_ARGUMENT naming the field and row, before any work is queued."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.core.errors import invalid_argument


def decode(masks: Sequence[bytes], num_rows: int, vocab_size: int) -> torch.Tensor | None:
    """[num_rows, vocab_size] bool (True: allowed), or None when no masks were sent."""
    if not masks:
        return None
    if len(masks) != num_rows:
        raise invalid_argument(f"token_masks has {len(masks)} masks but {num_rows} positions are scored "
                               "(one per draft token plus one); send one per position or none")
    width = (vocab_size + 31) // 32 * 4  # bytes of a mask covering the vocabulary in 32-bit words
    rows = np.zeros((num_rows, vocab_size), dtype=np.bool_)
    for i, m in enumerate(masks):  # in numpy: a few microseconds a row
        if not 0 < len(m) <= 2 * width:
            raise invalid_argument(f"token_masks[{i}]: {len(m)} bytes; a mask has 1..{width} bytes for "
                                   f"a vocabulary of {vocab_size} (grammar engines may pad a word or so)")
        bits = np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little").view(np.bool_)  # token t: bit t
        if bits[vocab_size:].any():
            outside = vocab_size + int(np.flatnonzero(bits[vocab_size:])[0])
            raise invalid_argument(f"token_masks[{i}] allows token {outside}, outside the vocabulary [0, {vocab_size})")
        bits = bits[:vocab_size]
        if not bits.any():
            raise invalid_argument(f"token_masks[{i}] allows no token")
        rows[i, : bits.shape[0]] = bits
    return torch.from_numpy(rows)
